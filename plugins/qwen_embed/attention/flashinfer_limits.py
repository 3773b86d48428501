"""What flashinfer's prebuilt kernels cover, known without importing flashinfer."""

# Head sizes with prebuilt (AOT) kernels in the flashinfer wheels `make setup-gpu` installs
# (0.2.x's setup.py builds FLASHINFER_HEAD_DIMS="128,256" by default): any other size would
# JIT-compile with nvcc at the first request, or fail where there is none.
FLASHINFER_HEAD_DIMS = (128, 256)

# 0.2.4 is the first flashinfer whose kernels switch to the tensors' device (a device guard):
# older ones launch on the current device, wrong for an instance on cuda:N with N > 0.
FLASHINFER_MIN = (0, 2, 4)


def version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits or not piece[0].isdigit():
            break
        parts.append(int(digits))
    return tuple(parts)


def flashinfer_problem(version: str | None, has_prebuilt_ops: bool | None) -> str | None:
    """Why an installed flashinfer must not serve (None when it may): too old for the device
    guard, or a build without prebuilt kernels (it would call nvcc at the first request)."""
    if version is None:
        return "flashinfer is not installed"
    if version_tuple(version) < FLASHINFER_MIN:
        need = ".".join(map(str, FLASHINFER_MIN))
        return (
            f"flashinfer {version} launches kernels on the current CUDA device, not the "
            f"tensors' (fixed in {need}); install the pinned one with `make setup-gpu`"
        )
    if has_prebuilt_ops is False:
        return (
            f"flashinfer {version} has no prebuilt kernels (PyPI's source build JIT-compiles "
            f"with nvcc at the first request); install the prebuilt wheel with `make setup-gpu`"
        )
    return None

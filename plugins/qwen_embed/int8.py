"""The int8 linear route: weights per output channel at load, activations per token at run time.

`x @ W.T` becomes `(xs * ws) * (q(x) @ q(W).T)`, with q() symmetric int8 and the product
accumulated in int32 by `torch._int_mm` (oneDNN's VNNI/AMX int8 GEMM on x86). The quantisation
before and the rescale after are elementwise passes over activation-sized tensors that cost as
much as the int8 GEMM saves when run as separate eager ops, so both are compiled with
torch.compile (Inductor fuses each into one loop); where compiling fails (no C++ compiler) they
run eagerly, still exact, only slower. Embeddings, norms, attention and pooling stay in floats.
"""

from __future__ import annotations

import locale
import logging
import threading

import torch
from torch import nn

log = logging.getLogger(__name__)
_QMAX = 127.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q int8 [rows, k], scale fp32 [rows, 1]) with x ~= q * scale."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / _QMAX
    return torch.round(x.float() / scale).clamp(-_QMAX, _QMAX).to(torch.int8), scale


def _rescale(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    return (acc.float() * x_scale * w_scale).to(dtype)


class _Kernels:
    """quantize_rows and _rescale, compiled on first use (once per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.quantize, self.rescale = quantize_rows, _rescale
        self.compiled: bool | None = None  # None: not tried yet

    def ensure_compiled(self) -> None:
        with self._lock:
            if self.compiled is not None:
                return
            try:
                import torch._inductor.config as inductor

                # Inductor reads and writes UTF-8 source with the locale's encoding: inside
                # Triton's Python stub that is ASCII (no locale set up), so use UTF-8.
                if locale.getpreferredencoding(False).lower() not in ("utf-8", "utf8"):
                    locale.setlocale(locale.LC_CTYPE, "C.UTF-8")

                # Compile in this process: in Triton's Python stub sys.executable is the stub,
                # so Inductor's compile-worker subprocesses could not start.
                inductor.compile_threads = 1
                quantize = torch.compile(quantize_rows, dynamic=True)
                rescale = torch.compile(_rescale, dynamic=True)
                weight, w_scale = torch.ones(8, 16, dtype=torch.int8), torch.ones(1, 8)
                for rows in (2, 1):  # 1 row is specialised separately by dynamic shapes
                    for dtype in (torch.float32, torch.bfloat16):
                        q, s = quantize(torch.ones(rows, 16, dtype=dtype))
                        rescale(torch._int_mm(q, weight.t()), s, w_scale, dtype)
                self.quantize, self.rescale, self.compiled = quantize, rescale, True
            except Exception as e:  # no compiler, unsupported platform: exact but slower
                log.warning("int8 route: torch.compile failed (%s); running eagerly", e)
                self.compiled = False


KERNELS = _Kernels()


class Int8Weight(nn.Module):
    """A linear layer's weight as int8 [out, in] plus one fp32 scale per output channel."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        q, scale = quantize_rows(weight.detach())
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.view(1, -1))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, x_scale = KERNELS.quantize(x2)
        out = KERNELS.rescale(torch._int_mm(xq, self.qweight.t()), x_scale, self.scale, x.dtype)
        if bias is not None:
            out.add_(bias.to(out.dtype))
        return out.view(*shape[:-1], out.shape[-1])

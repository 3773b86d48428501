"""What this host offers the server: its GPUs, read from the device nodes without importing
CUDA, and its shared memory."""

from __future__ import annotations

import os
import re
from pathlib import Path

from qwen_embed_client.contract import MAX_ANSWER_BYTES

# Where Triton's Python models and the server pass every request's tensors
SHARED_MEMORY = Path("/dev/shm")
CGROUPS = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def _device_nodes(dev: Path) -> int:
    return sum(1 for p in dev.glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name))


def gpu_count(dev: Path = Path("/dev"), visible: str | None = None) -> int:
    """NVIDIA GPUs this process may use: the device nodes (a container sees only those it was
    given), narrowed by CUDA_VISIBLE_DEVICES where set."""
    nodes = _device_nodes(dev)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None:
        return nodes
    listed = [d for d in visible.split(",") if d.strip() not in ("", "-1")]
    return min(nodes, len(listed))


def gpu_present(dev: Path = Path("/dev")) -> bool:
    """An NVIDIA driver or GPU on this host, whatever CUDA_VISIBLE_DEVICES says."""
    return (dev / "nvidiactl").exists() or _device_nodes(dev) > 0


def shared_memory_bytes(path: Path = SHARED_MEMORY) -> int | None:
    """The size of the host's (a container's own) shared memory; None where there is none."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def answer_bytes_limit(shared: int | None) -> int:
    """What one request's vectors may take on a host with `shared` bytes of shared memory:
    MAX_ANSWER_BYTES, or a quarter of it where that is less. A Python model's pool there grows
    past its largest answer and never shrinks, and the other models' pools share it; an answer
    it cannot hold is never sent, and its request waits for its deadline."""
    return MAX_ANSWER_BYTES if shared is None else min(MAX_ANSWER_BYTES, shared // 4)


def memory_limit(proc: Path = Path("/proc"), cgroups: Path = CGROUPS) -> tuple[int, str] | None:
    """(bytes, whose) the most memory this process and its children may hold: the smallest
    limit of its memory cgroup and the cgroups above it (v2's memory.max, v1's
    memory.limit_in_bytes; a container's own is its root), else the host's MemTotal; None
    where neither is known."""
    limits = []
    for line in _lines(proc / "self" / "cgroup"):
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2's unified hierarchy
            root, name = cgroups, "memory.max"
        elif "memory" in controllers.split(","):
            root, name = cgroups / "memory", "memory.limit_in_bytes"
        else:
            continue
        here = root / path.lstrip("/")
        for folder in (here, *here.parents):
            limit = _read_limit(folder / name)
            if limit is not None:
                limits.append(limit)
            if folder == root:
                break
    if limits:
        return min(limits), "this container's memory limit"
    total = _meminfo(proc, "MemTotal")
    return None if total is None else (total, "this host's memory")


def memory_available(proc: Path = Path("/proc")) -> int | None:
    """What this host could give new processes now without swapping (MemAvailable); None
    where the kernel does not say."""
    return _meminfo(proc, "MemAvailable")


def _meminfo(proc: Path, field: str) -> int | None:
    for line in _lines(proc / "meminfo"):
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return None


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit() or int(text) >= UNLIMITED:
        return None
    return int(text)

"""What this host offers the server, read from the device nodes without importing CUDA."""

from __future__ import annotations

import os
import re
from pathlib import Path


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

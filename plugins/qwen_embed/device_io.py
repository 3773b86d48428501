"""Host <-> device copies that keep a GPU busy.

Inputs go up from pinned memory without blocking the host (a copy from pageable memory makes
the host wait until the GPU has finished everything queued before it, so the next batch could
not be planned while the current one runs); results come back into pinned memory and are waited
for only when the host reads them, after the next forward is queued. On CPU both are the tensors
themselves.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`; to a GPU from pinned memory, without waiting for the copy."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostResult:
    """A tensor's copy on its way to the host: `numpy()` waits for it (a GPU tensor's copy is
    queued behind the work that makes it)."""

    def __init__(self, t: torch.Tensor):
        self._done = None
        if t.device.type == "cuda":
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = t

    def numpy(self) -> np.ndarray:
        if self._done is not None:
            self._done.synchronize()
        return self._host.numpy()

"""Entry point of a tensor-parallel worker: `python -m qwen_embed.worker ARGS_JSON RANK`."""

from __future__ import annotations

import os
import sys
import threading
import time

import torch


def _exit_with_parent() -> None:
    # A worker must never outlive the process that owns it (crash, kill -9, Triton unload).
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def threads_per_rank(allowed_cpus: int, tp_size: int) -> int:
    """A CPU rank's share of the CPUs this process may run on (its affinity mask: containers
    and cpusets allow fewer than the machine has)."""
    return max(1, allowed_cpus // tp_size)


def main() -> None:
    from .engine import build_model
    from .parallel import RankSpec, serve_rank

    _exit_with_parent()
    spec = RankSpec.from_json(sys.argv[1])
    rank = int(sys.argv[2])
    device = spec.device_for(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads_per_rank(len(os.sched_getaffinity(0)), spec.tp_size))
    serve_rank(spec, rank, build_model)


if __name__ == "__main__":
    main()

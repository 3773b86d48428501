"""Entry point of a tensor-parallel worker: `python -m qwen_embed.worker ARGS_JSON RANK`."""

from __future__ import annotations

import json
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


def main() -> None:
    from .engine import build_model
    from .parallel import RankArgs, serve_rank

    _exit_with_parent()
    args = RankArgs(**json.loads(sys.argv[1]))
    rank = int(sys.argv[2])
    device = args.device_for(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp_size))
    serve_rank(args, rank, build_model)


if __name__ == "__main__":
    main()

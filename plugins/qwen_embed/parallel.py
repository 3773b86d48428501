"""Tensor-parallel process management: rank 0 is the caller, ranks 1.. are child processes.

Two groups per encoder: a gloo "control" group that carries each batch's token ids from rank 0
to the others (CPU tensors, may wait idle forever), and a "data" group for the all-reduces
inside the forward (gloo on CPU, NCCL on GPU). Each encoder has its own TCPStore, on a free port
unless an address is given, so several encoders on one host never collide.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .chunking import ChunkForward, unpack_texts
from .layers import TPGroup
from .media import MediaForward
from .route import Route
from .settings import EncoderSettings

CMD_STOP, CMD_FORWARD, CMD_CHUNKS, CMD_EVERY_ROW, CMD_MEDIA, CMD_MEDIA_EVERY_ROW = range(6)
# Rank 0 waiting for its GPU: how often it asks whether the work is done, and how often
# whether a worker failed (a store round trip).
_POLL_S, _CHECK_EVERY_S = 2e-4, 0.01
# Workers block on the next command for as long as the server is idle.
_IDLE_WAIT = datetime.timedelta(days=365)


def wait_for_device(
    done: Callable[[], bool],
    failure: Callable[[], str | None],
    poll_s: float = _POLL_S,
    check_every_s: float = _CHECK_EVERY_S,
) -> None:
    """Until `done()` (a CUDA event's query), raising as soon as `failure()` names a failed
    worker. With NCCL, a rank that dies mid-forward leaves the others' all-reduce kernels
    waiting on the GPU; a device-to-host copy would then block the CPU until NCCL's watchdog
    (dist_timeout_s) ends the process. Gloo fails the all-reduce itself instead."""
    checked = time.monotonic()
    while not done():
        if time.monotonic() - checked >= check_every_s:
            if (why := failure()) is not None:
                raise RuntimeError(f"a tensor-parallel worker failed mid-forward: {why}")
            checked = time.monotonic()
        time.sleep(poll_s)


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds its shard from: the checkpoint, the settings and the route, whole.
    Sent to the workers as JSON."""

    model_dir: str
    settings: EncoderSettings
    route: Route

    @property
    def host(self) -> str:
        return self.settings.dist_addr.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.settings.dist_addr.rpartition(":")[2])

    @property
    def tp_size(self) -> int:
        return self.settings.tp_size

    @property
    def timeout_s(self) -> float:
        return self.settings.dist_timeout_s

    def device_for(self, rank: int) -> torch.device:
        base = torch.device(self.route.device)
        if base.type == "cuda":
            return torch.device("cuda", (base.index or 0) + rank)
        return base

    def with_port(self, port: int) -> RankSpec:
        return replace(self, settings=self.settings.replace(dist_addr=f"{self.host}:{port}"))

    def to_json(self) -> str:
        return json.dumps(
            {
                "model_dir": self.model_dir,
                "settings": asdict(self.settings),
                "route": self.route.to_dict(),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        data = json.loads(text)
        return cls(
            data["model_dir"], EncoderSettings(**data["settings"]), Route.from_dict(data["route"])
        )


def _python_executable() -> str:
    # Inside Triton's Python backend stub sys.executable is the stub, not an interpreter.
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    return str(Path(sys.prefix) / "bin" / "python3")


def _make_groups(args: RankSpec, rank: int, store: dist.Store) -> tuple[object, TPGroup]:
    timeout = datetime.timedelta(seconds=args.timeout_s)
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, args.tp_size, timeout)
    if args.device_for(rank).type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, args.tp_size, options)
        # The communicator now, at load, not lazily in the first request's all-reduce.
        data.eager_connect_single_device(args.device_for(rank))
    else:
        data = dist.ProcessGroupGloo(dist.PrefixStore("data", store), rank, args.tp_size, timeout)
    return control, TPGroup(rank=rank, size=args.tp_size, group=data)


class TPLauncher:
    """Rank 0's handle on the worker processes."""

    def __init__(self, args: RankSpec):
        self.store = dist.TCPStore(
            args.host,
            args.port,
            args.tp_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=args.timeout_s),
            wait_for_workers=False,
        )
        # With port 0 the store picked a free one; workers must be told which.
        self.args = args.with_port(self.store.port)
        self.procs: list[subprocess.Popen] = []
        self.control = None
        env = dict(os.environ)
        plugins_dir = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [plugins_dir, env.get("PYTHONPATH")]))
        for rank in range(1, args.tp_size):
            self.procs.append(
                subprocess.Popen(
                    [
                        _python_executable(),
                        "-m",
                        "qwen_embed.worker",
                        self.args.to_json(),
                        str(rank),
                    ],
                    env=env,
                )
            )

    def wait_for(self, stage: str) -> None:
        """Wait until every worker has written `stage/<rank>` = ok; fail fast if one dies."""
        keys = [f"{stage}/{r}" for r in range(1, self.args.tp_size)]
        deadline = time.monotonic() + self.args.timeout_s
        while not self.store.check(keys):
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None and not self.store.check([f"{stage}/{rank}"]):
                    raise RuntimeError(
                        f"TP rank {rank} exited with code {proc.returncode} before '{stage}'"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"TP workers did not reach '{stage}' in {self.args.timeout_s}s")
            time.sleep(0.05)
        for rank, key in enumerate(keys, start=1):
            status = self.store.get(key).decode()
            if status != "ok":
                raise RuntimeError(f"TP rank {rank} failed during '{stage}': {status}")

    def join_groups(self) -> TPGroup:
        self.wait_for("joined")
        self.control, tp = _make_groups(self.args, 0, self.store)
        return tp

    def send_batch(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        every_row: bool = False,
        adapters: np.ndarray | None = None,
    ) -> None:
        """A forward of a flat batch (Planner.plan's arguments)."""
        command = CMD_EVERY_ROW if every_row else CMD_FORWARD
        self._send(command, input_ids, cu_seqlens, adapters)

    def _send(self, command: int, input_ids, cu_seqlens, adapters: np.ndarray | None) -> None:
        header = _header(command, input_ids.numel(), cu_seqlens.numel(), adapters is not None)
        self.control.broadcast(header, 0).wait()
        self.control.broadcast(input_ids, 0).wait()
        self.control.broadcast(cu_seqlens, 0).wait()
        if adapters is not None:
            self.control.broadcast(torch.from_numpy(adapters), 0).wait()  # _receive_adapters

    def send_media(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        media: MediaForward,
        every_row: bool = False,
        adapters: np.ndarray | None = None,
    ) -> None:
        """A forward of a flat batch with images and video: its ids and positions on three
        axes; rank 0 runs the tower and broadcasts the visuals' tokens inside the forward
        (MediaForward.embed)."""
        command = CMD_MEDIA_EVERY_ROW if every_row else CMD_MEDIA
        self._send(command, input_ids, cu_seqlens, adapters)
        self.control.broadcast(torch.from_numpy(media.positions_host), 0).wait()

    def send_every_row(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        media: MediaForward | None,
        adapters: np.ndarray | None = None,
    ) -> None:
        """A forward whose every row's final hidden state is read (per-token vectors)."""
        if media is None:
            self.send_batch(input_ids, cu_seqlens, every_row=True, adapters=adapters)
        else:
            self.send_media(input_ids, cu_seqlens, media, every_row=True, adapters=adapters)

    def send_chunks(self, packed: torch.Tensor, adapters: np.ndarray | None = None) -> None:
        """A late-chunking forward: the chunked texts (chunking.pack_texts) and each text's
        adapter, planned alike on every rank."""
        count = 0 if adapters is None else len(adapters)
        header = _header(CMD_CHUNKS, packed.numel(), count, adapters is not None)
        self.control.broadcast(header, 0).wait()
        self.control.broadcast(packed, 0).wait()
        if adapters is not None:
            self.control.broadcast(torch.from_numpy(adapters), 0).wait()  # _receive_adapters

    def failure(self, wait_s: float = 2.0) -> str | None:
        """What a worker reported or how it ended, once a collective failed: a peer's socket
        closes as it exits, so its exit may take a moment to be seen."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                if self.store.check([f"failed/{rank}"]):
                    return f"TP rank {rank} failed: {self.store.get(f'failed/{rank}').decode()}"
                if proc.poll() is not None:
                    return f"TP rank {rank} exited with code {proc.returncode}"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def close(self, graceful: bool = True) -> None:
        """Stop the workers: with `graceful` a stop command they finish on, else (a failed
        forward left them inside a collective) they are killed at once."""
        if not graceful:
            for proc in self.procs:
                proc.kill()
            self.control = None
        if self.control is not None:
            try:
                work = self.control.broadcast(_header(CMD_STOP, 0, 0), 0)
                work.wait(datetime.timedelta(seconds=5))
            except Exception:  # a dead worker cannot take the stop; it is killed below
                pass
            self.control = None
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []


def _header(command: int, num_tokens: int, cu_len: int, adapters: bool = False):
    """A command to the workers: (command, tokens, offsets, 1 where each sequence's adapter
    follows the offsets)."""
    return torch.tensor([command, num_tokens, cu_len, int(adapters)])


def _receive_adapters(control, count: int) -> np.ndarray:
    """Each of `count` texts' adapter index (lora.py), as rank 0 sends them after a batch."""
    adapters = torch.empty(count, dtype=torch.int64)
    control.broadcast(adapters, 0).wait()
    return adapters.numpy()


def serve_rank(args: RankSpec, rank: int, build_model) -> None:
    """Worker side: join, build this rank's shard, then run forwards until told to stop."""

    store = dist.TCPStore(
        args.host,
        args.port,
        args.tp_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    store.set(f"joined/{rank}", "ok")
    control, tp = _make_groups(args, rank, store)
    try:
        model = build_model(args, tp)
    except Exception as e:
        store.set(f"ready/{rank}", f"{type(e).__name__}: {e}")
        raise
    store.set(f"ready/{rank}", "ok")
    # The list form with options: torch before 2.7 has no broadcast(tensor, root, timeout).
    idle = dist.BroadcastOptions()
    idle.rootRank, idle.timeout = 0, _IDLE_WAIT
    while True:
        header = _header(0, 0, 0)
        control.broadcast([header], idle).wait()
        cmd, num_tokens, cu_len, with_adapters = header.tolist()
        if cmd == CMD_STOP:
            return
        if cmd == CMD_CHUNKS:  # cu_len: the texts' count where they name adapters
            packed = torch.empty(num_tokens, dtype=torch.int64)
            control.broadcast(packed, 0).wait()
            adapters = _receive_adapters(control, cu_len) if with_adapters else None
        else:
            input_ids = torch.empty(num_tokens, dtype=torch.int64)
            cu_seqlens = torch.empty(cu_len, dtype=torch.int32)
            control.broadcast(input_ids, 0).wait()
            control.broadcast(cu_seqlens, 0).wait()
            adapters = _receive_adapters(control, cu_len - 1) if with_adapters else None
            media = None
            if cmd in (CMD_MEDIA, CMD_MEDIA_EVERY_ROW):
                positions = torch.empty(num_tokens, 3, dtype=torch.int64)
                control.broadcast(positions, 0).wait()
                media = MediaForward.of_flat_ids(
                    input_ids.numpy(), positions.numpy(), model.config.media, model.planner.device
                )
        # The same batch through the same planner as rank 0: the same prefix hits and misses.
        try:
            planner = model.planner
            if cmd == CMD_CHUNKS:
                texts = unpack_texts(packed)
                forward = ChunkForward(
                    texts, planner.readout, planner.prune, planner.device, adapters
                )
                ctx = forward.context
            else:
                every_row = cmd in (CMD_EVERY_ROW, CMD_MEDIA_EVERY_ROW)
                ctx = planner.plan(input_ids, cu_seqlens, every_row, media, adapters)
            model(ctx)
            planner.commit(ctx)
        except Exception as e:  # told to rank 0, then exit: its collectives fail on the exit
            store.set(f"failed/{rank}", f"{type(e).__name__}: {e}"[:500])
            raise

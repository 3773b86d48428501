"""Which cores each CPU encoder instance (and the tokenizers) run on.

One encoder instance per NUMA node by default, each pinned to its share of the physical cores
with one OpenMP thread per core; `count` instances split the cores evenly (one per core held up
best beside a busy neighbour on 2 cores, at the price of a model copy per instance and smaller
batches per execute: perf/results/neighbour.md). Where the machine has
cores to spare (TOKENIZER_RESERVE_FROM cores or more), the last core is kept for the tokenizer
instances so that they never preempt an encoder thread. Why pin at all: an encoder's OpenMP
threads meet at a barrier after every parallel region, so a thread that loses its core to
another process stalls all of them; pinned instances with fewer threads each lose only the share
of the core they actually lost.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
TOKENIZER_RESERVE_FROM = 8
SYS_CPU = Path("/sys/devices/system")

Core = tuple[int, ...]  # the logical CPUs (hyperthreads) of one physical core


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]"""
    cpus: list[int] = []
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def read_topology(sys_dir: Path = SYS_CPU) -> list[list[Core]]:
    """Physical cores per NUMA node, limited to the CPUs this process may run on."""
    allowed = os.sched_getaffinity(0)
    nodes = sorted(sys_dir.glob("node/node[0-9]*"), key=lambda p: int(p.name[4:]))
    node_cpus = [parse_cpu_list((n / "cpulist").read_text()) for n in nodes] or [sorted(allowed)]
    topology = []
    for cpus in node_cpus:
        cores: dict[Core, None] = {}
        for cpu in cpus:
            if cpu not in allowed:
                continue
            siblings = sys_dir / f"cpu/cpu{cpu}/topology/thread_siblings_list"
            group = parse_cpu_list(siblings.read_text()) if siblings.exists() else [cpu]
            cores[tuple(c for c in group if c in allowed)] = None
        if cores:
            topology.append(list(cores))
    return topology


@dataclass(frozen=True)
class Placement:
    cpus: tuple[int, ...]  # logical CPUs to pin to
    threads: int  # OpenMP threads: one per physical core

    def describe(self) -> str:
        return f"{self.threads} threads on CPUs {','.join(map(str, self.cpus))}"


def _reserve(topology: list[list[Core]]) -> tuple[list[list[Core]], Core | None]:
    """(cores left for encoders, the core kept for tokenizers or None). The core comes from the
    node with the most cores (the last of equals), so no node is left without one unless every
    node has a single core; a node left empty is dropped."""
    if sum(len(node) for node in topology) < TOKENIZER_RESERVE_FROM:
        return topology, None
    donor = max(range(len(topology)), key=lambda i: (len(topology[i]), i))
    spare = topology[donor][-1]
    nodes = [node[:-1] if i == donor else node for i, node in enumerate(topology)]
    return [node for node in nodes if node], spare


def encoder_placement(topology: list[list[Core]], count: int, index: int) -> Placement:
    """Cores of encoder instance `index` of `count` (one per NUMA node where the counts match)."""
    nodes, _ = _reserve(topology)
    if count == len(nodes):
        groups = nodes
    else:
        cores = [core for node in nodes for core in node]
        n = max(1, count)
        if n > len(cores):  # more instances than cores: one core each, shared round robin
            groups = [[cores[i % len(cores)]] for i in range(n)]
        else:  # contiguous, nearly equal shares
            groups = [cores[i * len(cores) // n : (i + 1) * len(cores) // n] for i in range(n)]
    mine = groups[index % len(groups)]
    return Placement(tuple(sorted(c for core in mine for c in core)), len(mine))


def tokenizer_placement(topology: list[list[Core]], gpus: int = 0) -> Placement | None:
    """The core kept for the tokenizers, or None: no spare core, or the encoders run on `gpus`
    GPUs and pin no core, so the tokenizers float over all of them."""
    if gpus:
        return None
    _, spare = _reserve(topology)
    return None if spare is None else Placement(tuple(spare), 1)


# Tokenizer processes beside GPU encoders: one per CPU the encoder instances leave, at least
# two, at most this many (one H100 can outrun a single core's tokenizer on a 0.6B model).
MAX_GPU_TOKENIZERS = 16


def gpu_instance_groups(gpus: int, cpus: int, per_gpu: int = 1) -> tuple[str, str]:
    """(encoder, tokenizer) instance groups for a host whose encoders run on its `gpus` GPUs
    (KIND_GPU: Triton puts `per_gpu` instances on every GPU it sees) with `cpus` CPUs."""
    tokenizers = min(MAX_GPU_TOKENIZERS, max(2, cpus - gpus * per_gpu))
    return f"count: {per_gpu}, kind: KIND_GPU", f"count: {tokenizers}, kind: KIND_CPU"


def pin(placement: Placement) -> None:
    """Pin this process (threads started from now on inherit it) and size torch's pool.

    Call before the first parallel torch op: OpenMP starts its threads then.
    """
    import torch

    os.sched_setaffinity(0, placement.cpus)
    torch.set_num_threads(placement.threads)
    log.info("pinned to %s", placement.describe())


def instance_index(instance_name: str, group_counts: list[int]) -> int:
    """Index of an instance among all of a model's instances: Triton 2.51 names them
    '<model>_<group>_<k>' (k counts within the instance group)."""
    parts = instance_name.rsplit("_", 2)
    if len(parts) < 3 or not (parts[1].isdigit() and parts[2].isdigit()):
        return 0
    group, k = int(parts[1]), int(parts[2])
    return sum(group_counts[:group]) + k

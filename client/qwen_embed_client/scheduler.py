"""Idle-filling, throughput-adaptive distribution of one job over servers of unequal speed.

Every server runs a few worker slots; a free slot takes the next chunk of the job, sized so one
request takes about `target_s` on that server (from its measured texts/s, remembered across
jobs). There are no rounds: a fast server simply comes back for more sooner. A chunk that fails
with a retryable error goes back to the queue for another server, and the failing server is
benched for a while. Results are reassembled in input order.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

MIN_CHUNK = 4
EMA = 0.3


@dataclass
class ServerState:
    texts_per_s: float = 0.0  # per request in flight, exponential moving average
    benched_until: float = 0.0
    texts_done: int = 0

    def chunk_size(self, max_chunk: int, target_s: float) -> int:
        if self.texts_per_s <= 0:
            return min(MIN_CHUNK, max_chunk)
        return max(1, min(max_chunk, max(MIN_CHUNK, round(self.texts_per_s * target_s))))

    def record(self, texts: int, seconds: float) -> None:
        rate = texts / max(seconds, 1e-6)
        self.texts_per_s = (
            rate if self.texts_per_s <= 0 else (1 - EMA) * self.texts_per_s + EMA * rate
        )
        self.texts_done += texts

    def benched(self) -> bool:
        return self.benched_until > time.monotonic()


async def run_job(
    n: int,
    states: list[ServerState],
    send: Callable[[int, int, int], Awaitable[tuple]],
    *,
    max_chunk: int,
    slots_per_server: int,
    bench_s: float,
    target_s: float = 1.0,
    whole: bool = False,
) -> list:
    """Embed texts [0, n) through `send(server, start, end)`; returns results in order.
    `whole`: chunks of max_chunk texts (a listwise reranker's documents belong together),
    else sized by each server's rate."""
    results: dict[int, tuple] = {}
    cursor = 0
    retry: deque[tuple[int, int, int]] = deque()  # (start, end, servers tried)
    in_flight = 0
    changed = asyncio.Event()
    failure: list[BaseException] = []

    def next_chunk(state: ServerState) -> tuple[int, int, int] | None:
        nonlocal cursor
        if retry:
            return retry.popleft()
        if cursor < n:
            size = max_chunk if whole else state.chunk_size(max_chunk, target_s)
            start, cursor = cursor, min(n, cursor + size)
            return start, cursor, 0
        return None

    async def worker(index: int) -> None:
        nonlocal in_flight
        state = states[index]
        while not failure:
            if cursor >= n and not retry and in_flight == 0:
                return
            if state.benched():
                await asyncio.sleep(min(0.5, state.benched_until - time.monotonic()))
                continue
            chunk = next_chunk(state)
            if chunk is None:  # nothing to take now, but a chunk in flight may come back
                changed.clear()
                await changed.wait()
                continue
            start, end, tried = chunk
            in_flight += 1
            began = time.monotonic()
            try:
                results[start] = await send(index, start, end)
                state.record(end - start, time.monotonic() - began)
            except Exception as e:
                # Errors with .retryable (EmbeddingError) may succeed on another server.
                if getattr(e, "retryable", False) and tried + 1 < len(states):
                    retry.append((start, end, tried + 1))
                    state.benched_until = time.monotonic() + bench_s
                else:
                    failure.append(e)
            finally:
                in_flight -= 1
                changed.set()

    tasks = [
        asyncio.ensure_future(worker(i))
        for i in range(len(states))
        for _ in range(slots_per_server)
    ]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:  # cancelled job: cancel the requests still in flight
            t.cancel()
    if failure:
        raise failure[0]
    return [results[k] for k in sorted(results)]

"""Host <-> device copies (qwen_embed/batch.py) and the engine's queue of forwards: on CPU
the tensors themselves; on a GPU (tests marked `gpu`) no forward waits for the host, and a
launched call (Encoder.launch_checked) leaves its last forward to be read later."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwen_embed import Encoder
from qwen_embed.batch import HostResult, to_device

from reference import random_sequences


def test_on_cpu_the_copies_are_the_tensors_themselves():
    t = torch.arange(6)
    assert to_device(t, "cpu") is t
    assert np.array_equal(HostResult(t).numpy(), np.arange(6))


def test_results_land_in_order_across_many_queued_batches(checkpoint):
    """Each batch's result is read after the next is queued: every row still lands where its
    text was, whatever batch ran it."""
    seqs = random_sequences([5, 60, 1, 33, 90, 12, 7, 48], seed=2)
    with Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32") as enc:
        alone = np.stack([enc.embed([s])[0] for s in seqs])
        with Encoder.from_pretrained(
            checkpoint("qwen3"), dtype="float32", max_batch_tokens=64
        ) as small:
            batched = small.embed(seqs)
    np.testing.assert_allclose(batched, alone, atol=1e-5)


def test_launched_calls_read_in_any_order_give_each_its_own_rows(checkpoint):
    """launch_checked leaves a call's last forward unread until result(): two calls launched
    before either is read (the Triton encoder's next execute) each get their own rows, the
    rows pool_checked gives."""
    first = random_sequences([5, 60, 1, 33], seed=4)
    second = random_sequences([90, 12, 7, 48, 20], seed=5)
    with Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32", max_batch_tokens=64) as enc:
        expected = [enc.pool_checked(first), enc.pool_checked(second)]
        a, b = enc.launch_checked(first), enc.launch_checked(second)
        np.testing.assert_array_equal(b.result(), expected[1])
        np.testing.assert_array_equal(a.result(), expected[0])


@pytest.mark.gpu
def test_a_gpu_forward_never_waits_for_the_host(checkpoint):
    """Profiled: no blocking copy or stream sync in embed(); the host waits on one event per
    batch, each read after the next batch is queued. launch_checked waits on all but its last
    batch's; result() on that one (a server plans its next batch meanwhile)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from torch.profiler import ProfilerActivity, profile

    seqs = random_sequences([300, 280, 260, 240, 200, 150], seed=3)
    with Encoder.from_pretrained(
        checkpoint("qwen3_head128"), dtype="bfloat16", device="cuda:0", max_batch_tokens=600
    ) as enc:
        enc.embed(seqs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            enc.embed(seqs)
        expected = enc.pool_checked(seqs)
        with profile(activities=[ProfilerActivity.CPU]) as launched:
            pending = enc.launch_checked(seqs)
        with profile(activities=[ProfilerActivity.CPU]) as read:
            rows = pending.result()
    calls = [e.name for e in prof.events()]
    blocking = [n for n in calls if n in ("cudaStreamSynchronize", "cudaDeviceSynchronize")]
    assert blocking == [] and "cudaMemcpy" not in calls
    assert calls.count("cudaEventSynchronize") == 3  # 600-token batches: 3 of them
    waits = [[e.name for e in p.events()].count("cudaEventSynchronize") for p in (launched, read)]
    assert waits == [2, 1]
    np.testing.assert_array_equal(rows, expected)

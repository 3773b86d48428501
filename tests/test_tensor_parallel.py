"""tp_size=2 over gloo equals tp_size=1, and leaves no process behind."""

import json
import os
import shutil
import time

import numpy as np
import pytest

from qwen_embed import CheckpointError, ChunkedText, Encoder, EncoderBroken
from qwen_embed.parallel import wait_for_device
from qwen_embed_deploy.launcher import proc_stat

from reference import cosine, random_sequences, reference_embeddings

pytestmark = pytest.mark.server  # starts tritonserver or other processes

TP_MAX_ABS = 1e-5  # fp32: only the summation order of the all-reduces differs


def worker_pids() -> set[int]:
    """PIDs of our TP workers that are children of this test process."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            ppid = int(proc_stat(entry)[1])
        except OSError:
            continue
        if b"qwen_embed.worker" in cmd and ppid == os.getpid():
            pids.add(int(entry))
    return pids


def wait_no_workers(timeout=10.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while worker_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    return worker_pids()


# qwen2: 14 query / 2 kv heads -> 7 + 1 per rank; qwen3_kv1: one kv head replicated on both.
@pytest.mark.parametrize("name", ["qwen2", "qwen3_kv1", "qwen3"])
def test_tp2_equals_tp1(checkpoint, name):
    seqs = random_sequences([1, 9, 77, 200, 33], seed=6)
    with Encoder.from_pretrained(checkpoint(name), tp_size=1, dtype="float32") as enc:
        single = enc.embed(seqs)
    with Encoder.from_pretrained(
        checkpoint(name), tp_size=2, max_batch_tokens=128, dtype="float32"
    ) as enc:
        assert len(worker_pids()) == 1
        sharded = enc.embed(seqs)
        again = enc.embed(seqs[:2], dimensions=8, normalize=False)
    assert np.abs(single - sharded).max() <= TP_MAX_ABS
    with Encoder.from_pretrained(checkpoint(name), dtype="float32") as enc:
        ref_again = enc.embed(seqs[:2], dimensions=8, normalize=False)
    assert np.abs(again - ref_again).max() <= TP_MAX_ABS * max(1.0, np.abs(ref_again).max())
    assert wait_no_workers() == set()


@pytest.mark.parametrize("name", ["qwen3", "gte_qwen2"])
def test_late_chunking_tp2_equals_tp1(checkpoint, name):
    """Chunk forwards reach the workers (the chunked texts, planned alike on every rank): the
    read-out segments (causal) and the chunk means (bidirectional) equal one rank's, pieces
    of a text split by the budget included."""
    bodies = random_sequences([120, 30], seed=9)
    texts = [
        ChunkedText(np.array(b + [7]), np.array([(0, 10), (10, len(b)), (5, 25)]), tail=1)
        for b in bodies
    ]
    with Encoder.from_pretrained(checkpoint(name), tp_size=1, dtype="float32") as enc:
        single = enc.embed_chunks(texts)
    with Encoder.from_pretrained(
        checkpoint(name), tp_size=2, max_batch_tokens=64, dtype="float32"
    ) as enc:
        sharded = enc.embed_chunks(texts)
        after = enc.embed(bodies)  # the workers went back to plain batches
    for one, two in zip(single, sharded, strict=True):
        assert np.abs(one - two).max() <= TP_MAX_ABS
    with Encoder.from_pretrained(checkpoint(name), dtype="float32") as enc:
        assert np.abs(after - enc.embed(bodies)).max() <= TP_MAX_ABS
    assert wait_no_workers() == set()


@pytest.mark.parametrize(
    "route", [dict(dtype="bfloat16"), dict(quantization="int8")], ids=["bf16", "int8"]
)
def test_tp2_routes_match_transformers(checkpoint, route):
    # int8 scales are per output channel of each rank's shard: still >= 0.999 of fp32
    seqs = random_sequences([1, 40, 150], seed=8)
    ref = reference_embeddings(checkpoint("qwen3"), seqs)
    with Encoder.from_pretrained(checkpoint("qwen3"), tp_size=2, **route) as enc:
        out = enc.embed(seqs)
    assert cosine(out, ref).min() >= 0.999
    assert wait_no_workers() == set()


def test_two_tp_encoders_side_by_side(checkpoint):
    """Each encoder has its own rendezvous: two TP groups in one process never collide."""
    seqs = random_sequences([5, 50], seed=7)
    with (
        Encoder.from_pretrained(checkpoint("qwen2"), tp_size=2) as a,
        Encoder.from_pretrained(checkpoint("qwen3"), tp_size=2) as b,
    ):
        assert len(worker_pids()) == 2
        out_a, out_b = a.embed(seqs), b.embed(seqs)
    assert out_a.shape == (2, 112) and out_b.shape == (2, 96)
    assert wait_no_workers() == set()


def test_worker_failure_is_reported_and_cleaned_up(checkpoint, tmp_path):
    """A checkpoint that fails to load on every rank: clear error, no process left."""
    source = checkpoint("qwen3")
    for f in source.iterdir():
        shutil.copy(f, tmp_path / f.name)
    index = {"weight_map": {"x": "missing-shard.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing-shard"):
        Encoder.from_pretrained(tmp_path, tp_size=2)
    assert wait_no_workers() == set()


def test_killed_worker_breaks_the_encoder_at_once_and_cleans_up(checkpoint):
    """A worker gone (OOM killer, a crash): the next forward fails fast naming the rank, not
    after dist_timeout_s, and every later call fails the same way without touching the group,
    until the encoder is loaded again."""
    enc = Encoder.from_pretrained(checkpoint("qwen3"), tp_size=2, dist_timeout_s=20)
    (pid,) = worker_pids()
    os.kill(pid, 9)
    started = time.monotonic()
    with pytest.raises(EncoderBroken) as e:
        enc.embed(random_sequences([10], seed=8))
    message = str(e.value)
    assert "TP rank 1 exited with code -9" in message and "loaded again" in message, message
    assert "timed out" not in message.lower() and "timeout" not in message.lower(), message
    assert wait_no_workers() == set()  # killed with the group, not at close()
    with pytest.raises(EncoderBroken, match="TP rank 1 exited"):
        enc.embed(random_sequences([3], seed=9))
    assert time.monotonic() - started < 20  # neither call waited out dist_timeout_s
    enc.close()


def test_waiting_for_the_gpu_stops_when_a_worker_fails():
    """NCCL leaves rank 0's all-reduce waiting on the GPU when a peer dies: rank 0 polls its
    event and the workers' state instead of blocking in the device-to-host copy (the GPU
    described as data: an event that never completes, a worker that dies at the third look)."""
    looks = []

    def failure():
        looks.append(1)
        return "TP rank 1 exited with code -9" if len(looks) >= 3 else None

    with pytest.raises(RuntimeError, match="TP rank 1 exited with code -9"):
        wait_for_device(lambda: False, failure, poll_s=0, check_every_s=0)
    assert len(looks) == 3
    looks.clear()
    wait_for_device(lambda: True, failure)  # work done: no worker is asked about
    assert looks == []
    finished = iter([False, False, True])
    wait_for_device(lambda: next(finished), failure, poll_s=0, check_every_s=0)
    assert len(looks) == 2


def test_a_batch_is_planned_before_the_workers_see_it(checkpoint):
    """Rank 0 plans first: a planning error leaves the workers idle, the group whole and the
    encoder serving."""
    with Encoder.from_pretrained(checkpoint("qwen3"), tp_size=2) as enc:
        planner, plan = enc.model.planner, enc.model.planner.plan

        def failing(*args, **kwargs):
            raise MemoryError("no room to plan")

        planner.plan = failing
        with pytest.raises(MemoryError):
            enc.embed(random_sequences([5], seed=3))
        planner.plan = plan
        assert enc.embed(random_sequences([5], seed=3)).shape == (1, 96)


def test_loading_runs_warm_up_forwards(checkpoint, monkeypatch):
    """Ready means a forward ran: build_model (what every rank runs at load, on any device)
    ends with warm-up forwards of each shape class, counted here on rank 0's model."""
    from qwen_embed import engine

    forwards = []
    real = engine._warm_up

    def counted(model):
        hook = model.register_forward_hook(lambda *_: forwards.append(1))
        real(model)
        hook.remove()

    monkeypatch.setattr(engine, "_warm_up", counted)
    with Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32", prefix_reuse="off") as enc:
        assert len(forwards) == 3  # several sequences, a one-token one, a single one
        enc.embed([[1, 2, 3]])
    with Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32", prefix_reuse="auto"):
        assert len(forwards) == 3 + 7  # and the shared-prefix paths

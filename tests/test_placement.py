"""CPU placement: which cores each encoder instance and the tokenizers get, and a real
tritonserver with two encoder instances on two cores, each pinned to its own core."""

import re
import shutil
import urllib.request
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from qwen_embed import Encoder
from qwen_embed_deploy.launcher import (
    cpu_instances,
    gpu_instances,
    served_edits,
    stub_processes,
)
from qwen_embed_deploy.placement import (
    Placement,
    encoder_placement,
    gpu_instance_groups,
    instance_index,
    parse_cpu_list,
    read_topology,
    tokenizer_placement,
)
from qwen_embed_deploy.repository import edited_copy, instance_group, read_config, render
from qwen_embed_deploy.serving.config import REPO
from qwen_embed_deploy.triton import TritonServer

from triton_helpers import infer

TWO_CORES = [[(0,), (1,)]]
# two sockets x 8 cores with hyperthreads (cpu n and n + 16 share a core)
TWO_NODES = [[(c, c + 16) for c in range(8)], [(c, c + 16) for c in range(8, 16)]]


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("") == []


def test_one_instance_per_numa_node_with_one_thread_per_physical_core():
    first, second = (encoder_placement(TWO_NODES, 2, i) for i in (0, 1))
    # 16 cores: the last one is kept for the tokenizers
    assert first.threads == 8 and first.cpus == tuple(sorted(range(8)) + list(range(16, 24)))
    assert second.threads == 7 and 15 not in second.cpus and 31 not in second.cpus
    assert tokenizer_placement(TWO_NODES).cpus == (15, 31)


def test_two_instances_on_two_cores_and_no_spare_core():
    placements = [encoder_placement(TWO_CORES, 2, i) for i in (0, 1)]
    assert [(p.cpus, p.threads) for p in placements] == [((0,), 1), ((1,), 1)]
    assert encoder_placement(TWO_CORES, 1, 0).cpus == (0, 1)
    assert encoder_placement(TWO_CORES, 1, 0).threads == 2
    assert tokenizer_placement(TWO_CORES) is None  # no core to spare: tokenizers float
    # more instances than cores: they share round robin rather than fail
    assert [encoder_placement(TWO_CORES, 3, i).cpus for i in range(3)] == [(0,), (1,), (0,)]


def test_the_tokenizer_core_never_leaves_a_node_without_cores():
    # 8 cores, the last NUMA node with one: the spare core comes from the biggest node.
    lopsided = [[(c,) for c in range(7)], [(7,)]]
    spare = tokenizer_placement(lopsided).cpus
    assert spare == (6,)
    placements = [encoder_placement(lopsided, 2, i) for i in (0, 1)]
    assert [p.cpus for p in placements] == [tuple(range(6)), (7,)]
    # Every node a single core: one node goes to the tokenizers, the others keep theirs.
    singles = [[(c,)] for c in range(8)]
    placements = [encoder_placement(singles, 7, i) for i in range(7)]  # one node left each
    assert all(p.threads == 1 and p.cpus for p in placements)
    assert tokenizer_placement(singles).cpus not in {p.cpus for p in placements}


def test_instances_split_cores_evenly_and_disjointly():
    cpus = [set(encoder_placement(TWO_NODES, 3, i).cpus) for i in range(3)]
    assert [len(c) // 2 for c in cpus] == [5, 5, 5]
    assert not (cpus[0] & cpus[1]) and not (cpus[1] & cpus[2])


def test_instance_index_and_this_machine():
    names = ("encoder_0_0", "encoder_0_1", "my_encoder_1_0", "my_encoder_1_1", "odd")
    assert [instance_index(n, [2, 2]) for n in names] == [0, 1, 2, 3, 0]
    topology = read_topology()
    assert topology and all(node for node in topology)
    allowed = {c for node in topology for core in node for c in core}
    assert allowed <= set(range(1024))


def with_cpu_instances(repository, count, only_kind_model):
    return edited_copy(repository, served_edits(count, only_kind_model, None, False))


def with_gpu_instances(repository, gpus, cpus, per_gpu):
    encoder, tokenizer = gpu_instance_groups(gpus, cpus, per_gpu)
    edit = served_edits(None, False, (instance_group(encoder), instance_group(tokenizer)), False)
    return edited_copy(repository, edit)


def groups(repository, model):
    return list(read_config(repository / model / "config.pbtxt").instance_group)


def test_launcher_instance_count(tmp_path):
    assert cpu_instances("auto", 2, gpu_present=False) == 2  # one per NUMA node
    assert cpu_instances("auto", 2, gpu_present=True) is None  # GPUs: the repository's own
    assert cpu_instances("config", 4, gpu_present=False) is None
    assert cpu_instances("3", 1, gpu_present=False) == 3
    with pytest.raises(ValueError, match="--cpu-instances"):
        cpu_instances("0", 1, gpu_present=False)
    repository = REPO / "model_repository"
    assert with_cpu_instances(repository, 1, True) == repository  # count 1 already: as is
    copy = with_cpu_instances(repository, 2, only_kind_model=True)
    assert copy != repository and (copy / "encoder" / "1" / "model.py").is_file()
    assert groups(copy, "encoder") == [instance_group("count: 2, kind: KIND_CPU")]
    assert (copy / "tokenizer" / "config.pbtxt").read_text() == (
        repository / "tokenizer" / "config.pbtxt"
    ).read_text()
    # auto keeps an explicit KIND_CPU group; a count asked for by number replaces it
    assert with_cpu_instances(copy, 3, only_kind_model=True) == copy
    again = with_cpu_instances(copy, 3, only_kind_model=False)
    assert groups(again, "encoder") == [instance_group("count: 3, kind: KIND_CPU")]
    shutil.rmtree(copy.parent)
    shutil.rmtree(again.parent)


def test_gpu_host_instance_groups():
    """A GPU host described as data: one KIND_GPU encoder per GPU, tokenizers on the CPUs the
    encoders leave (two at least, MAX_GPU_TOKENIZERS at most), never pinned to one core."""
    assert gpu_instance_groups(1, 8) == ("count: 1, kind: KIND_GPU", "count: 7, kind: KIND_CPU")
    assert gpu_instance_groups(2, 32, per_gpu=2)[1] == "count: 16, kind: KIND_CPU"
    assert gpu_instance_groups(4, 4)[1] == "count: 2, kind: KIND_CPU"
    sixteen_cores = [[(c,) for c in range(16)]]
    assert tokenizer_placement(sixteen_cores) == Placement((15,), 1)  # CPU encoders: reserved
    assert tokenizer_placement(sixteen_cores, gpus=2) is None  # GPU encoders: they float
    with pytest.raises(ValueError, match="--gpu-instances"):
        gpu_instances("none")
    assert gpu_instances("auto") == 1 and gpu_instances("3") == 3
    assert gpu_instances("config") is None


def test_launcher_repository_for_a_gpu_host(tmp_path):
    repository = REPO / "model_repository"
    copy = with_gpu_instances(repository, gpus=2, cpus=12, per_gpu=1)
    for encoder in ("encoder", "rerank_encoder"):
        assert groups(copy, encoder) == [instance_group("count: 1, kind: KIND_GPU")], encoder
    for tokenizer in ("tokenizer", "rerank_tokenizer"):
        assert groups(copy, tokenizer) == [instance_group("count: 10, kind: KIND_CPU")], tokenizer
    assert (copy / "embed" / "config.pbtxt").read_text() == (
        repository / "embed" / "config.pbtxt"
    ).read_text()
    # A tensor-parallel group stays the deployer's KIND_MODEL group on its GPUs.
    tp = render(tmp_path / "tp", {"embed": REPO}, {"encoder": {"tp_size": "2"}})
    tp_copy = with_gpu_instances(tp, gpus=2, cpus=12, per_gpu=1)
    assert groups(tp_copy, "encoder") == [instance_group("count: 1, kind: KIND_MODEL")]
    assert groups(tp_copy, "tokenizer") == [instance_group("count: 10, kind: KIND_CPU")]
    # So does an encoder pinned to a device: on the CPU beside the GPUs, or on one GPU.
    for device in ("cpu", "cuda:1"):
        pinned = render(tmp_path / device, {"embed": REPO}, {"encoder": {"device": device}})
        pinned_copy = with_gpu_instances(pinned, gpus=2, cpus=12, per_gpu=1)
        assert groups(pinned_copy, "encoder") == [instance_group("count: 1, kind: KIND_MODEL")]
        shutil.rmtree(pinned_copy.parent)
    shutil.rmtree(copy.parent)
    shutil.rmtree(tp_copy.parent)


def test_render_takes_both_instance_groups(tmp_path):
    """What bench_serving renders on a GPU: the launcher's groups for both steps."""
    encoder, tokenizer = gpu_instance_groups(1, 16, per_gpu=2)
    repo = render(
        tmp_path, {"embed": REPO}, encoder_instances=encoder, tokenizer_instances=tokenizer
    )
    assert groups(repo, "encoder") == [instance_group("count: 2, kind: KIND_GPU")]
    assert groups(repo, "tokenizer") == [instance_group("count: 14, kind: KIND_CPU")]


def _allowed(pid: int) -> set[int]:
    status = Path(f"/proc/{pid}/status").read_text()
    return set(parse_cpu_list(re.search(r"Cpus_allowed_list:\s*(\S+)", status).group(1)))


@pytest.mark.server
def test_two_encoder_instances_each_on_its_own_cores(demo_dir, tmp_path):
    topology = read_topology()
    if sum(len(node) for node in topology) < 2:
        pytest.skip("needs two cores")
    texts = ["pinned instance one", "pinned instance two", "三"]
    with TritonServer(
        env={"QWEN_EMBED_MODEL_DIR": str(demo_dir)},
        log_path=tmp_path / "log",
        launcher_args=["--cpu-instances", "2", "--no-rerank"],
    ) as server:
        stubs = stub_processes(server.status()["server_pid"])
        encoders = [pid for pid, model in stubs.items() if model == "encoder"]
        assert len(encoders) == 2
        # every thread of each stub that runs torch work is on that instance's cores
        sets = [_allowed(pid) for pid in encoders]
        expected = [set(encoder_placement(topology, 2, i).cpus) for i in (0, 1)]
        assert sorted(sets, key=min) == sorted(expected, key=min)
        assert not (sets[0] & sets[1])
        with urllib.request.urlopen(server.metrics_url) as r:
            metrics = r.read().decode()
        prefix = "qwen_embed_encoder_route{"
        routes = [
            line
            for line in metrics.splitlines()
            if line.startswith(prefix) and 'model="encoder"' in line
        ]
        assert len(routes) == 2 and all(line.endswith(" 1") for line in routes)
        threads = sorted(int(re.search(r'threads="(\d+)"', line).group(1)) for line in routes)
        assert threads == sorted(encoder_placement(topology, 2, i).threads for i in (0, 1))
        outs = [infer(server, texts, protocol)[0] for protocol in ("http", "grpc")]
    ids = [e.ids for e in Tokenizer.from_file(str(demo_dir / "tokenizer.json")).encode_batch(texts)]
    with Encoder.from_pretrained(demo_dir) as enc:
        ref = enc.embed(ids)
    for out in outs:
        assert float((out * ref).sum(1).min()) >= 0.9999


def test_server_environment_spins_briefly_unless_a_wait_policy_is_set(monkeypatch):
    from qwen_embed_deploy.triton import server_command

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    env = server_command()[1]
    assert env["GOMP_SPINCOUNT"] == "20000" and "OMP_WAIT_POLICY" not in env
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"  # bounded (row_plans.py)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    env = server_command()[1]
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env

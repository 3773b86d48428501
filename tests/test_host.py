"""What the launcher reads of its host before anything starts: the memory the host or its
container allows (cgroup v1 and v2 limits, MemTotal, MemAvailable), and whether the encoders'
weights can fit in it (launcher.weights_room)."""

from qwen_embed_deploy.host import memory_available, memory_limit
from qwen_embed_deploy.launcher import weights_room

GIB = 1 << 30


def test_the_memory_limit_is_the_smallest_of_the_cgroups_else_the_hosts(tmp_path):
    """host.memory_limit: a v1 memory cgroup's limit, the smallest on its path up to the
    hierarchy's root ("no limit" is a number near 2**63); v2's memory.max ("max": none); with
    none, the host's MemTotal; what is available now, MemAvailable."""
    proc, groups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:  24000000 kB\nMemAvailable:  5000 kB\n")
    (proc / "self" / "cgroup").write_text("4:memory:/a/b\n1:cpu:/\n0::/\n")
    for folder, limit in (("memory", 2**63 - 4096), ("memory/a", 3 << 30), ("memory/a/b", 5 << 30)):
        (groups / folder).mkdir(parents=True)
        (groups / folder / "memory.limit_in_bytes").write_text(f"{limit}\n")
    assert memory_limit(proc, groups) == (3 << 30, "this container's memory limit")
    assert memory_available(proc) == 5000 * 1024
    (proc / "self" / "cgroup").write_text("0::/x\n")
    (groups / "x").mkdir()
    (groups / "x" / "memory.max").write_text("max\n")
    assert memory_limit(proc, groups) == (24000000 * 1024, "this host's memory")
    (groups / "memory.max").write_text(f"{1 << 30}\n")  # a container's own, at its root
    assert memory_limit(proc, groups) == (1 << 30, "this container's memory limit")
    (proc / "meminfo").write_text("MemFree: 1 kB\n")  # a kernel that does not say
    (groups / "memory.max").unlink()
    assert memory_limit(proc, groups) is None and memory_available(proc) is None


def test_weights_beyond_the_limit_are_refused_beyond_what_is_free_warned():
    """The floor of each encoder's weights times its instances, against the container's or
    host's limit (an error: the load cannot end well) and what is available now (a warning);
    fewer instances are offered only where a model has several, --no-rerank only where a
    reranker takes some of it."""
    floors = {"encoder": (2, 3 * GIB), "rerank_encoder": (1, 2 * GIB)}
    limit = (7 * GIB, "this container's memory limit")
    refused, line = weights_room(floors, limit, 64 * GIB, {"rerank_encoder"})
    assert refused and "need at least 8.0 GiB" in line, line
    assert "(encoder 2 x 3.0 GiB, rerank_encoder 1 x 2.0 GiB)" in line, line
    assert "more than this container's memory limit (7.0 GiB)" in line and "--no-rerank" in line
    assert "fewer encoder instances" in line, line
    refused, line = weights_room({"encoder": (1, 8 * GIB)}, limit, None, {"rerank_encoder"})
    assert refused and "--no-rerank" not in line and "fewer encoder instances" not in line, line
    assert "quantization=int8" in line, line
    warned, line = weights_room(floors, (16 * GIB, "this host's memory"), 6 * GIB, set())
    assert not warned and line.startswith("warning: ") and "6.0 GiB available now" in line
    assert weights_room(floors, (16 * GIB, "this host's memory"), 8 * GIB, set()) is None
    assert weights_room(floors, None, None, set()) is None  # nothing known: nothing said
    assert weights_room({}, limit, 0, set()) is None  # GPU instances: nothing on the host

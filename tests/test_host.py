"""What the launcher reads of its host before anything starts: the memory the host or its
container allows (cgroup v1 and v2 limits, MemTotal, MemAvailable), and whether the encoders'
weights can fit in it (launcher.weights_room); and the ports a server is given and probed on."""

from qwen_embed_deploy.host import memory_available, memory_limit
from qwen_embed_deploy.launcher import Floor, weights_room

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
    reranker takes some of it, dtype bfloat16 only where a model holds its weights wider."""
    floors = {"encoder": Floor(2, 3 * GIB, GIB), "rerank_encoder": Floor(1, 2 * GIB, GIB)}
    limit = (7 * GIB, "this container's memory limit")
    refused, line = weights_room(floors, limit, 64 * GIB, {"rerank_encoder"})
    assert refused and "need at least 8.0 GiB" in line, line
    assert "(encoder 2 x 3.0 GiB, rerank_encoder 1 x 2.0 GiB)" in line, line
    assert "more than this container's memory limit (7.0 GiB)" in line and "--no-rerank" in line
    assert "fewer encoder instances" in line and "dtype=bfloat16" in line, line
    alone = {"encoder": Floor(1, 8 * GIB, 4 * GIB)}  # 2 bytes a weight
    refused, line = weights_room(alone, limit, None, {"rerank_encoder"})
    assert refused and "--no-rerank" not in line and "fewer encoder instances" not in line, line
    assert "quantization=int8" in line and "dtype=bfloat16" not in line, line
    warned, line = weights_room(floors, (16 * GIB, "this host's memory"), 6 * GIB, set())
    assert not warned and line.startswith("warning: ") and "6.0 GiB available now" in line
    assert weights_room(floors, (16 * GIB, "this host's memory"), 8 * GIB, set()) is None
    assert weights_room(floors, None, None, set()) is None  # nothing known: nothing said
    assert weights_room({}, limit, 0, set()) is None  # GPU instances: nothing on the host


def test_each_worker_chooses_ports_of_its_own_share(monkeypatch):
    """triton.free_ports from a share (the suite's xdist workers: triton.port_share, set by
    conftest): distinct ports inside it, never one handed out before by this process nor one
    another process holds; none left is an error. The shares lie apart, below the kernel's
    ephemeral range."""
    import contextlib
    import socket

    import pytest

    from qwen_embed_deploy import triton

    shares = [triton.port_share(i, 2, 32768) for i in range(2)]
    assert triton.FIRST_SHARED_PORT == shares[0].start
    assert shares[0].stop <= shares[1].start and shares[1].stop <= 32768
    assert triton.port_share(0, 400, 32768) is None  # no room: the kernel's choice
    # ports the kernel just handed out, one of them still held: a neighbour of a free port
    # may be another process's (the suite's servers and clients), these were free a moment ago
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(5)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        share = sorted(s.getsockname()[1] for s in sockets)
    with socket.socket() as held:
        held.bind(("127.0.0.1", share[2]))
        taken = share[2]
        monkeypatch.setattr(triton, "PORT_SHARE", share)
        monkeypatch.setattr(triton, "_handed_out", set())
        first = triton.free_ports(2)
        second = triton.free_ports(2)
        chosen = first + second
        assert sorted(chosen) == [p for p in share if p != taken]
        with pytest.raises(OSError, match="no free port left"):
            triton.free_port()


def test_a_port_that_answers_but_not_in_http_is_not_ready():
    """A server's readiness probe on a port where another process answers something other
    than HTTP (another server's gRPC port, taken between the port's choice and its bind) says
    not ready, in the suite's TritonServer and in the launcher, instead of raising."""
    import contextlib
    import socket
    import subprocess
    import sys
    import threading

    from qwen_embed_deploy.launcher import wait_ready
    from qwen_embed_deploy.triton import TritonServer

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def answer():  # an HTTP/2 SETTINGS frame, as a gRPC server opens a connection
            with contextlib.suppress(OSError):  # the listener closed
                while True:
                    conn, _ = listener.accept()
                    with conn:
                        conn.sendall(
                            b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64\n"
                        )

        threading.Thread(target=answer, daemon=True).start()
        server = TritonServer(http_port=port)
        server.status_file.unlink()
        assert server.ready() is False
        with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as proc:
            assert wait_ready(f"127.0.0.1:{port}", proc, timeout_s=0.3) is False
            proc.kill()

"""Find or install a Triton Inference Server 2.51 and start it on a model repository.

Inside NVIDIA's image `tritonserver` is on PATH. Elsewhere the server, its Python backend and a
stub per Python version come from the `nvidia-pytriton==0.7.0` wheel, unpacked (never imported)
into the data directory (serving/config.py); the stub must match this interpreter and find its
libpython.

    python -m qwen_embed_deploy.triton install     # serving: launcher.py
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import http.client
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path

from qwen_embed.row_plans import PRIMITIVE_CACHE_CAPACITY
from qwen_embed_deploy.serving.config import DATA_DIR, MODEL_REPOSITORY

CACHE = DATA_DIR / "triton"
PYTRITON_WHEEL = "nvidia-pytriton==0.7.0"
PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text page (Triton's metrics port): (name, labels, value)."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    samples = []
    for match in _SAMPLE.finditer(text):
        labels = {k: _unquoted(v) for k, v in _LABEL.findall(match.group(2) or "")}
        samples.append((match.group(1), labels, float(match.group(3))))
    return samples


# A sample line, its label values quoted (a value may hold braces: the gateway's route
# templates, "/v1/models/{model:path}"), and one label with its value's escapes.
_QUOTED = r'"(?:[^"\\]|\\.)*"'
_SAMPLE = re.compile(rf"^(\w+)(?:{{((?:[^\"}}]|{_QUOTED})*)}})? (\S+)$", re.M)
_LABEL = re.compile(rf"(\w+)=({_QUOTED})")


def _unquoted(value: str) -> str:
    """A quoted label value's text: its escapes (\\\\, \\", \\n) read."""
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], value[1:-1])


def metric_sum(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of metric `name`'s samples whose labels include `labels` (0 when none)."""
    return sum(
        value
        for found, have, value in samples
        if found == name and all(have.get(k) == v for k, v in labels.items())
    )


def execute_seconds(stats: dict) -> float:
    """Seconds a model's executes took so far, from its Triton statistics
    (TritonServer.model_stats): each execute once, however many requests it held."""
    return sum(int(b["compute_infer"]["ns"]) for b in stats.get("batch_stats", [])) / 1e9


def local_server_dir() -> Path:
    return CACHE / "pytriton" / "tritonserver"


def install() -> Path:
    """Unpack the server files of the pytriton wheel into CACHE once, and put this Python's
    stub in the Python backend (again when the interpreter changed since: a stub built for
    another Python cannot load its libpython)."""
    server = local_server_dir()
    if not (server / "bin" / "tritonserver").is_file():
        _unpack_server()
    stub = server / "backends" / "python" / "triton_python_backend_stub"
    ours = server / "python_backend_stubs" / PY_VERSION / "triton_python_backend_stub"
    if not ours.is_file():
        raise RuntimeError(f"the pytriton wheel has no Python backend stub for Python {PY_VERSION}")
    if not stub.is_file() or not filecmp.cmp(stub, ours, shallow=False):
        shutil.copy(ours, stub)
        stub.chmod(0o755)
    return server


def _unpack_server() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                PYTRITON_WHEEL,
                "-d",
                tmp,
            ],
            check=True,
        )
        (wheel,) = Path(tmp).glob("nvidia_pytriton-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            wanted = ("pytriton/tritonserver/", "nvidia_pytriton.libs/")
            for m in (m for m in zf.infolist() if m.filename.startswith(wanted)):
                target = Path(zf.extract(m, CACHE))
                mode = (m.external_attr >> 16) & 0o777
                if mode:
                    target.chmod(mode)


def server_command() -> tuple[list[str], dict[str, str]]:
    """The tritonserver command and the environment it needs here."""
    env = dict(os.environ)
    # The Python stub takes the first python3 on PATH: ours, with the venv's packages.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # OpenMP threads spin briefly at a barrier, then sleep. Spinning for long (libgomp's
    # default) burns a core a neighbouring process needs; sleeping at once
    # (OMP_WAIT_POLICY=PASSIVE) pays a wake-up at every barrier, which small batches feel.
    # A wait policy in the environment wins. Measurements: docs/tuning.md.
    if "OMP_WAIT_POLICY" not in env:
        env.setdefault("GOMP_SPINCOUNT", "20000")
    # oneDNN keeps a plan per GEMM shape in its primitive cache; the packed weights pad row
    # counts so that plans repeat (row_plans.py), and a bounded cache keeps its memory small.
    # Read at process start: set here.
    env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(PRIMITIVE_CACHE_CAPACITY))
    found = shutil.which("tritonserver")
    if found:
        return [found], env
    server = install()
    libdir = sysconfig.get_config_var("LIBDIR")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, env.get("LD_LIBRARY_PATH")]))
    return [
        str(server / "bin" / "tritonserver"),
        f"--backend-directory={server / 'backends'}",
        f"--cache-directory={server / 'caches'}",
    ], env


# Where set, the ports free_ports chooses among (the test suite's workers: each its own share,
# below the kernel's ephemeral range). A port is free from its choice until its server binds
# it, seconds later; two processes choosing from the kernel's range at once may be handed the
# same one in between, two choosing from their own shares never are.
PORT_SHARE: range | None = None
_handed_out: set[int] = set()  # from PORT_SHARE, by this process: never handed out twice
FIRST_SHARED_PORT = 10000
EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")


def port_share(index: int, processes: int, ephemeral_start: int | None = None) -> range | None:
    """Process `index` of `processes`' share (PORT_SHARE) of the ports from FIRST_SHARED_PORT up
    to the kernel's ephemeral range, which binding port 0 hands out to every process; None
    where there is no room below that range."""
    if ephemeral_start is None:
        ephemeral_start = int(EPHEMERAL_PORTS.read_text().split()[0])
    size = (ephemeral_start - FIRST_SHARED_PORT) // processes
    if size < 100:
        return None
    start = FIRST_SHARED_PORT + index * size
    return range(start, start + size)


def free_ports(n: int) -> list[int]:
    """n distinct free ports, the kernel's choice or from PORT_SHARE: every socket stays bound
    until all are chosen, else the same port could be handed out twice."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        if PORT_SHARE is None:
            for s in sockets:
                s.bind(("127.0.0.1", 0))
            return [s.getsockname()[1] for s in sockets]
        ports = (p for p in PORT_SHARE if p not in _handed_out)
        for s in sockets:
            for port in ports:
                with contextlib.suppress(OSError):
                    s.bind(("127.0.0.1", port))
                    break
            else:
                raise OSError(f"no free port left in {PORT_SHARE}")
        chosen = [s.getsockname()[1] for s in sockets]
        _handed_out.update(chosen)
        return chosen


def free_port() -> int:
    return free_ports(1)[0]


# A start takes seconds and each look is one local request: looked for often, so that a
# server is taken as ready soon after it is
READY_POLL_S = 0.1


class TritonServer:
    """tritonserver under our launcher (launcher.py) on the given (or free) ports, bound to
    127.0.0.1; a context manager. `admin_key` opens the restricted APIs."""

    def __init__(
        self,
        model_repository: Path | str = MODEL_REPOSITORY,
        *,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        log_path: Path | None = None,
        cpus: str | None = None,
        watchdog_interval: float = 1.0,
        exit_timeout_s: int = 30,
        launcher_args: list[str] | None = None,
    ):
        free = iter(free_ports(3))
        self.http_port = http_port or next(free)
        self.grpc_port = grpc_port or next(free)
        self.metrics_port = metrics_port or next(free)
        self.admin_key = secrets.token_urlsafe(16)
        self.status_file = Path(tempfile.mkstemp(prefix="qwen-embed-launcher-", suffix=".json")[1])
        self.cmd = [
            sys.executable,
            "-m",
            "qwen_embed_deploy.launcher",
            f"--model-repository={model_repository}",
            "--host=127.0.0.1",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--admin-key={self.admin_key}",
            f"--watchdog-interval={watchdog_interval}",
            f"--status-file={self.status_file}",
            f"--exit-timeout-secs={exit_timeout_s}",
            *(launcher_args or []),
            "--",
            *(extra_args or []),
        ]
        self.env = {**os.environ, **(env or {})}
        if cpus is not None:  # pin to some cores, e.g. to stand in for a separate machine
            self.cmd = ["taskset", "-c", cpus] + self.cmd
            self.env["OMP_NUM_THREADS"] = str(len(cpus.split(",")))
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def status(self) -> dict:
        """{"server_pid": ..., "model_repository": the one served, "reloads": [[model, seconds],
        ...], "restarts": [seconds, ...]} once the server is ready: the watchdog's reloads of a
        model whose stub died, and the launcher's restarts of a tritonserver that died."""
        text = self.status_file.read_text()
        return json.loads(text) if text else {}

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def metric(self, name: str, **labels: str) -> float:
        """The sum of metric `name` over the series whose labels include `labels`."""
        return metric_sum(scrape(self.metrics_url), name, **labels)

    def model_stats(self) -> dict[str, dict]:
        """Triton's statistics so far (/v2/models/stats), by model name."""
        with urllib.request.urlopen(f"http://{self.http_url}/v2/models/stats", timeout=30) as r:
            return {m["name"]: m for m in json.load(r)["model_stats"]}

    def start(self, timeout: float = 180.0) -> TritonServer:
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        """The launcher started, without waiting for it (wait_ready)."""
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float = 180.0) -> TritonServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with {self.proc.returncode}; log: {self.log_path}"
                )
            if self.ready() and self.status():
                return self
            time.sleep(READY_POLL_S)
        self.stop()
        raise TimeoutError(f"tritonserver not ready in {timeout}s; log: {self.log_path}")

    def embed_http(self, texts: list[str], timeout: float = 600) -> dict:
        """One `embed` request over HTTP (standard library only); the decoded JSON response."""
        body = {
            "inputs": [
                {"name": "TEXT", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}
            ]
        }
        url = f"http://{self.http_url}/v2/models/embed/infer"
        request = urllib.request.Request(url, json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def ready(self) -> bool:
        try:
            url = f"http://{self.http_url}/v2/health/ready"
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except (OSError, http.client.HTTPException):  # the latter: not an HTTP server's answer
            return False

    # The test suite's choice: a stop sends SIGTERM and returns, and the shutdown (seconds of
    # Triton unloading its instances) overlaps what comes next; wait_for_stops() finishes them.
    stop_in_background = False

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM (the launcher drains, then exits); returns the exit status, or None where
        the stop goes on in the background."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        if self.stop_in_background:
            _stopping.append((self, timeout))
            return None
        return self._stopped(timeout)

    def _stopped(self, timeout: float) -> int | None:
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.status_file.unlink(missing_ok=True)
        return self.proc.returncode if self.proc else None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_stopping: list[tuple[TritonServer, float]] = []  # stopped in the background, not yet waited for


def wait_for_stops() -> None:
    """Waits for the servers stopped in the background (TritonServer.stop_in_background)."""
    while _stopping:
        server, timeout = _stopping.pop()
        server._stopped(timeout)


@contextlib.contextmanager
def servers_together(*servers: TritonServer):
    """Several servers started at once (each loads its models while the others do), stopped
    on exit."""
    with contextlib.ExitStack() as stack:
        for server in servers:
            server.launch()
            stack.callback(server.stop)
        for server in servers:
            server.wait_ready()
        yield servers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", nargs="?", default="install", choices=["install"])
    p.parse_args()
    print(f"tritonserver ready: {install() / 'bin' / 'tritonserver'}")


if __name__ == "__main__":
    main()

import os
import shlex
import sys
from pathlib import Path

import pytest


def _selects_gpu_tests(args: list[str]) -> bool:
    """Whether this run selects the tests marked gpu (`-m gpu`, as `make test-gpu` runs them).
    Read from the command line: it must be known before anything imports torch or Triton."""
    exprs = [a[2:] for a in args if a.startswith("-m") and len(a) > 2]
    exprs += [expr for flag, expr in zip(args, args[1:], strict=False) if flag == "-m"]
    return any("gpu" in e and "not gpu" not in e for e in exprs)


# Outside a GPU run, GPUs are hidden from this process and the servers it starts: the suite is
# the CPU suite on any host, so `device: auto` means the CPU its tests expect (set before
# anything initialises CUDA, which reads it once). Triton-language kernels then run under
# Triton's interpreter on CPU tensors (set before Triton is imported: transformers imports it).
# A pytest-xdist worker keeps what its controller chose: it inherits its environment, and its
# own argv is not pytest's.
if "PYTEST_XDIST_WORKER" not in os.environ and not _selects_gpu_tests(
    sys.argv[1:] + shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))
):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["TRITON_INTERPRET"] = "1"
# Idle OpenMP threads sleep instead of spinning: this process, its workers' and the servers they
# start share two cores, where a spinning thread takes the core another process waits for.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# LiteLLM reads its price list from the package, not from GitHub at import (no network here)
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

sys.path.insert(0, str(Path(__file__).parent))

from qwen_embed import native  # noqa: E402
from qwen_embed_deploy import triton  # noqa: E402
from qwen_embed_deploy.demo import build_demo_model  # noqa: E402
from qwen_embed_deploy.repository import render  # noqa: E402
from qwen_embed_deploy.serving.config import DEMO_MODEL_DIR, DEMO_RERANKER_DIR  # noqa: E402
from qwen_embed_deploy.triton import TritonServer, wait_for_stops  # noqa: E402

from reference import TINY_CONFIGS, make_checkpoint, make_reranker  # noqa: E402

SERVER_MODULE = "pytestmark = pytest.mark.server"  # the convention: a module of server tests
# Each xdist worker's servers take ports from a share of its own: no other worker chooses them
if "PYTEST_XDIST_WORKER" in os.environ:
    triton.PORT_SHARE = triton.port_share(
        int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")),
        int(os.environ["PYTEST_XDIST_WORKER_COUNT"]),
    )


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """A module of server tests (its `pytestmark` line) is not even imported where the marker
    expression leaves `server` out (the fast tier): their client libraries are slow to import."""
    expr = config.option.markexpr
    if not expr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    from _pytest.mark.expression import Expression

    if Expression.compile(expr).evaluate(lambda name, **_: name == "server"):
        return None
    lines = collection_path.read_text().splitlines()
    return True if any(line.startswith(SERVER_MODULE) for line in lines) else None


def pytest_collection_modifyitems(session, config, items) -> None:
    """Modules with server tests first, the others after them (each module's tests together,
    in their order): workers that take modules in this order end together, the quick modules
    filling in while the last slow one runs."""
    slow = {item.module for item in items if item.get_closest_marker("server")}
    items.sort(key=lambda item: item.module not in slow)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> directory of a seeded tiny model, built once per session."""
    built = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = make_checkpoint(tmp_path_factory.mktemp(name), name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def reranker(tmp_path_factory):
    """A tiny Qwen3-Reranker replica with the real tokenizer (reference.make_reranker)."""
    return make_reranker(tmp_path_factory.mktemp("reranker"))


@pytest.fixture(scope="session")
def mxbai(tmp_path_factory):
    """A tiny mxbai-rerank-v2 replica (Qwen2ForCausalLM) with the real tokenizer."""
    return make_reranker(tmp_path_factory.mktemp("mxbai"), family="qwen2", seed=7)


@pytest.fixture(scope="session")
def cross_encoders(reranker, tmp_path_factory):
    """The Qwen3-Reranker replica as sentence-transformers 6 saves a CrossEncoder of it
    (replicas.cross_encoder): with its model card's template (`qwen3`), in zerank-2's form
    (`zerank`: the query as the system turn, one answer row, "Yes", its raw logit the score
    since May 2026) and in ctxl-rerank-v2's (`ctxl`: its plain-text prompt, the document
    first; token 0's raw logit)."""
    from replicas import (
        DOCUMENT_FIRST_TEMPLATE,
        QUERY_AS_SYSTEM_TEMPLATE,
        QWEN3_RERANKER_TEMPLATE,
        cross_encoder,
    )

    root = tmp_path_factory.mktemp("cross-encoders")
    zerank = cross_encoder(
        root / "zerank",
        reranker,
        QUERY_AS_SYSTEM_TEMPLATE,
        ("Yes", None),
        generation_prompt=True,
        raw_logit=True,
    )
    ctxl = cross_encoder(
        root / "ctxl", reranker, DOCUMENT_FIRST_TEMPLATE, ("!", None), raw_logit=True
    )
    return {
        "qwen3": cross_encoder(root / "qwen3", reranker, QWEN3_RERANKER_TEMPLATE),
        "zerank": zerank,
        "ctxl": ctxl,
    }


@pytest.fixture(scope="session")
def jina(tmp_path_factory):
    """A tiny jina-reranker-v3 replica (JinaForRanking, listwise) with the real tokenizer."""
    from replicas import jina_reranker_v3

    return jina_reranker_v3(tmp_path_factory.mktemp("jina-reranker-v3"))


@pytest.fixture(params=sorted(TINY_CONFIGS))
def config_name(request):
    return request.param


@pytest.fixture(scope="session")
def demo_dir():
    """The demo model `make setup` builds (built here if a test run skipped set-up), and the
    demo reranker beside it (the checked-in repository serves both)."""
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        build_demo_model(DEMO_MODEL_DIR)
    if not (DEMO_RERANKER_DIR / "config.json").is_file():
        build_demo_model(DEMO_RERANKER_DIR, reranker=True)
    return DEMO_MODEL_DIR


@pytest.fixture(scope="session", autouse=True)
def servers_stop_in_background():
    """A test's server shuts down while the next test runs; the session waits for all at its
    end. (No test times anything, and each server has ports of its own.)"""
    TritonServer.stop_in_background = True
    yield
    wait_for_stops()


@pytest.fixture(scope="session")
def server(demo_dir, reranker, tmp_path_factory):
    """A real tritonserver on free ports serving model_repository/ with the demo model and the
    tiny reranker, one for every module that asks for it (tests read its counters as
    differences). The encoder in
    fp32: tests compare its vectors with fp32 references at fp32 tolerances, and dtype auto
    would be bf16 on CPUs with bf16 instructions (test_placement serves auto). Texts are capped
    at 8,192 tokens (the default is the model's 32,768): the truncation tests embed a text at
    the cap, which at 32K would take minutes in fp32 on 2 cores."""
    where = tmp_path_factory.mktemp("triton")
    overrides = {"encoder": {"dtype": "float32"}, "tokenizer": {"max_input_tokens": "8192"}}
    repo = render(where / "repo", {"embed": demo_dir}, overrides, rerankers={"rerank": reranker})
    with TritonServer(repo, log_path=where / "server.log") as s:
        yield s


def _isas() -> list[str]:
    """Every instruction set this CPU runs the native kernels of, widest first."""
    if native.isa() is None:
        return []
    return list(native.ISAS[native.ISAS.index(native.isa()) :])


@pytest.fixture(params=_isas())
def isa(request):
    """The native kernels of each instruction set this CPU runs, in turn (the widest after)."""
    chosen = native.select(request.param)
    yield chosen
    native.select("")

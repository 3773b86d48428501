"""The benchmarks' own code, at toy sizes (their figures come from `make perf-*`): every
script under perf/ parses `--help` (its imports and arguments hold), bench_peers' GEMM
bound, the yardstick of its reports, runs at both routes, float and int8, on this CPU, the
GPU probe of whole-forward graphs gives the eager forward's vectors (its plumbing, on CPU),
bench_serving --spy reads py-spy's stacks as shares of the wall and records a live process,
bench_rerank gives vLLM texts that it tokenizes as our pairs, and the GPU script's command
lines and every report's command as RESULTS.md shows it are all taken by their scripts."""

import argparse
import importlib.util
import json
import os
import runpy
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from qwen_embed import Encoder

from reference import random_sequences

PERF = Path(__file__).resolve().parents[1] / "perf"
SCRIPTS = sorted(  # the scripts with a command line (render_results.py takes none)
    p.name
    for p in PERF.glob("*.py")
    if 'if __name__ == "__main__"' in (text := p.read_text()) and "import argparse" in text
)


@pytest.fixture
def perf_imports(monkeypatch):
    """perf/ importable as the scripts expect; the environment they set at import kept from
    this process's (the scripts set tuning variables that the other tests must not see)."""
    monkeypatch.syspath_prepend(str(PERF))
    monkeypatch.setattr(os, "environ", dict(os.environ))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help(script, perf_imports, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(PERF / script), run_name="__main__")
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_peers_gemm_bound_at_both_routes(perf_imports):
    import bench_peers

    config = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
    }
    params = bench_peers.linear_params(config)
    assert sum(params.values()) == 2 * 64 * (96 + 32 + 64 + 256 + 128)
    peaks = {
        "float": bench_peers.gemm_peak(torch.float32, seconds=0.01, rows=8),
        "int8": bench_peers.gemm_peak(torch.float32, int8=True, seconds=0.01, rows=8),
    }
    assert peaks["float"] > 0 and peaks["int8"] > 0, peaks
    bound = bench_peers.bound_tokens_per_s(params, peaks)
    # the int8 route keeps some layers in floats: its bound lies between the two rates'
    flops = 2 * sum(params.values())
    low, high = sorted((peaks["float"] / flops, peaks["int8"] / flops))
    assert bound["float"] == pytest.approx(peaks["float"] / flops)
    assert low * (1 - 1e-9) <= bound["int8"] <= high * (1 + 1e-9), (bound, low, high)


def test_the_profile_files_each_native_operator_under_what_it_does(perf_imports):
    import profile_engine

    from qwen_embed import native

    if native.isa() is None:
        pytest.skip("the native kernels are not built")
    ops = torch._C._dispatch_get_registrations_for_dispatch_key("CPU")
    ours = sorted({n for n in ops if n.startswith("qwen_embed::")})
    gemms = [n for n in ours if n.endswith(("_linear", "_linear_avx2"))]
    assert len(gemms) >= 4, ours  # int8 (VNNI, AVX2), bf16, fp32
    for name in ours:
        expected = (
            "GEMM (linear layers)"
            if name in gemms
            else "attention"
            if "attention" in name
            else "row-wise kernels (native)"
        )
        assert profile_engine.group_of(name) == expected, name


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_whole_graph_probe_gives_the_eager_vectors(perf_imports, checkpoint, name):
    """probe_whole_graphs' forwards (on CPU the captured function runs as it is): static
    buffers that a later batch of the same bucket finds with stale rows and texts past its own,
    empty texts padding the offsets (what a GPU's attention reads), the pruned last layer; a
    batch past the largest bucket runs eagerly."""
    from probe_whole_graphs import WholeGraphs, _run_as_is

    batches = [
        random_sequences([5, 9, 11, 7, 6], seed=1),  # 38 rows, 5 texts: bucket (64, 8, 64)
        random_sequences([3], seed=2),  # (16, 1, 16)
        random_sequences([3, 4, 8, 10, 6, 9], seed=3),  # (64, 8, 64) again: more texts
        random_sequences([60] * 5, seed=4),  # 300 rows: eager
    ]
    settings = {"dtype": "float32", "prefix_reuse": "off", "attn_backend": "torch"}
    with Encoder.from_pretrained(checkpoint(name), **settings) as enc:
        eager = [enc.embed(seqs) for seqs in batches]
        whole = WholeGraphs(enc.model, 128, _run_as_is)
        enc.model.graphs = whole
        graphed = [enc.embed(seqs) for seqs in batches]
    assert whole.replays == 3
    assert sorted(whole.entries) == [(16, 1, 16), (64, 8, 64)]
    for g, e in zip(graphed, eager, strict=True):
        np.testing.assert_allclose(g, e, atol=2e-5)
    # The offsets of the third batch (the engine runs a batch's texts longest first), two
    # empty texts after its six.
    buffers = whole.entries[(64, 8, 64)]["buffers"]
    assert buffers["cu"].tolist() == [0, 10, 19, 27, 33, 37, 40, 40, 40]
    assert buffers["cu_last"].tolist() == [0, 1, 2, 3, 4, 5, 6, 6, 6]
    assert buffers["last"][:6].tolist() == [9, 18, 26, 32, 36, 39]


def test_settings_variants_each_run_their_own_encoder(
    perf_imports, checkpoint, tmp_path, monkeypatch
):
    """bench_routes settings: every variant an Encoder of its own settings, taking turns on the
    workload's texts (short queries: the replica reads 512 tokens at most): the same vectors,
    the first variant the others' yardstick, a smaller token budget more forwards per embed();
    a variant that is not KEY=VALUE, or names no setting, is refused."""
    import bench_routes

    out = tmp_path / "settings"
    argv = ["settings", "--model-dir", str(checkpoint("qwen3")), "--dtype", "float32"]
    argv += ["--variant", "", "--variant", "max_batch_tokens=128", "--variant", "prefix_reuse=off"]
    argv += ["--workloads", "short", "--scale", "0.01", "--rounds", "1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["bench_routes.py", *argv])
    bench_routes.main()
    rows = {r["variant"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert list(rows) == ["defaults", "max_batch_tokens=128", "prefix_reuse=off"]
    for r in rows.values():
        assert (r["workload"], r["texts"]) == ("short", 20)
        assert r["min_cosine"] > 0.99999 and r["tokens_per_s"] > 0, r
    assert rows["defaults"]["x_base"] == 1.0
    # 20 queries of 8-40 tokens: one forward in the default budget, 3 or more in 128 tokens
    assert rows["defaults"]["forwards"] == rows["prefix_reuse=off"]["forwards"] == 1
    assert rows["max_batch_tokens=128"]["forwards"] >= 3
    with pytest.raises(SystemExit, match="not KEY=VALUE"):
        bench_routes.variant_settings("max_batch_tokens", "cpu", "auto")
    with pytest.raises(ValueError, match="unknown encoder parameter"):
        bench_routes.variant_settings("batch_tokens=5", "cpu", "auto")


def test_revisions_measure_a_side_and_report_the_pairs(perf_imports, demo_dir):
    """bench_revisions: one side's figures on the demo model (this checkout's code, as each
    measuring process reports), and the report's rows from given figures: each pair's gains
    (base / checkout time per query, checkout / base tokens/s) and the medians."""
    import bench_revisions

    figures = bench_revisions.measure(str(demo_dir), "none", 2)
    assert figures["query_ms"] > 0 and figures["documents_tok_s"] > 0
    assert Path(figures["code"]).is_relative_to(PERF.parent / "plugins")

    def side(ms, tok_s):
        return {"query_ms": ms, "documents_tok_s": tok_s}

    pairs = [
        {"base": side(10.0, 100.0), "checkout": side(8.0, 110.0)},
        {"base": side(12.0, 90.0), "checkout": side(12.0, 90.0)},
        {"base": side(9.0, 100.0), "checkout": side(6.0, 150.0)},
    ]
    rows = bench_revisions.table_rows("int8", pairs)
    assert [r[4] for r in rows] == ["1.250", "1.000", "1.500", "1.250"]
    assert [r[7] for r in rows] == ["1.100", "1.000", "1.500", "1.100"]
    assert rows[-1][:4] == ["int8", "median", "10.00", "8.00"]


def test_the_rerank_peer_gets_our_pairs_tokens(perf_imports, demo_dir):
    """bench_rerank --vllm formats the query and documents as vLLM's docs do for
    Qwen3-Reranker (the template's head with the query, each document with its tail), which
    vLLM tokenizes apart: those tokens must be our pairs' for the rates and scores to
    compare."""
    import bench_rerank
    from tokenizers import Tokenizer

    from qwen_embed_deploy.serving.config import DEMO_RERANKER_DIR
    from qwen_embed_deploy.serving.rerank import PairTokenizer, RerankOptions

    documents = [
        "Beijing is the capital.",
        "\nA line first.",
        "  spaced",
        "x" * 300,
        "日本語の文書",
    ]
    pairs = PairTokenizer(DEMO_RERANKER_DIR, 8192).encode(
        bench_rerank.QUERY, documents, RerankOptions()
    )
    query, texts = bench_rerank.vllm_texts(documents)
    tok = Tokenizer.from_file(str(DEMO_RERANKER_DIR / "tokenizer.json"))
    head = tok.encode(query, add_special_tokens=False).ids
    assert [head + tok.encode(t, add_special_tokens=False).ids for t in texts] == [
        list(p) for p in pairs
    ]


def test_a_base_revision_is_named_with_its_commit(perf_imports):
    """Reports name a base as given and by its commit, which a name like HEAD loses later."""
    import subprocess

    from harness import named_revision

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=PERF.parent,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert named_revision("HEAD") == f"HEAD ({commit})"
    assert named_revision(commit) == commit


def test_stack_shares_count_each_of_our_functions_once_per_sample(perf_imports):
    """bench_serving --spy: py-spy's raw stacks as shares of the wall (rate x seconds x stubs):
    our functions inclusive (once per sample, recursion or not), where samples ended (any
    code), and the share inside an execute."""
    from bench_serving import stack_shares

    execute = "TritonPythonModel.execute (model.py:84)"
    call = "TritonPythonModel._call (model.py:181)"
    engine = "Encoder._run (qwen_embed/engine.py:613)"
    torch_op = "OpOverloadPacket.__call__ (torch/_ops.py:1267)"
    lines = [
        f"{execute};{call};{engine};{engine};{torch_op} 30",  # recursion: counted once
        f"{execute};{call} 10",
        "main (threading.py:1) 20",  # another thread, not our code
    ]
    shares = stack_shares(lines, wall_samples=100)
    assert shares["sampled"] == pytest.approx(0.6)
    assert shares["in_execute"] == pytest.approx(0.4)
    assert dict(shares["inclusive"]) == pytest.approx({execute: 0.4, call: 0.4, engine: 0.3})
    assert dict(shares["self"]) == pytest.approx(
        {torch_op: 0.3, call: 0.1, "main (threading.py:1)": 0.2}
    )


def test_the_stub_sampler_records_a_running_process(perf_imports, tmp_path):
    """bench_serving --spy's py-spy (requirements.txt) attached to a process that spends its
    time in a `TritonPythonModel.execute` of a file named model.py, as a stub does."""
    from bench_serving import StubSampler, py_spy

    if py_spy() is None:
        pytest.skip("py-spy is not installed (make setup installs it)")
    (tmp_path / "model.py").write_text(
        "import time\n"
        "class TritonPythonModel:\n"
        "    def execute(self, seconds):\n"
        "        end = time.perf_counter() + seconds\n"
        "        while time.perf_counter() < end:\n"
        "            sum(range(1000))\n"
        "TritonPythonModel().execute(30)\n"
    )
    busy = subprocess.Popen([sys.executable, "model.py"], cwd=tmp_path)
    try:
        # py-spy's start is slow on a loaded machine: a longer recording where one had none
        for seconds in (1, 4, 12):
            sampler = StubSampler([busy.pid], tmp_path)
            time.sleep(seconds)
            shares = sampler.stop()
            if "error" not in shares:
                break
    finally:
        busy.kill()
    assert "error" not in shares, shares["error"]
    # of what py-spy sampled, nearly all is inside the execute (the wall also holds its start)
    assert shares["in_execute"] / shares["sampled"] > 0.9, shares
    assert any(f.startswith("TritonPythonModel.execute (model.py:") for f, _ in shares["inclusive"])


class _Parsed(Exception):
    """Raised in place of running a script, once its parser took the command line."""


@pytest.mark.server
def test_the_gpu_script_runs_only_command_lines_its_scripts_take(perf_imports, tmp_path):
    """perf/gpu_offline.sh dry: every command line of its GPU, Qwen3-VL and CPU steps, recorded
    instead of run, is taken by its script's own parser (unknown options, values of the wrong
    type or choice fail), and each pytest selection collects tests: a lent GPU's few minutes are
    not spent on an option renamed since its last run."""
    commands = _dry_run(tmp_path)
    scripts = {Path(argv[0]).name for _, *argv in commands if argv[0].endswith(".py")}
    assert {"bench_engine.py", "bench_serving.py", "profile_engine.py"} <= scripts, scripts
    selections = [argv[2:] for _, *argv in commands if argv[:2] == ["-m", "pytest"]]
    assert {cwd for cwd, *argv in commands if argv[:2] == ["-m", "pytest"]} == {str(PERF.parent)}
    collect = subprocess.Popen(  # one process: the imports behind every selection made once
        [sys.executable, "-c", _COLLECT, json.dumps(selections)],
        cwd=PERF.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for cwd, *argv in commands:
        if argv[:2] != ["-m", "pytest"]:
            _parse_only(cwd, argv)
    out = collect.communicate(timeout=300)[0]
    codes = json.loads(out.splitlines()[-1])
    failed = [" ".join(s) for s, code in zip(selections, codes, strict=True) if code]
    assert not failed, f"pytest selections that collect nothing or fail: {failed}"


def _dry_run(
    tmp_path, earlier: dict[str, str] | None = None, seconds: int = 600
) -> list[list[str]]:
    """The command lines perf/gpu_offline.sh dry records ([cwd, arguments...] each) in a
    budget of `seconds`, with the files of `earlier` (name -> text) in its report folder as an
    earlier call left them."""
    tmp_path.mkdir(exist_ok=True)
    record = tmp_path / "commands.jsonl"
    args = ["bash", "perf/gpu_offline.sh", "dry", str(record)]
    if earlier is not None:
        (tmp_path / "earlier").mkdir()
        for name, text in earlier.items():
            (tmp_path / "earlier" / name).write_text(text)
        args.append(str(tmp_path / "earlier"))
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    subprocess.run(
        args,
        cwd=PERF.parent,
        env={**os.environ, "PATH": path, "DRY_SECONDS": str(seconds)},
        capture_output=True,
        check=True,
        timeout=120,
    )
    return [json.loads(line) for line in record.read_text().splitlines()]


def _outs(commands: list[list[str]]) -> set[str]:
    """The reports the command lines write: --out's and --junitxml's file names."""
    names = set()
    for _, *argv in commands:
        for flag in ("--out", "--junitxml"):
            if flag in argv:
                names.add(Path(argv[argv.index(flag) + 1]).name)
    return names


@pytest.mark.server
def test_a_second_gpu_call_passes_over_the_steps_the_first_reported(tmp_path):
    """A lent GPU's second call on the warm machine goes on where the first ran out of time:
    the steps whose reports are there already are not run again, the graphs' verdict of the
    first call's tests holds (a failed check keeps the figures eager), the others run."""
    earlier = {
        "gpu-tests-graphs.xml": "<testsuites/>",
        "gpu-tests.xml": "<testsuites/>",
        "graphs.status": "1\n",
        "gpu-engine.md": "# engine",
        "gpu-vl-images.md": "# images",
    }
    first = _outs(_dry_run(tmp_path / "first"))
    commands = _dry_run(tmp_path / "second", earlier)
    second = _outs(commands)
    assert {"gpu-tests.xml", "gpu-engine", "gpu-vl-images", "gpu-serving-1"} <= first, first
    assert not second & {"gpu-tests-graphs.xml", "gpu-tests.xml", "gpu-engine", "gpu-vl-images"}
    assert {"gpu-serving-1", "gpu-whole-graphs", "gpu-vl-videos", "gpu-engine-fp8"} <= second
    # the first call's graph check failed: eager figures, and no step for bigger graphs
    serving = next(argv for _, *argv in commands if "gpu-serving-1" in " ".join(argv))
    assert "cuda_graph_tokens=0" in serving
    assert "gpu-serving-graphs16384" not in second and "gpu-serving-graphs16384" in first


@pytest.mark.server
def test_a_gpu_step_that_cannot_finish_is_left_for_a_later_call(tmp_path):
    """With less than 2/3 of a step's seconds left, the step does not start (cut short, it
    would report nothing): shorter steps after it still run, in a budget of 70 s the engine's
    (120 s) and the VL images' (150 s) wait for a later call, Triton's (75 s) runs."""
    commands = _outs(_dry_run(tmp_path, seconds=70))
    assert "gpu-engine" not in commands and "gpu-vl-images" not in commands, commands
    assert {"gpu-serving-1", "gpu-tests.xml", "gpu-vl-videos"} <= commands, commands


# Each pytest selection (a JSON list of argument lists) collected in turn; the exit codes last.
_COLLECT = """
import json, sys, pytest
codes = [int(pytest.main(args + ["--collect-only"])) for args in json.loads(sys.argv[1])]
print(json.dumps(codes))
"""


def _parse_only(cwd: str, argv: list[str]) -> None:
    """`python3 argv...` run from `cwd` up to its parser's answer: _Parsed where it took the
    arguments; a module without a parser must be given none."""
    real = argparse.ArgumentParser.parse_args

    def parse_args(parser, args=None, namespace=None):
        real(parser, args, namespace)
        raise _Parsed

    where = os.getcwd()
    os.chdir(cwd)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
            if argv[0] == "-m":
                spec = importlib.util.find_spec(argv[1])
                assert spec is not None, argv
                if "argparse" not in Path(spec.origin).read_text():
                    assert argv[2:] == [], f"{argv[1]} takes no arguments: {argv}"
                    return
                patch.setattr(sys, "argv", [spec.origin, *argv[2:]])
                with pytest.raises(_Parsed):  # in its package: its relative imports resolve
                    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
                return
            patch.setattr(sys, "argv", argv)
            with pytest.raises(_Parsed):
                runpy.run_path(argv[0], run_name="__main__")
    finally:
        os.chdir(where)


def test_peers_gguf_systems_serve_the_file_of_their_kind(perf_imports):
    """A triton-gguf system serves the very file its llama peers serve."""
    import bench_peers

    peers = {"triton-gguf": "llama", "triton-gguf-int8": "llama-q8", "triton-gguf-q4": "llama-q4"}
    peers["triton-gguf-q4-int8"] = "llama-q4-best"
    for ours, llama in peers.items():
        for dtype in ("float32", "bfloat16"):
            served = bench_peers.gguf_outtype(ours, dtype)
            assert served == bench_peers.gguf_outtype(llama, dtype), (ours, dtype)
    outtypes = {bench_peers.gguf_outtype(llama, "bfloat16") for llama in peers.values()}
    assert outtypes == {"bf16", "q8_0", "q4_k_m"}
    assert bench_peers.gguf_outtype("llama-best", "float32") == "f32"


def test_the_images_peer_gets_our_chat_turn(perf_imports, tmp_path):
    """bench_images gives llama.cpp each input in the chat turn our tokenizer writes (its image
    where ours puts the placeholders), images that both keep at their own size (whole 32-pixel
    blocks within Qwen3-VL-Embedding's budget: the same tokens), and llama.cpp's converter a view
    of a Qwen3-VL checkpoint that keeps its architecture (its text model's and tower's classes)."""
    import io

    import bench_images
    import prepare_model
    from PIL import Image

    from qwen_embed_deploy.serving.images import ImageSettings, fit
    from qwen_embed_deploy.serving.tokenizer import ChatTemplate

    chat = ChatTemplate()
    before, text, after = chat.parts(chat.system(None), "<image>", False, "a caption")
    turn = f"{bench_images.SYSTEM_TURN}<image>a caption{bench_images.END_TURN}"
    assert before + text + after == turn
    sizes = set()
    for caption, png in bench_images.make_inputs(8, seed=0):
        width, height = Image.open(io.BytesIO(png)).size
        assert fit(height, width, ImageSettings()) == (height, width)
        assert 0 < len(caption.split()) <= 40
        sizes.add((width, height))
    assert sizes == set(bench_images.SIZES)
    vl = {"architectures": ["Qwen3VLForConditionalGeneration"], "vision_config": {}}
    text_only = {"architectures": ["Qwen3Model"], "model_type": "qwen3"}
    for config, kept in ((vl, "Qwen3VLForConditionalGeneration"), (text_only, "Qwen3ForCausalLM")):
        (tmp_path / "config.json").write_text(json.dumps(config))
        edits = prepare_model.edited_files("llama", tmp_path)
        assert edits["config.json"]["architectures"] == [kept]


def test_every_reported_command_runs_as_shown(perf_imports):
    """Each report's command as RESULTS.md shows it (a folded script's subcommand in its place)
    is taken by that script's parser today: a figure of record can be measured again as shown."""
    import render_results

    for path in sorted(render_results.RESULTS.rglob("*.json")):
        command = json.loads(path.read_text()).get("command")
        if not command or render_results.script_of(command) in render_results.REMOVED:
            continue
        now = render_results.current_command(command)
        argv = shlex.split(now)
        argv = argv[argv.index(render_results.script_of(now)) :]
        try:
            _parse_only(str(PERF), argv)
        except BaseException as e:
            pytest.fail(f"{path.name}: `{' '.join(argv)}` no longer parses: {e!r}")


def test_reports_are_filed_under_their_cpu_kind(perf_imports):
    """A report lands in RESULTS.md's section of the CPU it ran on: an AMX Xeon's, the same
    Xeon whose AMX a hypervisor hides (Zen 4's kernels, not Zen 4's figures), Zen 4's, Zen 5's."""
    import render_results as r

    def kind(model: str, family: int, flags: str) -> str:
        machine = f"{model} (family {family}, model 1), 2 cores, Python 3.11.7"
        return r.cpu_kind({"machine": machine, "cpu": f"{model} ({flags})"})

    bf16 = "AVX2, AVX-512, AVX512_BF16, no AMX, VNNI"
    assert kind("Intel(R) Xeon(R) Processor", 6, bf16.replace("no AMX", "AMX")) == r.AMX
    assert kind("Intel(R) Xeon(R) Processor", 6, bf16) == r.XEON_BF16
    assert kind("AMD EPYC", 25, bf16) == r.ZEN4
    assert kind("AMD EPYC", 26, bf16) == r.ZEN5
    assert kind("AMD EPYC", 25, "AVX2, no AVX-512, no AVX512_BF16, no AMX, no VNNI") == r.AVX2

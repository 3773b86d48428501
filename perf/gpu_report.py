"""Everything a lent GPU machine should run, in one go, into one report: `make gpu-report`.

    python perf/gpu_report.py [--stack torch|kernels] [--out perf/results/gpu_report]
        [--steps nvidia-smi stack doctor test perf]

Runs, from the repository root, each step's make target or command in turn (the GPU stack is
already installed: the make target depends on setup-gpu), keeps going after a failed step, and
writes OUT.md and OUT.json: per step the command, exit status, minutes and the end of its output,
beside the machine, `nvidia-smi` and the installed GPU stack. A machine lent for minutes gives
every answer at once, and the report says which step to look at when one failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from harness import markdown_table, new_record, write_report

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
STEPS = ("nvidia-smi", "stack", "doctor", "test", "perf")


def commands(stack: str) -> dict[str, list[str]]:
    """Each step's command."""
    return {
        "nvidia-smi": ["nvidia-smi"],
        "stack": [PY, "-m", "qwen_embed_deploy.gpu_stack", "check", "--stack", stack],
        "doctor": [PY, "-m", "qwen_embed_deploy.gpu_stack", "doctor"],
        "test": [PY, "-m", "pytest", "-m", "gpu", "-rs", "-q"],
        "perf": ["make", "perf-gpu", f"GPU_STACK={stack}"],
    }


TAIL_LINES = 40


def run_step(command: list[str]) -> dict:
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        rc, output = done.returncode, done.stdout + done.stderr
    except OSError as e:  # the command is not there (no NVIDIA driver: no nvidia-smi)
        rc, output = 127, str(e)
    return {
        "command": " ".join(Path(c).name if c == PY else c for c in command),
        "rc": rc,
        "minutes": (time.monotonic() - started) / 60,
        "tail": output.splitlines()[-TAIL_LINES:],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "perf" / "results" / "gpu_report"))
    p.add_argument("--stack", default="torch", help="the GPU stack setup-gpu installed")
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    args = p.parse_args()
    steps, results = commands(args.stack), {}
    for name in args.steps:
        print(f"--- {name}: {' '.join(steps[name])}", flush=True)
        results[name] = run_step(steps[name])
        print(f"rc {results[name]['rc']}, {results[name]['minutes']:.1f} min", flush=True)
    record = new_record(steps=results)
    table = markdown_table(
        ["step", "command", "exit status", "minutes"],
        [[n, f"`{r['command']}`", r["rc"], f"{r['minutes']:.1f}"] for n, r in results.items()],
    )
    for name, r in results.items():
        table += ["", f"## {name} (exit status {r['rc']})", "", "```", *r["tail"], "```"]
    notes = ["results of perf-gpu: perf/results/gpu_engine_*, gpu_serving, gpu_peers"]
    write_report(args.out, record, "GPU report", notes, table)
    raise SystemExit(max((r["rc"] != 0 for r in results.values()), default=0))


if __name__ == "__main__":
    main()

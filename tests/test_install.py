"""Installed as a wheel (not editable), the package finds its model repository template and
renders repositories from any working directory: the template ships inside the package."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server  # starts tritonserver or other processes

ROOT = Path(__file__).resolve().parents[1]


def run(args, **kwargs):
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_an_installed_wheel_serves_without_the_checkout(tmp_path, demo_dir):
    wheels, site, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "--quiet"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, ROOT])
    (wheel,) = wheels.glob("qwen_embed-*.whl")
    run([*pip, "install", "--no-deps", "--target", site, wheel])
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = run(
        [
            sys.executable,
            "-c",
            "import qwen_embed_deploy.serving.config as c; "
            "print(c.__file__, c.MODEL_REPOSITORY, c.DATA_DIR, sep='\\n')",
        ],
        cwd=elsewhere,
        env=env,
    ).split()
    module, template, data = map(Path, where)
    assert module.is_relative_to(site) and template.is_relative_to(site)
    assert (template / "encoder" / "config.pbtxt").is_file()
    assert not data.is_relative_to(site)  # demo models and Triton go to the user's cache
    out = tmp_path / "repo"
    run(
        [
            sys.executable,
            "-m",
            "qwen_embed_deploy.repository",
            out,
            f"embed={demo_dir}",
            "--rerank",
            f"rerank={demo_dir}",
        ],
        cwd=elsewhere,
        env=env,
    )
    for step in ("tokenizer", "encoder", "rerank_tokenizer", "rerank_encoder"):
        assert (out / step / "1" / "model.py").is_file()
    assert str(demo_dir) in (out / "encoder" / "config.pbtxt").read_text()


def test_a_stub_of_another_python_is_replaced_without_a_download(tmp_path, monkeypatch):
    """A checkout whose venv moved to another Python (3.11 to 3.12, as on a GPU machine's
    image) keeps its unpacked server; the Python backend gets this Python's stub, since one
    built for another cannot load its libpython."""
    from qwen_embed_deploy import triton

    monkeypatch.setattr(triton, "CACHE", tmp_path)
    server = triton.local_server_dir()
    stubs = server / "python_backend_stubs"
    for version in ("3.8", triton.PY_VERSION):
        (stubs / version).mkdir(parents=True)
        (stubs / version / "triton_python_backend_stub").write_text(f"stub for {version}")
    (server / "bin").mkdir()
    (server / "bin" / "tritonserver").write_text("server")
    installed = server / "backends" / "python" / "triton_python_backend_stub"
    installed.parent.mkdir(parents=True)
    installed.write_text("stub for 3.8")

    def no_download():
        raise AssertionError("the server files are there: nothing to download")

    monkeypatch.setattr(triton, "_unpack_server", no_download)
    assert triton.install() == server
    assert installed.read_text() == f"stub for {triton.PY_VERSION}"
    assert os.access(installed, os.X_OK)
    installed.chmod(0o600)  # this Python's stub already in place: left as it is
    triton.install()
    assert not os.access(installed, os.X_OK)

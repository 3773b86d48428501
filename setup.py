"""Ships the model repository template inside the package
(qwen_embed_deploy/model_repository), so an installed wheel renders and serves repositories
without the source checkout (qwen_embed_deploy.serving.config)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithTemplate(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "qwen_embed_deploy" / "model_repository"
        shutil.copytree(
            Path(__file__).parent / "model_repository",
            target,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("__pycache__"),
        )


setup(cmdclass={"build_py": BuildWithTemplate})

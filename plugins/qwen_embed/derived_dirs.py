"""Directories the server derives from a user's files and reads as checkpoints (a LoRA
fine-tune's links over its base, finetunes.py; a GGUF file's config, tokenizer and link,
gguf_files.py): made once per version of those files in the temporary directory, written aside
and renamed into place, so that processes starting together share one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def made_once(kind: str, version: str, write: Callable[[Path], None]) -> Path:
    """$TMPDIR/`kind`/`version`, written by `write` into an empty directory where it does not
    exist yet (nothing is left behind where `write` fails)."""
    target = Path(tempfile.gettempdir()) / kind / version
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        write(building)
    except BaseException:
        shutil.rmtree(building)
        raise
    try:
        os.rename(building, target)
    except OSError:  # another process made it first
        shutil.rmtree(building)
    return target

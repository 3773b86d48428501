"""Functions compiled by Inductor once per process, run eagerly where compiling fails.

The int8 route's quantise and rescale passes (int8.py) are elementwise chains over
activation-sized tensors; Inductor fuses each into one loop. Where compiling fails (no C++
compiler) the same functions run eagerly: same results up to rounding, only slower.
"""

from __future__ import annotations

import locale
import logging
import threading
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def _prepare_inductor() -> None:
    import torch._inductor.config as inductor

    # Inductor reads and writes UTF-8 source with the locale's encoding: inside Triton's Python
    # stub that is ASCII (no locale set up), so use UTF-8.
    if locale.getpreferredencoding(False).lower() not in ("utf-8", "utf8"):
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
    # Compile in this process: in Triton's Python stub sys.executable is the stub, so Inductor's
    # compile-worker subprocesses could not start.
    inductor.compile_threads = 1


class CompiledSet:
    """Named functions; attribute access gives the compiled version once `ensure_compiled`
    succeeded, else the eager one."""

    def __init__(self, name: str, fns: dict[str, Callable], warmup: Callable[[], None]):
        self.name = name
        self._eager, self._warmup = fns, warmup
        self._lock = threading.Lock()
        self._compiled_fns: dict[str, Callable] = {}
        self.compiled: bool | None = None  # None: not tried yet

    def __getattr__(self, fn: str) -> Callable:
        d = self.__dict__
        fns = d["_compiled_fns"] if d["compiled"] else d["_eager"]
        try:
            return fns[fn]
        except KeyError:
            raise AttributeError(fn) from None

    def ensure_compiled(self) -> bool:
        """Compile (once per process), then run the warm-up through the compiled functions so
        that compiling for the shapes it meets happens at load, not in the first request.
        Under inference mode, as forwards run. Any failure: eager from then on."""
        with self._lock:
            if self.compiled is not None:
                return self.compiled
            try:
                _prepare_inductor()
                self._compiled_fns = {
                    k: torch.compile(f, dynamic=True) for k, f in self._eager.items()
                }
                self.compiled = True  # the warm-up runs through the compiled functions
                with torch.inference_mode():
                    self._warmup()
            except Exception as e:  # no compiler, unsupported platform: exact but slower
                log.warning("%s: torch.compile failed (%s); running eagerly", self.name, e)
                self.compiled = False
            return self.compiled

"""Functions compiled by Inductor on first use, run eagerly where compiling fails.

Elementwise chains over activation-sized tensors (norms, rotary, gating, the int8 route's
quantise and rescale) cost one memory pass per eager op; Inductor fuses each chain into one
loop. A set is compiled once per process (inside Triton's Python stub too); until then, and for
good where compiling fails (no C++ compiler), its eager versions run: same results up to
rounding, only slower.
"""

from __future__ import annotations

import contextlib
import contextvars
import locale
import logging
import threading
from collections.abc import Callable, Iterator

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
    """Named functions: `formulas` are what Inductor compiles, `eager` what runs otherwise.
    Attribute access gives the version in force: the compiled one once compiling succeeded,
    and, for a set that is not `on_by_default`, only inside `enabled(True)` (a model that
    chose it wraps its forward in that, so one process can hold models that differ)."""

    def __init__(
        self,
        name: str,
        formulas: dict[str, Callable],
        eager: dict[str, Callable],
        warmup: Callable[[], None] | None = None,
        on_by_default: bool = True,
    ):
        self.name = name
        self._formulas, self._eager, self._warmup = formulas, eager, warmup
        self._lock = threading.Lock()
        self._compiled_fns: dict[str, Callable] = {}
        self._on = contextvars.ContextVar(f"{name} on", default=on_by_default)
        self.compiled: bool | None = None  # None: not tried yet

    def __getattr__(self, fn: str) -> Callable:
        d = self.__dict__
        fns = d["_compiled_fns"] if d["compiled"] and d["_on"].get() else d["_eager"]
        try:
            return fns[fn]
        except KeyError:
            raise AttributeError(fn) from None

    @contextlib.contextmanager
    def enabled(self, on: bool) -> Iterator[None]:
        token = self._on.set(on)
        try:
            yield
        finally:
            self._on.reset(token)

    def ensure_compiled(self, warmup: Callable[[], None] | None = None) -> bool:
        """Compile (once per process), then run `warmup` (default: the set's own) through
        the compiled functions, so that compiling for the shapes it meets happens now, not
        in the first request. Under inference mode, as forwards run: a warm-up outside it
        would leave the first request to compile again. Any failure: eager from then on."""
        with self._lock:
            if self.compiled is False:
                return False
            try:
                if self.compiled is None:
                    _prepare_inductor()
                    self._compiled_fns = {
                        k: torch.compile(f, dynamic=True) for k, f in self._formulas.items()
                    }
                self.compiled = True  # the warm-up runs through the compiled functions
                with torch.inference_mode(), self.enabled(True):
                    (warmup or self._warmup or (lambda: None))()
            except Exception as e:  # no compiler, unsupported platform: exact but slower
                log.warning("%s: torch.compile failed (%s); running eagerly", self.name, e)
                self.compiled = False
            return self.compiled

"""How long the caller waits, read from what its SDK or proxy sends, set as the deadline of the
Triton requests made for it (client.deadline): a request still queued for the encoder when
its caller has stopped waiting is dropped there instead of computed for no one.

Headers read, the shortest taken: `x-stainless-read-timeout` (seconds; the `openai` SDKs send
their read timeout in it) and `x-envoy-expected-rq-timeout-ms` (milliseconds; Envoy and Istio
send the route's timeout). A value that is not a positive finite number is ignored.
"""

from __future__ import annotations

import math

from ..client import deadline

# Header (lower case, as ASGI gives it) -> seconds per unit.
HEADERS = {b"x-stainless-read-timeout": 1.0, b"x-envoy-expected-rq-timeout-ms": 1e-3}


def waits_s(headers: list[tuple[bytes, bytes]]) -> float | None:
    """The shortest wait the request's headers announce, in seconds (None: none does)."""
    waits = []
    for name, value in headers:
        unit = HEADERS.get(name.lower())
        if unit is None:
            continue
        try:
            seconds = float(value) * unit
        except ValueError:
            continue
        if math.isfinite(seconds) and seconds > 0:
            waits.append(seconds)
    return min(waits, default=None)


class CallerDeadline:
    """ASGI middleware: each HTTP request's handler runs within the deadline its caller
    announces (none: the client's own timeout alone)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        seconds = waits_s(scope["headers"]) if scope["type"] == "http" else None
        if seconds is None:
            return await self.app(scope, receive, send)
        with deadline(seconds):
            return await self.app(scope, receive, send)

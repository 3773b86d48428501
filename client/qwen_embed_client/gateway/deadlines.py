"""Work for a caller only while it waits. How long it waits, read from what its SDK or proxy
sends, is the deadline of the Triton requests made for it (client.deadline): a request still
queued for the encoder when its caller has stopped waiting is dropped there instead of
computed for no one. A caller that disconnects has its handler cancelled.

Headers read, the shortest taken: `x-stainless-read-timeout` (seconds; the `openai` SDKs send
their read timeout in it) and `x-envoy-expected-rq-timeout-ms` (milliseconds; Envoy and Istio
send the route's timeout). A value that is not a positive finite number is ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
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


class CallerWait:
    """ASGI middleware: each HTTP request's handler runs only while its caller waits: within
    the deadline the caller announces (none: the client's own timeout alone), and cancelled
    when the caller disconnects before its answer begins. The cancelled handler's Triton calls
    are cancelled with it and the chunks it had not sent yet are never sent (Triton 2.51 still
    computes a call already queued for the encoder: only a deadline reaches that)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        read = asyncio.Event()  # the body is read whole: what receive() gives next is the end
        answering = False

        async def receive_body():
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                read.set()
            return message

        async def send_answer(message):
            nonlocal answering
            answering = True
            await send(message)

        async def gone():  # uvicorn's next message after the body is the end of the request
            await read.wait()
            return (await receive())["type"] == "http.disconnect"

        seconds = waits_s(scope["headers"])
        with deadline(seconds) if seconds is not None else contextlib.nullcontext():
            handler = asyncio.ensure_future(self.app(scope, receive_body, send_answer))
        watcher = asyncio.ensure_future(gone())
        try:
            done, _ = await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server stopping
            handler.cancel()
            raise
        finally:
            watcher.cancel()
        if handler not in done and watcher.result() and not answering:  # the caller left
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handler
            return
        await handler

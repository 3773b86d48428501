"""The gateway's access log (--access-log, $QWEN_EMBED_ACCESS_LOG): one JSON line per request
on stdout, for the log collector beside the server: who asked (the client's address, its API
key's name and owner digest, its user agent), what (method, path, route template, API), what
answered (status, seconds, and the tokens each Triton model ran for it, what billing per key
or per model reads). Probes and scrapes (/health, /metrics) are left out as in the metrics.

The key's name is the keys file's (keys.py; "" for a plain key); the owner is the Batch API's
(keys.KeyRing.owner: a digest of the key, never the key), empty where the gateway takes no
keys.
"""

from __future__ import annotations

import logging
import sys
from datetime import datetime, timezone

import orjson
from starlette.requests import Request

LOGGER = "qwen_embed_client.gateway.access"


class AccessLog:
    def __init__(self, stream=None):
        self.logger = logging.getLogger(LOGGER)
        if not self.logger.handlers:  # one handler however many apps a process makes (tests)
            handler = logging.StreamHandler(stream or sys.stdout)
            handler.setFormatter(logging.Formatter("%(message)s"))
            self.logger.addHandler(handler)
            self.logger.setLevel(logging.INFO)
            self.logger.propagate = False  # not again through the root logger's handlers

    def write(
        self,
        scope,
        route: str,
        api: str,
        status: int,
        seconds: float,
        usage: dict[str, int],
        key: str,
    ) -> None:
        headers = dict(scope.get("headers") or ())
        client = scope.get("client")
        line = {
            "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "client": client[0] if client else None,
            "method": scope["method"],
            "path": scope["path"],
            "route": route,
            "api": api,
            "status": status,
            "seconds": round(seconds, 6),
            "models": usage,
            "tokens": sum(usage.values()),
            "key": key,
            "owner": scope["app"].state.keys.owner(Request(scope)),
            "user_agent": headers.get(b"user-agent", b"").decode("latin-1"),
        }
        request_id = headers.get(b"x-request-id")
        if request_id is not None:
            line["request_id"] = request_id.decode("latin-1")
        self.logger.info(orjson.dumps(line).decode())

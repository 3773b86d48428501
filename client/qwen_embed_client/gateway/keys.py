"""The gateway's API keys: who may call it, which models each key may use, and how fast.

Plain keys (--api-key, $QWEN_EMBED_API_KEY) may use every model, without limits. Named keys
come from a JSON file (--api-keys-file, $QWEN_EMBED_API_KEYS_FILE):

    {"keys": [
        {"name": "search", "sha256": "<hex SHA-256 of the key>", "models": ["embed"],
         "requests_per_minute": 600, "tokens_per_minute": 1000000},
        {"name": "nightly", "key": "<the key itself>", "priority": "bulk"}
    ]}

- `sha256` (or `key`) is how a request's key is recognised; `name` is how the metrics, the
  access log and messages name it (never the key); `expires_at` (ISO 8601, UTC where it names
  no zone) when it stops being taken. `python -m qwen_embed_client.gateway new-key NAME` makes
  a new key and its entry.
- `models`: the served names it may use (their LoRA adapters with them), absent for all; any
  other model does not exist for it: a 404 naming it, and absent from the model lists. Checked
  where every Triton request passes (client.guarded), so that no route can forget it; the
  Batch API's lines run under the key that made the batch.
- `priority`: "bulk" sends every request of the key at Triton's bulk priority, whatever its
  body asks, so that a tenant's bulk work never goes before the interactive requests of the
  others (the encoder's queue takes interactive ones first); absent: as each request asks.
- `requests_per_minute`, `tokens_per_minute`: a bucket of a minute's worth each, refilled
  continuously; a request finding either empty is refused with 429 and Retry-After. A request
  takes its tokens once answered (what its models ran), so one may overdraw and the next wait.
  Answers to a limited key carry OpenAI's x-ratelimit-* headers. `max_concurrent_requests`:
  a request past that many of the key's in flight is refused at once (429, Retry-After 1), so
  that one tenant cannot fill the encoder's queue for all. Batch lines are not limited.

The file is read again when it changes (a key added, rotated or revoked without a restart);
one that does not read then is logged and the keys before it kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from fastapi import Request

from ..client import Check
from ..contract import PRIORITIES, ensemble_steps
from .errors import NOT_FOUND, RATE_LIMITED, UNAUTHORIZED, APIError

log = logging.getLogger(__name__)

RECHECK_S = 1.0  # how often the keys file's change is looked for
_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")
_FIELDS = {"name", "sha256", "key", "expires_at", "models", "priority", *_LIMITS}


@dataclass
class Bucket:
    """A minute's worth of `per_minute`, refilled continuously."""

    per_minute: float
    level: float
    at: float

    def now(self, now: float) -> float:
        self.level = min(self.per_minute, self.level + (now - self.at) * self.per_minute / 60)
        self.at = now
        return self.level

    def wait_s(self, now: float) -> float:
        """Seconds until it holds one again (0: it does)."""
        return max(0.0, (1 - self.now(now)) * 60 / self.per_minute)


@dataclass(frozen=True)
class Key:
    name: str  # "" for a plain key
    digest: bytes  # SHA-256 of the key
    expires_at: float | None = None  # time.time() from which it is refused
    models: tuple[str, ...] | None = None  # the served names it may use; None: every one
    # the Triton models those names ask: their ensembles and the ensembles' tokenizers
    allowed: frozenset[str] | None = None
    priority: int = 0  # Triton's level of all its requests; 0: each request's own
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrent_requests: int | None = None
    buckets: dict[str, Bucket] = field(default_factory=dict, compare=False)  # by what
    # client.guarded's check of its models and priority; None: every model, as asked
    check: Check | None = field(default=None, compare=False)


class KeyRing:
    """The keys a gateway takes: the plain ones and the file's, `served` mapping each served
    name to its Triton ensembles (served.ServedModels.ensembles)."""

    def __init__(
        self,
        plain: tuple[str, ...],
        path: Path | None,
        served: dict[str, tuple[str, ...]],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ):
        self.plain = tuple(Key("", _sha256(k)) for k in plain)
        self.path, self.served, self.clock, self.wall = path, served, clock, wall
        # each Triton model's (an ensemble's, its tokenizer's) first served name, for messages
        self._names = {}
        for name, ensembles in reversed(served.items()):
            self._names |= {step: name for e in ensembles for step in (e, ensemble_steps(e)[0])}
        self._stamp, self._checked = None, clock()
        self.in_flight: dict[str, int] = {}  # by key name: a reloaded key keeps its count
        named = ()
        if path is not None:
            self._stamp = _stamp(path)
            try:  # at start, a file that does not read stops the gateway
                named = self._read()
            except (OSError, ValueError) as e:
                raise ValueError(f"--api-keys-file {path}: {e}") from None
        self._take(named)

    @property
    def on(self) -> bool:
        """Whether a key is needed (a keys file holding none: nobody gets in)."""
        return bool(self.plain) or self.path is not None

    def admit(self, request: Request, limited: bool = True) -> None:
        """The request's key found (401 otherwise) and, where `limited`, its limits checked
        (429); the key kept in the request's state for its guard, its tokens and its answer's
        headers."""
        if not self.on:
            return
        key = self._find(_authorization(request))
        if key is None:
            raise APIError(UNAUTHORIZED, "Incorrect API key provided")
        if key.expires_at is not None and self.wall() >= key.expires_at:
            when = datetime.fromtimestamp(key.expires_at, timezone.utc).isoformat()
            raise APIError(UNAUTHORIZED, f"the API key '{key.name}' expired at {when}")
        request.state.api_key = key
        if not limited:
            return
        now = self.clock()
        for what, bucket in key.buckets.items():
            wait = bucket.wait_s(now)
            if wait > 0:
                raise APIError(
                    RATE_LIMITED,
                    f"rate limit reached for the API key '{key.name}': {bucket.per_minute:g} "
                    f"{what} per minute; try again in {wait:.3g} s",
                    headers={"retry-after": str(math.ceil(wait)), "retry-after-ms": str(_ms(wait))},
                )
        most, now_in = key.max_concurrent_requests, self.in_flight.get(key.name, 0)
        if most and now_in >= most:
            raise APIError(
                RATE_LIMITED,
                f"the API key '{key.name}' has {most} requests in flight, its most; send this "
                "one when one of them is answered",
                headers={"retry-after": "1", "retry-after-ms": "1000"},
            )
        if "requests" in key.buckets:
            key.buckets["requests"].level -= 1
        if most:
            self.in_flight[key.name] = now_in + 1
            request.state.api_key_slot = key.name

    def owner(self, request: Request) -> str:
        """Whose Batch API files and batches a request may see: a digest of its named key's
        name (a rotated key keeps its team's files), else of its key ("" with keys off)."""
        if not self.on:
            return ""
        key = getattr(request.state, "api_key", None)
        who = f"named key {key.name}" if key is not None and key.name else _authorization(request)
        return hashlib.sha256(who.encode()).hexdigest()[:32]

    def guard(self, key_name: str) -> Check | None:
        """The check (client.guarded) of the Triton models the named key may ask and of its
        priority, None where it may ask every one as it likes; for a key the file no longer
        holds, one that refuses all."""
        if not key_name:
            return None
        key = self._named(key_name)
        if key is None:

            def revoked(model: str, priority: int) -> int:
                raise APIError(UNAUTHORIZED, f"the API key '{key_name}' is no longer accepted")

            return revoked
        return key.check

    def request_guard(self, scope) -> Check | None:
        """The guard of whichever key `admit` finds for this request (none before it); None
        where the gateway takes no key."""
        if not self.on:
            return None

        def check(model: str, priority: int) -> int:
            key = scope.get("state", {}).get("api_key")
            return priority if key is None or key.check is None else key.check(model, priority)

        return check

    def may_use(self, request: Request, ensemble: str) -> bool:
        """Whether the request's key may use the Triton ensemble (model lists)."""
        key = getattr(request.state, "api_key", None)
        return key is None or key.allowed is None or ensemble in key.allowed

    def done(self, scope, usage: dict[str, int]) -> None:
        """A request answered (or refused, or left by its client): its slot given back, the
        tokens its answer cost taken from its key's bucket."""
        state = scope.get("state", {})
        slot = state.pop("api_key_slot", None)
        if slot is not None:
            self.in_flight[slot] -= 1
        key = state.get("api_key")
        if key is not None:
            self._charge(key, tokens=sum(usage.values()))  # its request taken when admitted

    def room_in_s(self, key_name: str) -> float:
        """Seconds until each of the named key's limits holds a request again (0: now, and for
        a plain key, a key without limits or one no longer in the file)."""
        key = self._named(key_name)
        if key is None:
            return 0.0
        now = self.clock()
        return max((bucket.wait_s(now) for bucket in key.buckets.values()), default=0.0)

    def spend(self, key_name: str, usage: dict[str, int]) -> None:
        """A Batch API line of the named key answered: a request and its tokens taken from
        its limits (overdrawn if need be: its next shard waits)."""
        key = self._named(key_name)
        if key is not None:
            self._charge(key, requests=1, tokens=sum(usage.values()))

    def headers(self, scope) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-* headers of a limited key's answer."""
        key = scope.get("state", {}).get("api_key")
        if key is None or not key.buckets:
            return []
        out, now = [], self.clock()
        for what, bucket in key.buckets.items():
            level = bucket.now(now)
            full_in = (bucket.per_minute - level) * 60 / bucket.per_minute
            out += [
                (f"x-ratelimit-limit-{what}".encode(), f"{bucket.per_minute:g}".encode()),
                (f"x-ratelimit-remaining-{what}".encode(), str(max(0, int(level))).encode()),
                (f"x-ratelimit-reset-{what}".encode(), f"{round(full_in, 3):g}s".encode()),
            ]
        return out

    def key_name(self, scope) -> str:
        key = scope.get("state", {}).get("api_key")
        return "" if key is None else key.name

    def _check(self, key: Key) -> Check | None:
        if key.allowed is None and not key.priority:
            return None

        def check(model: str, priority: int) -> int:
            if key.allowed is not None and model not in key.allowed:
                name = self._names.get(model, model)
                raise APIError(
                    NOT_FOUND,
                    f"the model '{name}' does not exist or the API key '{key.name}' may not use it",
                    "model",
                )
            # a bulk key's requests go at bulk priority, however they ask
            return max(priority, key.priority)

        return check

    def _charge(self, key: Key, requests: int = 0, tokens: int = 0) -> None:
        """Requests and tokens taken from the key's buckets, overdrawn if need be."""
        now = self.clock()
        for what, cost in (("requests", requests), ("tokens", tokens)):
            if cost and what in key.buckets:
                key.buckets[what].now(now)
                key.buckets[what].level -= cost

    def _named(self, key_name: str) -> Key | None:
        return self._by_name.get(key_name) if key_name else None

    def _find(self, given: str) -> Key | None:
        if self.path is not None and self.clock() - self._checked >= RECHECK_S:
            self._reload()
        if not given.startswith("Bearer "):
            return None
        # looked up by the key's SHA-256: what a client sends cannot steer which digest it
        # meets, so the table's timing tells nothing of the keys
        return self._by_digest.get(_sha256(given.removeprefix("Bearer ")))

    def _take(self, named: tuple[Key, ...]) -> None:
        self.named = named
        self._by_digest = {k.digest: k for k in (*named, *self.plain)}  # a plain key first
        self._by_name = {k.name: k for k in named}

    def _reload(self) -> None:
        self._checked = self.clock()
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            named = self._read()
        except (OSError, ValueError) as e:
            log.error("%s: %s; the keys read before it kept", self.path, e)
            return
        held = {k.name: k for k in self.named}
        # a key whose limits did not change keeps its buckets' levels
        self._take(tuple(_kept(k, held.get(k.name)) for k in named))
        log.info("%s: %d named API keys", self.path, len(self.named))

    def _read(self) -> tuple[Key, ...]:
        try:
            data = json.loads(self.path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from None
        entries = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise ValueError('expected {"keys": [{"name": ..., "sha256": ...}, ...]}')
        keys = [self._key(i, entry) for i, entry in enumerate(entries)]
        for what in ("name", "digest"):
            values = [getattr(k, what) for k in keys]
            if len(set(values)) < len(values):
                raise ValueError(f"two keys have the same {'key' if what == 'digest' else what}")
        return tuple(keys)

    def _key(self, i: int, entry) -> Key:
        where = f"keys[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is not an object")
        if set(entry) - _FIELDS:
            raise ValueError(f"{where}: unknown fields {sorted(set(entry) - _FIELDS)}")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name must be a non-empty string")
        if ("sha256" in entry) == ("key" in entry):
            raise ValueError(f"{where} needs one of sha256 (the key's digest) and key")
        if "key" in entry:
            if not isinstance(entry["key"], str) or not entry["key"]:
                raise ValueError(f"{where}.key must be a non-empty string")
            digest = _sha256(entry["key"])
        else:
            try:
                digest = bytes.fromhex(entry["sha256"])
            except (TypeError, ValueError):
                digest = b""
            if len(digest) != 32:
                raise ValueError(f"{where}.sha256 must be 64 hex digits (sha256sum of the key)")
        expires_at = entry.get("expires_at")
        if expires_at is not None:
            expires_at = _instant(expires_at, f"{where}.expires_at")
        models = entry.get("models")
        if models is not None:
            if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
                raise ValueError(f"{where}.models must be a list of served model names")
            unknown = sorted(set(models) - set(self.served))
            if unknown:
                raise ValueError(
                    f"{where}.models: {unknown} not served (served: {sorted(self.served)})"
                )
            models = tuple(models)
        allowed = None
        if models is not None:
            ensembles = {e for name in models for e in self.served[name]}
            allowed = frozenset(ensembles | {ensemble_steps(e)[0] for e in ensembles})
        limits = {}
        for what in _LIMITS:
            value = entry.get(what)
            kinds = int if what == "max_concurrent_requests" else int | float
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, kinds) or value < 1
            ):
                kind = "an integer" if kinds is int else "a number"
                raise ValueError(f"{where}.{what} must be {kind} >= 1")
            limits[what] = value
        priority = entry.get("priority")
        if priority is not None and priority not in PRIORITIES:
            raise ValueError(f"{where}.priority must be one of {list(PRIORITIES)}")
        # "interactive": as each request asks (its default)
        level = PRIORITIES["bulk"] if priority == "bulk" else 0
        key = Key(name, digest, expires_at, models, allowed, level, **limits)
        now = self.clock()
        for what in ("requests", "tokens"):
            per_minute = limits[f"{what}_per_minute"]
            if per_minute:
                key.buckets[what] = Bucket(float(per_minute), float(per_minute), now)
        return replace(key, check=self._check(key))


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def _kept(key: Key, before: Key | None) -> Key:
    same = before is not None and (
        before.requests_per_minute,
        before.tokens_per_minute,
    ) == (key.requests_per_minute, key.tokens_per_minute)
    if same:
        key.buckets.update(before.buckets)
    return key


def _instant(text, where: str) -> float:
    """An ISO 8601 date or time (UTC where it names no zone) as time.time() counts it."""
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (AttributeError, TypeError, ValueError):
        raise ValueError(f"{where} must be an ISO 8601 date or time, got {text!r}") from None
    return when.replace(tzinfo=when.tzinfo or timezone.utc).timestamp()


def _sha256(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _stamp(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def _authorization(request: Request) -> str:
    """The request's key as an Authorization header says it: that header, else Azure OpenAI's
    `api-key: KEY` or Google's `x-goog-api-key: KEY` (their SDKs' ways) as `Bearer KEY`, so
    one key is one owner whichever way it came."""
    given = request.headers.get("authorization")
    if given is not None:
        return given
    for header in ("api-key", "x-goog-api-key"):
        if header in request.headers:
            return f"Bearer {request.headers[header]}"
    return ""


def embedders(request: Request) -> list:
    """The served embedders' Gateways (served.ServedModels) the request's key may use: what
    the model lists show it."""
    keys = request.app.state.keys
    return [
        gw for gw in request.app.state.models.embedders if keys.may_use(request, gw.client.model)
    ]


def check_described(request: Request, ensemble: str) -> None:
    """A route that describes a model without asking it (Ollama's /api/show, TEI's /info)
    holds the request's key to that model as asking it would: the same 404."""
    key = getattr(request.state, "api_key", None)
    if key is not None and key.check is not None:
        key.check(ensemble, 0)


def rerankers(request: Request) -> list:
    """The served rerankers' Gateways the request's key may use."""
    keys, models = request.app.state.keys, request.app.state.models
    return [gw for gw in models.rerankers if keys.may_use(request, gw.triton_rerank_model)]


async def require_key(request: Request) -> None:
    """A dependency of every API router (app.py): the request's API key and its limits,
    checked before any handler runs, so a new route cannot forget them (async: no thread
    hop per request)."""
    request.app.state.keys.admit(request)


async def require_batch_key(request: Request) -> None:
    """The Batch API's files and batches routes' dependency: the key, not its limits: a team
    uploads, polls and downloads whatever it has spent, and its batches' lines are taken from
    its limits as they run (batches.BatchRunner)."""
    request.app.state.keys.admit(request, limited=False)


def new_key(argv: list[str]) -> None:
    """A new key and its keys-file entry: the key goes to its holder, the entry (its digest,
    never the key) into the file."""
    import argparse
    import secrets

    p = argparse.ArgumentParser(
        prog="python -m qwen_embed_client.gateway new-key",
        description="a new API key and its entry for the gateway's --api-keys-file",
    )
    p.add_argument("name", help="how the metrics and the access log name the key")
    p.add_argument("--models", nargs="+", help="the served names it may use (default: all)")
    p.add_argument("--expires-at", help="ISO 8601 date or time after which it is refused")
    args = p.parse_args(argv)
    key = "sk-" + secrets.token_urlsafe(32)
    entry = {"name": args.name, "sha256": _sha256(key).hex()}
    if args.models:
        entry["models"] = args.models
    if args.expires_at:
        try:
            _instant(args.expires_at, "--expires-at")
        except ValueError as e:
            p.error(str(e))
        entry["expires_at"] = args.expires_at
    print(f"key: {key}")
    print(f"entry: {json.dumps(entry)}")

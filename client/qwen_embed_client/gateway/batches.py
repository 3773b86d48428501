"""OpenAI's Batch API for /v1/embeddings and /v1/rerank: files in, a batch that runs in the
background at the bulk priority level, files out.

POST /v1/files (multipart `file`, `purpose` "batch": JSONL, one request per line), GET
/v1/files/{id}, GET /v1/files/{id}/content, POST /v1/batches, GET /v1/batches/{id}, POST
/v1/batches/{id}/cancel, GET /v1/batches, with OpenAI's objects and statuses. Each line
({"custom_id", "method": "POST", "url", "body"}) is answered as its route answers the body,
at bulk priority, so interactive requests keep their latency while a batch runs. A line that
fails (bad JSON, a refused body) becomes a line of the error file; the batch goes on. Only
what would make the answers ambiguous fails a whole batch before any line runs, as OpenAI's
validation does: a custom_id on more than one line.

The lines run in shards (bulk.Shards, the CLI's bulk-job machinery): a shard's answers are
written to one file at once (bulk.write_atomic) when all its lines are done, so after a gateway
restart the batch resumes at the first missing shard and its output holds every line exactly
once. A shard that cannot reach the server (unavailable or overloaded, after the client's own
retries) is tried again after a pause; it is never turned into error lines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from ..bulk import Shards, write_atomic
from ..client import guarded, metered
from ..contract import is_utf8, parse_json
from . import openai
from .batch_store import FILE_PURPOSES, BatchStore, new_id
from .errors import MISSING, OVERLOADED, UNAVAILABLE, APIError, invalid, json_body
from .state import check_finite, dumps

log = logging.getLogger("qwen_embed.batches")
router = APIRouter(tags=["openai"])

ENDPOINTS = ("/v1/embeddings", "/v1/rerank")
COMPLETION_WINDOW_S = {"24h": 24 * 3600}
RETRY_PAUSE_S = 2.0  # before a shard the server could not take is tried again
MAX_ERRORS = 100  # validation errors a failed batch lists
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits


@dataclass(frozen=True)
class BatchSettings:
    """Limits of the Batch API (gateway flags --batch-*)."""

    max_file_bytes: int = 200 * 2**20
    max_lines: int = 50_000
    max_line_bytes: int = 8 * 2**20
    shard_lines: int = 64  # lines answered, and redone after a restart, together
    # Texts of a shard's lines sent at once (a bigger line goes alone). Few: the encoder cannot
    # stop a batch it has begun, so an interactive request waits for the bulk texts in flight
    # (perf/results/batch.md).
    texts_in_flight: int = 16


@dataclass
class _Lines:
    """A running batch's input: its lines' offsets, its shards, the first maybe unanswered."""

    offsets: list[tuple[int, int]]
    shards: Shards
    first: int = 0


class BatchRunner:
    """Runs the unfinished batches in the gateway's event loop, a shard at a time: each owner's
    (API key's) batches one after another, the owners' in turn, so one team's large batch does
    not hold back another's; a named key's batch goes as its requests and tokens per minute
    allow (keys.KeyRing.room_in_s), its lines taken from them. The store
    is opened on the Batch API's first use (or at start where it already exists, to resume),
    so a gateway that never sees a batch writes nothing."""

    def __init__(self, models, root: Path, settings: BatchSettings, metrics, keys):
        self.models, self.root, self.settings = models, Path(root), settings  # served.ServedModels
        self.metrics = metrics  # metrics.GatewayMetrics: the lines, their tokens, the batches
        self.keys = keys  # keys.KeyRing: the models and limits of a batch's key
        self._store: BatchStore | None = None
        self.wake = asyncio.Event()
        self._last_owner: str | None = None  # whose batch had the last step
        self._shards: dict[str, _Lines] = {}  # by batch id

    @property
    def store(self) -> BatchStore:
        if self._store is None:
            self._store = BatchStore(self.root)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()

    async def run_forever(self) -> None:
        while True:
            exists = self._store is not None or BatchStore.exists(self.root)
            batch, key, wait = self._next(self.store.oldest_unfinished() if exists else {})
            if batch is None:
                # nothing to run, or each key's limits spent for now: until one refills or a
                # batch comes or is cancelled
                try:
                    await asyncio.wait_for(self.wake.wait(), wait)
                except asyncio.TimeoutError:  # noqa: UP041 (Python 3.10's is not the builtin)
                    pass
                self.wake.clear()
                continue
            try:
                await self._step(batch, key)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a defect, not a bad line: the batch fails, others go on
                log.exception("batch %s failed", batch["id"])
                self._finish(batch, "failed", errors=[{"code": "server_error", "message": str(e)}])

    def _next(self, oldest: dict[str, tuple[dict, str]]) -> tuple[dict | None, str, float | None]:
        """The batch whose step comes next and the named key that made it: of each owner's
        oldest, the owners in turn after the last one served, passing over those whose named
        key's limits hold no room now; else (None, "", seconds until the first of those has
        room, None: no batch)."""
        waits = {owner: self._room_in_s(batch, key) for owner, (batch, key) in oldest.items()}
        owner = next_turn(list(oldest), waits, self._last_owner)
        if owner is None:
            return None, "", min(waits.values(), default=None)
        self._last_owner = owner
        return *oldest[owner], None

    def _room_in_s(self, batch: dict, key: str) -> float:
        """Seconds until the batch's `key` has room for a shard's lines (0: now); a batch past
        its lines, or cancelled, is finished at once."""
        counts = batch["request_counts"]
        if (
            batch["status"] != "in_progress"
            or counts["completed"] + counts["failed"] >= counts["total"]
        ):
            return 0.0
        return self.keys.room_in_s(key)

    async def _step(self, batch: dict, key: str) -> None:
        """The batch's next step: its validation, one shard of its lines (under its named
        `key`), or its end."""
        if batch["status"] == "validating":
            path = self.store.file_path(batch["input_file_id"])
            errors = await asyncio.to_thread(_repeated_ids, path)  # the loop serves requests
            if errors:
                self._finish(batch, "failed", errors)
                return
            batch.update(status="in_progress", in_progress_at=int(time.time()))
            self.store.save_batch(batch)
            return
        if batch["status"] == "in_progress" and not _expired(batch):
            if await self._next_shard(batch, key):
                return
            batch = self.store.batch(batch["id"], None)
            if batch["status"] == "in_progress":
                batch.update(status="finalizing", finalizing_at=int(time.time()))
                self.store.save_batch(batch)
        if batch["status"] == "cancelling":
            self._finish(batch, "cancelled")
        elif batch["status"] in ("in_progress", "finalizing"):
            self._finish(batch, "expired" if _expired(batch) else "completed")

    async def _next_shard(self, batch: dict, key: str) -> bool:
        """Its first shard without answers answered; False where none is left, or where the
        batch was cancelled or expired while the servers were away."""
        work = self.store.work_dir(batch["id"])
        if batch["id"] not in self._shards:  # the input's lines, read once per gateway
            offsets = _line_offsets(self.store.file_path(batch["input_file_id"]))
            shards = Shards(len(offsets), self.settings.shard_lines)
            self._shards[batch["id"]] = _Lines(offsets, shards)
            work.mkdir(parents=True, exist_ok=True)
            self._recount(batch["id"])  # a restart may have come between a shard and its count
        done = self._shards[batch["id"]]
        while done.first < len(done.shards) and _shard(work, done.first).exists():
            done.first += 1
        k = done.first
        if k == len(done.shards):
            return False
        lines = _read_lines(
            self.store.file_path(batch["input_file_id"]), done.offsets, done.shards.span(k)
        )
        answers = await self._answer_shard(batch, lines, key)
        if answers is None:  # cancelled or expired while the servers were away
            return False
        out = "".join(dumps(a).decode() + "\n" for a in answers)
        write_atomic(_shard(work, k), lambda tmp, out=out: tmp.write_text(out))
        failed = self._count(batch["id"], answers)
        self.metrics.batch_lines.labels("failed").inc(failed)
        self.metrics.batch_lines.labels("completed").inc(len(answers) - failed)
        return True

    def _recount(self, batch_id: str) -> None:
        """request_counts from the finished shards."""
        batch = self.store.batch(batch_id, None)
        batch["request_counts"].update(completed=0, failed=0)
        self.store.save_batch(batch)
        for path in self._shard_files(batch_id):
            self._count(batch_id, _read_answers(path))

    def _count(self, batch_id: str, answers: list[dict]) -> int:
        """The batch's request_counts with `answers` added; how many of them failed."""
        batch = self.store.batch(batch_id, None)
        failed = sum(1 for a in answers if not _succeeded(a))
        counts = batch["request_counts"]
        counts.update(completed=counts["completed"] + len(answers) - failed)
        counts.update(failed=counts["failed"] + failed)
        self.store.save_batch(batch)
        return failed

    def _shard_files(self, batch_id: str) -> list[Path]:
        return sorted(self.store.work_dir(batch_id).glob("shard-*.jsonl"))

    async def _answer_shard(self, batch: dict, lines: list[bytes], key: str) -> list[dict] | None:
        """Every line's answer, with at most `texts_in_flight` texts sent at once (a bigger
        line goes alone); a shard the server cannot take now is tried again, until the batch
        is cancelled or expires (None)."""
        budget, in_flight = self.settings.texts_in_flight, 0
        room = asyncio.Condition()
        parsed = [_parse(line, batch["endpoint"]) for line in lines]

        async def one(request: dict | InvalidLine) -> dict:
            nonlocal in_flight
            if isinstance(request, InvalidLine):
                error = {"code": "invalid_request", "message": request.message}
                return _output_line(request.custom_id, None, error)
            size = _texts_in(request["body"])
            async with room:
                await room.wait_for(lambda: in_flight == 0 or in_flight + size <= budget)
                in_flight += size
            try:
                return await self._ask(batch["endpoint"], request, key)
            finally:
                async with room:
                    in_flight -= size
                    room.notify_all()

        while True:
            try:
                return await asyncio.gather(*(one(request) for request in parsed))
            except APIError as e:  # unavailable or overloaded: the batch waits, loses nothing
                log.warning("batch %s: %s; retrying its shard", batch["id"], e.message)
                await asyncio.sleep(RETRY_PAUSE_S)
                current = self.store.batch(batch["id"], None)
                if current["status"] != "in_progress" or _expired(current):
                    return None

    async def _ask(self, endpoint: str, request: dict, key: str) -> dict:
        """The route's answer to the line's body, at bulk priority, by the model it names,
        if the batch's named `key` may use that model (as it may now)."""
        body = {**request["body"], "priority": "bulk"}
        with metered() as usage, guarded(self.keys.guard(key)):
            try:
                gw = await self.models.pick(body)
                if endpoint == "/v1/embeddings":
                    answer, status = await openai.embeddings_body(gw, body), 200
                    check_finite(answer)
                else:
                    answer, status = await openai.rerank_response(gw, body), 200
            except APIError as e:
                if e.kind in (UNAVAILABLE, OVERLOADED):
                    raise
                rendered = openai.error_response(e)
                answer, status = json.loads(rendered.body), rendered.status_code
            finally:
                self.metrics.count_tokens(usage, "batch", key)
                self.keys.spend(key, usage)
        return _output_line(request["custom_id"], (status, answer))

    def _finish(self, batch: dict, status: str, errors: list | None = None) -> None:
        """Gather the finished shards into the output and error files; the final status."""
        self._shards.pop(batch["id"], None)
        temps = {"output": _temp_file(self.store.root), "error": _temp_file(self.store.root)}
        written = {"output": 0, "error": 0}
        with open(temps["output"], "w") as ok, open(temps["error"], "w") as failed:
            for path in self._shard_files(batch["id"]):  # one shard in memory at a time
                for answer in _read_answers(path):
                    name = "output" if _succeeded(answer) else "error"
                    (ok if name == "output" else failed).write(dumps(answer).decode() + "\n")
                    written[name] += 1
        owner = self.store.owner_of(batch["id"])
        for name, tmp in temps.items():
            if written[name]:
                filename = f"{batch['id']}_{name}.jsonl"
                batch[f"{name}_file_id"] = self.store.add_file(
                    owner, filename, "batch_output", tmp
                )["id"]
            else:
                tmp.unlink()
        now = int(time.time())
        batch.update(status=status, **{f"{status}_at": now})
        if errors:
            batch["errors"] = {"object": "list", "data": errors}
        self.store.save_batch(batch)
        shutil.rmtree(self.store.work_dir(batch["id"]), ignore_errors=True)
        self.metrics.batches.labels(status).inc()


def next_turn(owners: list[str], waits: dict[str, float], last: str | None) -> str | None:
    """The owner whose batch goes next: the first after `last` in `owners` (their order: their
    oldest batches') whose wait is 0; None where each waits."""
    start = owners.index(last) + 1 if last in owners else 0
    turn = owners[start:] + owners[:start]
    return next((owner for owner in turn if waits[owner] <= 0), None)


def _shard(work: Path, k: int) -> Path:
    return work / f"shard-{k:05d}.jsonl"


def _repeated_ids(path: Path) -> list[dict]:
    """OpenAI's validation errors for the lines whose custom_id an earlier line holds (the
    first MAX_ERRORS of them); lines that are not requests are left to the error file."""
    first: dict[str, int] = {}
    errors = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                request = parse_json(line) if line.strip() else None
            except ValueError:
                continue
            custom_id = request.get("custom_id") if isinstance(request, dict) else None
            if not isinstance(custom_id, str):
                continue
            if custom_id not in first:
                first[custom_id] = number
            elif len(errors) < MAX_ERRORS:
                message = (
                    f"custom_id {custom_id!r} of line {number} is line {first[custom_id]}'s too: "
                    "each request of a batch needs its own"
                )
                error = {"code": "duplicate_custom_id", "message": message, "line": number}
                errors.append(error | {"param": "custom_id"})
    return errors


def _metadata(metadata) -> dict | None:
    """A batch's `metadata` as OpenAI limits it: at most 16 pairs of strings, keys of at most
    64 characters, values of at most 512, each valid UTF-8 (the batch is listed and read back
    as JSON)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise invalid("'metadata' must map strings to strings", "metadata")
    if len(metadata) > METADATA_PAIRS:
        raise invalid(
            f"'metadata' holds {len(metadata)} pairs, more than {METADATA_PAIRS}", "metadata"
        )
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
            raise invalid(
                f"'metadata' keys may hold {METADATA_KEY_CHARS} characters and values "
                f"{METADATA_VALUE_CHARS}: the pair of {key[:METADATA_KEY_CHARS]!r} is longer",
                "metadata",
            )
        if not (is_utf8(key) and is_utf8(value)):
            raise invalid("'metadata' must hold valid UTF-8 (no lone surrogate)", "metadata")
    return metadata


@dataclass(frozen=True)
class InvalidLine:
    custom_id: str | None
    message: str


def _parse(line: bytes, endpoint: str) -> dict | InvalidLine:
    """A line's request, or why it is none."""
    try:
        request = parse_json(line)
    except ValueError as e:
        return InvalidLine(None, f"not JSON: {e}")
    if not isinstance(request, dict):
        return InvalidLine(None, "a line must be a JSON object")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not is_utf8(custom_id):
        return InvalidLine(None, "'custom_id' must be a string of valid UTF-8")
    if request.get("method") != "POST":
        return InvalidLine(custom_id, "'method' must be POST")
    if request.get("url") != endpoint:
        return InvalidLine(custom_id, f"'url' must be this batch's endpoint, {endpoint}")
    if not isinstance(request.get("body"), dict):
        return InvalidLine(custom_id, "'body' must be a JSON object")
    return request


def _output_line(custom_id: str | None, response: tuple[int, dict] | None, error=None) -> dict:
    """One output line: the route's (status, body), or the line's own error."""
    request_id = new_id("batch_req_")
    if response is not None:
        status, body = response
        response = {"status_code": status, "request_id": request_id, "body": body}
    return {"id": request_id, "custom_id": custom_id, "response": response, "error": error}


def _texts_in(body: dict) -> int:
    """The texts a line's body sends (its share of texts_in_flight)."""
    items = body.get("input", body.get("documents"))
    return len(items) if isinstance(items, list) and items else 1


def _read_answers(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _succeeded(answer: dict) -> bool:
    return answer["response"] is not None and answer["response"]["status_code"] == 200


def _expired(batch: dict) -> bool:
    return time.time() > batch["expires_at"]


def _line_offsets(path: Path) -> list[tuple[int, int]]:
    """(start, length) of each non-blank line."""
    offsets, start = [], 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                offsets.append((start, len(line)))
            start += len(line)
    return offsets


def _read_lines(path: Path, offsets: list[tuple[int, int]], span: range) -> list[bytes]:
    with open(path, "rb") as f:
        out = []
        for i in span:
            f.seek(offsets[i][0])
            out.append(f.read(offsets[i][1]))
        return out


def _temp_file(root: Path) -> Path:
    with tempfile.NamedTemporaryFile(dir=root, delete=False, suffix=".partial") as f:
        return Path(f.name)


def _state(request: Request) -> tuple[BatchRunner, str]:
    """(the runner, the caller's owner id), once the caller's key is checked."""
    runner = request.app.state.batches
    if runner is None:
        raise APIError(MISSING, "the Batch API is off on this gateway (no --batch-dir)")
    return runner, request.app.state.keys.owner(request)


@router.post("/v1/files")
async def upload_file(request: Request):
    runner, owner = _state(request)
    settings = runner.settings
    form = await request.form()
    purpose, upload = form.get("purpose"), form.get("file")
    if purpose not in FILE_PURPOSES:
        raise invalid(f"'purpose' must be one of {list(FILE_PURPOSES)}, got {purpose!r}", "purpose")
    if upload is None or isinstance(upload, str):
        raise invalid("'file' must be an uploaded file", "file")
    tmp = _temp_file(runner.store.root)
    try:
        size, lines = 0, 0
        with open(tmp, "wb") as out:
            pending = b""
            while chunk := await upload.read(2**20):
                size += len(chunk)
                if size > settings.max_file_bytes:
                    raise invalid(
                        f"the file is larger than the limit of {settings.max_file_bytes} bytes",
                        "file",
                    )
                out.write(chunk)
                pending += chunk
                *complete, pending = pending.split(b"\n")
                lines += _count_lines(complete, lines, settings)
                if len(pending) > settings.max_line_bytes:
                    raise invalid(_line_too_long(lines + 1, settings), "file")
            lines += _count_lines([pending], lines, settings)
        if lines == 0:
            raise invalid("the file holds no request lines", "file")
        return runner.store.add_file(owner, upload.filename or "input.jsonl", purpose, tmp)
    finally:
        tmp.unlink(missing_ok=True)


def _count_lines(lines: list[bytes], before: int, settings: BatchSettings) -> int:
    count = 0
    for line in lines:
        if len(line) > settings.max_line_bytes:
            raise invalid(_line_too_long(before + count + 1, settings), "file")
        if line.strip():
            count += 1
            if before + count > settings.max_lines:
                raise invalid(f"the file holds more than {settings.max_lines} lines", "file")
    return count


def _line_too_long(number: int, settings: BatchSettings) -> str:
    return f"line {number} is longer than the limit of {settings.max_line_bytes} bytes"


def _owned(found: dict | None, what: str, object_id: str) -> dict:
    """The caller's File or Batch object, else 404 (another key's is not found either)."""
    if found is None:
        raise APIError(MISSING, f"No such {what} object: {object_id}", f"{what.lower()}_id")
    return found


def _file(runner: BatchRunner, owner: str, file_id: str) -> dict:
    found = runner.store.file(file_id, owner) if is_utf8(file_id) else None  # sqlite's text
    return _owned(found, "File", file_id)


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str):
    runner, owner = _state(request)
    return _file(runner, owner, file_id)


@router.get("/v1/files")
async def list_files(
    request: Request, purpose: str | None = None, limit: str = "10000", after: str | None = None
):
    runner, owner = _state(request)
    return _listed(*runner.store.files(owner, purpose, _limit(limit, 10_000), after))


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str):
    """A file and its bytes gone; not the input of a batch still running (which reads it)."""
    runner, owner = _state(request)
    _file(runner, owner, file_id)
    running = [b for b in runner.store.unfinished() if b["input_file_id"] == file_id]
    if running:
        raise invalid(
            f"file {file_id} is the input of batch {running[0]['id']}, which is "
            f"{running[0]['status']}: delete it once the batch has ended (or cancel it)",
            "file_id",
        )
    runner.store.delete_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str):
    runner, owner = _state(request)
    found = _file(runner, owner, file_id)
    return FileResponse(
        runner.store.file_path(file_id), media_type="application/jsonl", filename=found["filename"]
    )


@router.post("/v1/batches")
async def create_batch(request: Request):
    runner, owner = _state(request)
    body = await json_body(request)
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise invalid(f"'endpoint' must be one of {list(ENDPOINTS)}, got {endpoint!r}", "endpoint")
    window = body.get("completion_window")
    if not isinstance(window, str) or window not in COMPLETION_WINDOW_S:
        raise invalid(
            f"'completion_window' must be one of {list(COMPLETION_WINDOW_S)}", "completion_window"
        )
    metadata = _metadata(body.get("metadata"))
    source_id = body.get("input_file_id")
    if not isinstance(source_id, str):
        raise invalid(
            "'input_file_id' must be a string, the id of an uploaded file", "input_file_id"
        )
    source = _file(runner, owner, source_id)
    if source["purpose"] != "batch":
        raise invalid(
            "'input_file_id' must name a file uploaded with purpose 'batch'", "input_file_id"
        )
    total = len(_line_offsets(runner.store.file_path(source["id"])))
    now = int(time.time())
    batch = {
        "id": new_id("batch_"),
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": source["id"],
        "completion_window": window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + COMPLETION_WINDOW_S[window],
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": total, "completed": 0, "failed": 0},
        "metadata": metadata,
    }
    runner.store.add_batch(owner, batch, request.app.state.keys.key_name(request.scope))
    runner.wake.set()
    return batch


def _batch(runner: BatchRunner, owner: str, batch_id: str) -> dict:
    return _owned(runner.store.batch(batch_id, owner), "Batch", batch_id)


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str):
    runner, owner = _state(request)
    return _batch(runner, owner, batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str):
    runner, owner = _state(request)
    batch = _batch(runner, owner, batch_id)
    if batch["status"] in ("validating", "in_progress", "finalizing"):
        batch.update(status="cancelling", cancelling_at=int(time.time()))
        runner.store.save_batch(batch)
        runner.wake.set()
    elif batch["status"] not in ("cancelling", "cancelled"):
        raise invalid(f"a batch that is {batch['status']} cannot be cancelled", "batch_id")
    return batch


@router.get("/v1/batches")
async def list_batches(request: Request, limit: str = "20", after: str | None = None):
    runner, owner = _state(request)
    return _listed(*runner.store.batches(owner, _limit(limit, 100), after))


def _limit(text: str, most: int) -> int:
    """A list's `limit` query parameter, read here, not by FastAPI: its refusal would not be
    in OpenAI's error shape."""
    limit = int(text) if text.isdigit() and len(text) <= len(str(most)) else 0
    if not 1 <= limit <= most:
        raise invalid(f"'limit' must be in 1..{most}", "limit")
    return limit


def _listed(page: list[dict], more: bool) -> dict:
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": more,
    }

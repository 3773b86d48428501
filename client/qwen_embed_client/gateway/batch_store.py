"""The Batch API's state: files on disk and their records and the batches in SQLite, under one
directory (the gateway's --batch-dir), so that a batch outlives the gateway process.

    DIR/state.sqlite          files and batches (each batch its OpenAI object as JSON)
    DIR/files/<file id>       uploaded inputs, and the output and error files of batches
    DIR/work/<batch id>/      a running batch's finished shards (bulk.Shards), one JSONL each

Every record carries its owner (the API key's digest, or "" with keys off): another key sees
neither its files nor its batches.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import time
import uuid
from pathlib import Path

FILE_PURPOSES = ("batch",)
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class BatchStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        for sub in ("files", "work"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # One connection, used from the event loop's thread only; autocommit.
        self.db = sqlite3.connect(
            self.root / "state.sqlite", isolation_level=None, check_same_thread=False
        )
        self.db.executescript(
            """
            CREATE TABLE IF NOT EXISTS files (
                id TEXT PRIMARY KEY, owner TEXT NOT NULL, object TEXT NOT NULL);
            CREATE TABLE IF NOT EXISTS batches (
                id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at INTEGER NOT NULL,
                status TEXT NOT NULL, object TEXT NOT NULL, key TEXT NOT NULL DEFAULT '');
            """
        )
        # the named API key whose models its lines may use (keys.py), added to a directory
        # made before it
        columns = [row[1] for row in self.db.execute("PRAGMA table_info(batches)")]
        if "key" not in columns:
            self.db.execute("ALTER TABLE batches ADD COLUMN key TEXT NOT NULL DEFAULT ''")

    @staticmethod
    def exists(root: Path) -> bool:
        return (Path(root) / "state.sqlite").is_file()

    def close(self) -> None:
        self.db.close()

    # files

    def file_path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    def add_file(self, owner: str, filename: str, purpose: str, source: Path) -> dict:
        """Register `source` (moved into the store) as a file object."""
        file_id = new_id("file-")
        shutil.move(source, self.file_path(file_id))
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": self.file_path(file_id).stat().st_size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }
        self.db.execute("INSERT INTO files VALUES (?, ?, ?)", (file_id, owner, json.dumps(obj)))
        return obj

    def file(self, file_id: str, owner: str) -> dict | None:
        row = self.db.execute(
            "SELECT object FROM files WHERE id = ? AND owner = ?", (file_id, owner)
        ).fetchone()
        return json.loads(row[0]) if row else None

    def files(
        self, owner: str, purpose: str | None, limit: int, after: str | None
    ) -> tuple[list[dict], bool]:
        """The owner's files (of `purpose`, where given), newest first; (page, more)."""
        if purpose is None:
            return self._page("files", owner, limit, after)
        return self._page(
            "files", owner, limit, after, ("json_extract(object, '$.purpose')", purpose)
        )

    def delete_file(self, file_id: str) -> None:
        self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.file_path(file_id).unlink(missing_ok=True)

    def _page(self, table: str, owner: str, limit: int, after: str | None, equal=None):
        """A page of `table`'s objects of `owner`, newest first, after the object `after`;
        `equal`: (an SQL expression, the value it must equal)."""
        query, args = f"SELECT object FROM {table} WHERE owner = ?", [owner]
        if equal is not None:
            query += f" AND {equal[0]} = ?"
            args.append(equal[1])
        if after is not None:
            query += f" AND rowid < (SELECT rowid FROM {table} WHERE id = ?)"
            args.append(after)
        rows = self.db.execute(query + " ORDER BY rowid DESC LIMIT ?", [*args, limit + 1])
        found = [json.loads(r[0]) for r in rows]
        return found[:limit], len(found) > limit

    # batches

    def add_batch(self, owner: str, obj: dict, key: str = "") -> None:
        self.db.execute(
            "INSERT INTO batches (id, owner, created_at, status, object, key) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (obj["id"], owner, obj["created_at"], obj["status"], json.dumps(obj), key),
        )

    def save_batch(self, obj: dict) -> None:
        self.db.execute(
            "UPDATE batches SET status = ?, object = ? WHERE id = ?",
            (obj["status"], json.dumps(obj), obj["id"]),
        )

    def batch(self, batch_id: str, owner: str | None) -> dict | None:
        """A batch by id; `owner` None: whoever owns it (the runner)."""
        query, args = "SELECT object FROM batches WHERE id = ?", [batch_id]
        if owner is not None:
            query, args = query + " AND owner = ?", [batch_id, owner]
        row = self.db.execute(query, args).fetchone()
        return json.loads(row[0]) if row else None

    def owner_of(self, batch_id: str) -> str:
        return self.db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()[0]

    def key_of(self, batch_id: str) -> str:
        """The named API key that made the batch ("": a plain key or none)."""
        return self.db.execute("SELECT key FROM batches WHERE id = ?", (batch_id,)).fetchone()[0]

    def batches(self, owner: str, limit: int, after: str | None) -> tuple[list[dict], bool]:
        """The owner's batches, newest first, after the batch `after`; (page, more)."""
        return self._page("batches", owner, limit, after)

    def oldest_unfinished(self) -> dict[str, tuple[dict, str]]:
        """Each owner's oldest batch still to run (after a restart, the one that was running)
        and the named key that made it, the owners in the order of those batches."""
        oldest = {}
        for owner, key, obj in self._unfinished("owner, key, object"):
            if owner not in oldest:
                oldest[owner] = (json.loads(obj), key)
        return oldest

    def unfinished(self) -> list[dict]:
        """The batches still to run, oldest first."""
        return [json.loads(obj) for (obj,) in self._unfinished("object")]

    def _unfinished(self, columns: str):
        marks = ", ".join("?" * len(UNFINISHED))
        return self.db.execute(
            f"SELECT {columns} FROM batches WHERE status IN ({marks}) ORDER BY rowid", UNFINISHED
        )

    def work_dir(self, batch_id: str) -> Path:
        return self.root / "work" / batch_id

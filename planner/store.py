"""The results store: plans and validation reports in one SQLite file.

Each row keeps the full JSON of what was stored, plus the columns a query filters on. Each
thread keeps its own connection (sqlite3 connections are not shared across threads; closing the
last connection of a WAL database checkpoints it, which would cost milliseconds per request); WAL journaling and a
busy timeout let concurrent writers queue instead of failing, and each insert is one
transaction, so a crash never leaves half a row. synchronous=NORMAL: a committed row survives
any crash or restart of the process; an OS crash or power cut may drop the last few commits.

The file: the `path` given, else $BERTH_STORE_PATH, else $XDG_DATA_HOME/berth/berth.sqlite
(~/.local/share/berth/berth.sqlite).

Plan answers are stored once per content: `answers` holds each distinct answer text under its
SHA-256, `plan_refs` one small row per id handed out (a repeated question costs a pointer, not
another copy). `max_plans`, `max_bytes` and `retention_days` bound the store at every insert, in
the insert's own transaction: the oldest ids go, with the answers no id points at any more. The
totals they are checked against (`totals`: answer bytes, ids) are kept by triggers in the same
transactions, so the check costs two indexed reads and holds across processes (several server
workers on one file).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from berth.specs.tree import ValidationReport

BUSY_TIMEOUT_S = 30.0
SCHEMA = """
CREATE TABLE IF NOT EXISTS answers (
    hash TEXT PRIMARY KEY,
    body TEXT NOT NULL,
    size INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS plan_refs (
    id TEXT PRIMARY KEY,
    created TEXT NOT NULL,
    kind TEXT NOT NULL,
    answer TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS plan_refs_created ON plan_refs (created);
CREATE INDEX IF NOT EXISTS plan_refs_answer ON plan_refs (answer);
CREATE TABLE IF NOT EXISTS plans (
    id TEXT PRIMARY KEY,
    created TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS validations (
    id TEXT PRIMARY KEY,
    created TEXT NOT NULL,
    status TEXT NOT NULL,
    mode TEXT NOT NULL,
    model TEXT NOT NULL,
    device TEXT NOT NULL,
    layout TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS validations_created ON validations (created);
CREATE TABLE IF NOT EXISTS totals (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TRIGGER IF NOT EXISTS answers_added AFTER INSERT ON answers BEGIN
    UPDATE totals SET value = value + NEW.size WHERE name = 'answer_bytes';
END;
CREATE TRIGGER IF NOT EXISTS answers_dropped AFTER DELETE ON answers BEGIN
    UPDATE totals SET value = value - OLD.size WHERE name = 'answer_bytes';
END;
CREATE TRIGGER IF NOT EXISTS refs_added AFTER INSERT ON plan_refs BEGIN
    UPDATE totals SET value = value + 1 WHERE name = 'plan_refs';
END;
CREATE TRIGGER IF NOT EXISTS refs_dropped AFTER DELETE ON plan_refs BEGIN
    UPDATE totals SET value = value - 1 WHERE name = 'plan_refs';
END;
CREATE TABLE IF NOT EXISTS validation_jobs (
    id TEXT PRIMARY KEY,
    created TEXT NOT NULL,
    plan_id TEXT NOT NULL,
    status TEXT NOT NULL,
    report_id TEXT,
    message TEXT,
    request TEXT NOT NULL
);
"""
JOB_STATES = ("queued", "running", "done", "failed")


def default_path() -> Path:
    if os.environ.get("BERTH_STORE_PATH"):
        return Path(os.environ["BERTH_STORE_PATH"])
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "berth" / "berth.sqlite"


SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


def file_header(path: Path) -> bytes:
    """The first bytes of a file, as many as an SQLite header (raises OSError)."""
    with path.open("rb") as f:
        return f.read(len(SQLITE_HEADER))


def read_validations(path: str | Path | None = None, status: str | None = None) -> list[ValidationReport]:
    """The validation reports of an existing results store, opened read-only: a missing file, a
    file that is not SQLite or a store without reports is a BerthError naming the `store`
    argument (nothing is created)."""
    from berth.specs.errors import BerthError

    where = Path(path) if path else default_path()
    if not where.is_file():
        raise BerthError("store", str(where), "no such results store (`berth validate` writes one)")
    try:
        header = file_header(where)
    except OSError as err:
        raise BerthError("store", str(where), f"cannot read: {err.strerror}") from None
    if header != SQLITE_HEADER:
        raise BerthError("store", str(where), "not an SQLite results store")
    try:
        db = sqlite3.connect(f"{where.resolve().as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S)
        try:
            query, args = "SELECT body FROM validations", []
            if status:
                query += " WHERE status = ?"
                args.append(status)
            rows = db.execute(query + " ORDER BY created", args).fetchall()
        finally:
            db.close()
    except sqlite3.Error as err:
        raise BerthError("store", str(where), f"not a berth results store: {err}") from None
    try:
        return [ValidationReport.model_validate_json(r[0]) for r in rows]
    except ValueError as err:
        raise BerthError("store", str(where), f"holds a report berth cannot read: {str(err).splitlines()[0]}") from None


class Store:
    def __init__(
        self,
        path: str | Path | None = None,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
        max_plans: int | None = None,
        max_bytes: int | None = None,
        retention_days: float | None = None,
    ):
        self.path = Path(path) if path else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.busy_timeout_s = busy_timeout_s
        self.max_plans, self.max_bytes, self.retention_days = max_plans, max_bytes, retention_days
        self._local = threading.local()
        with self._connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            # one transaction: a store of an older berth gets its totals from the rows it holds
            db.executescript(
                "BEGIN IMMEDIATE;"
                + SCHEMA
                + "INSERT OR IGNORE INTO totals SELECT 'answer_bytes', COALESCE(SUM(size), 0) FROM answers;"
                "INSERT OR IGNORE INTO totals SELECT 'plan_refs', COUNT(*) FROM plan_refs;"
                "COMMIT;"
            )

    def _connect(self) -> sqlite3.Connection:
        """This thread's connection (a `with` block on it is one transaction)."""
        db = getattr(self._local, "db", None)
        if db is not None:
            return db
        db = sqlite3.connect(self.path, timeout=self.busy_timeout_s)
        self._local.db = db
        db.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
        # WAL + NORMAL: a commit survives the process (and a crash or restart of it); only an OS
        # crash or power cut can drop the last commits, never corrupt the file.
        db.execute("PRAGMA synchronous = NORMAL")
        return db

    def close(self) -> None:
        """Close this thread's connection (others close when their thread ends)."""
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    def add_validation(self, report: ValidationReport) -> str:
        plan = report.plan
        with self._connect() as db:
            db.execute(
                "INSERT INTO validations VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    report.id,
                    report.created,
                    report.status,
                    report.mode,
                    plan.model.name,
                    plan.cluster.device.name,
                    plan.layout.short(),
                    report.model_dump_json(),
                ),
            )
        return report.id

    def get_validation(self, report_id: str) -> ValidationReport | None:
        with self._connect() as db:
            row = db.execute("SELECT body FROM validations WHERE id = ?", (report_id,)).fetchone()
        return ValidationReport.model_validate_json(row[0]) if row else None

    def validations(self, limit: int | None = None, status: str | None = None) -> list[ValidationReport]:
        query = "SELECT body FROM validations"
        args: list[str | int] = []
        if status:
            query += " WHERE status = ?"
            args.append(status)
        query += " ORDER BY created"
        if limit:
            query += " LIMIT ?"
            args.append(limit)
        with self._connect() as db:
            rows = db.execute(query, args).fetchall()
        return [ValidationReport.model_validate_json(r[0]) for r in rows]

    def add_answer(self, plan_id: str, created: str, kind: str, answer: str) -> str:
        """Store an answer (JSON object text without id and created) under a new id; the text is
        stored once however many ids point at it."""
        self.add_answers([(plan_id, created, kind, answer)])
        return plan_id

    def add_answers(self, items: list[tuple[str, str, str, str]]) -> None:
        """Several (id, created, kind, answer) in one transaction, which also keeps the store
        within its limits (an answer larger than `max_bytes` on its own is refused: BerthError)."""
        from berth.specs.errors import BerthError

        for plan_id, _, _, answer in items:
            if self.max_bytes is not None and len(answer) > self.max_bytes:
                raise BerthError("answer", plan_id, f"{len(answer):,} bytes, over the store's {self.max_bytes:,}")
        with self._connect() as db:
            for plan_id, created, kind, answer in items:
                digest = hashlib.sha256(answer.encode()).hexdigest()
                db.execute("INSERT OR IGNORE INTO answers VALUES (?, ?, ?)", (digest, answer, len(answer)))
                db.execute("INSERT INTO plan_refs VALUES (?, ?, ?, ?)", (plan_id, created, kind, digest))
            self._prune(db)

    def _total(self, db: sqlite3.Connection, name: str) -> int:
        return int(db.execute("SELECT value FROM totals WHERE name = ?", (name,)).fetchone()[0])

    def _drop_refs(self, db: sqlite3.Connection, where: str, args: tuple) -> int:
        """Delete the plan_refs matching `where`, and the answers no id points at any more."""
        hashes = {h for (h,) in db.execute(f"SELECT answer FROM plan_refs WHERE {where}", args)}
        dropped = db.execute(f"DELETE FROM plan_refs WHERE {where}", args).rowcount
        for digest in hashes:
            db.execute(
                "DELETE FROM answers WHERE hash = ? AND NOT EXISTS (SELECT 1 FROM plan_refs WHERE answer = ?)",
                (digest, digest),
            )
        return dropped

    def _prune(self, db: sqlite3.Connection) -> int:
        """Within the caller's transaction: drop the oldest ids past the limits (and the answers
        nothing points at any more); the number of ids dropped."""
        dropped = 0
        if self.retention_days is not None:
            cutoff = (datetime.now(UTC) - timedelta(days=self.retention_days)).isoformat()
            dropped += self._drop_refs(db, "created < ?", (cutoff,))
        if self.max_plans is not None:
            over = self._total(db, "plan_refs") - self.max_plans
            if over > 0:
                dropped += self._drop_refs(db, "id IN (SELECT id FROM plan_refs ORDER BY created LIMIT ?)", (over,))
        while self.max_bytes is not None and self._total(db, "answer_bytes") > self.max_bytes:
            row = db.execute("SELECT answer FROM plan_refs ORDER BY created LIMIT 1").fetchone()
            if row is None:
                break
            dropped += self._drop_refs(db, "answer = ?", (row[0],))  # the oldest answer, with all its ids
        return dropped

    def prune(self) -> int:
        """Drop ids past the retention limits (oldest first) and answers nothing points at; the
        number of ids dropped (every insert does this too)."""
        with self._connect() as db:
            dropped = self._prune(db)
            db.execute("DELETE FROM answers WHERE hash NOT IN (SELECT answer FROM plan_refs)")
        return dropped

    def stored_bytes(self) -> int:
        with self._connect() as db:
            return self._total(db, "answer_bytes")

    def get_plan(self, plan_id: str) -> dict[str, Any] | None:
        with self._connect() as db:
            row = db.execute(
                "SELECT r.created, r.kind, a.body FROM plan_refs r JOIN answers a ON a.hash = r.answer WHERE r.id = ?",
                (plan_id,),
            ).fetchone()
            if row is not None:
                created, kind, answer = row
                head = json.dumps({"id": plan_id, "created": created})[:-1]
                return {"kind": kind, "response": json.loads(head + ("," + answer[1:] if answer != "{}" else "}"))}
            row = db.execute("SELECT body FROM plans WHERE id = ?", (plan_id,)).fetchone()  # stored before answers
        return json.loads(row[0]) if row else None

    def add_job(self, job_id: str, created: str, plan_id: str, request: dict[str, Any]) -> None:
        with self._connect() as db:
            db.execute(
                "INSERT INTO validation_jobs VALUES (?, ?, ?, 'queued', NULL, NULL, ?)",
                (job_id, created, plan_id, json.dumps(request)),
            )

    def update_job(self, job_id: str, status: str, report_id: str | None = None, message: str | None = None) -> None:
        assert status in JOB_STATES
        with self._connect() as db:
            db.execute(
                "UPDATE validation_jobs SET status = ?, report_id = COALESCE(?, report_id), "
                "message = COALESCE(?, message) WHERE id = ?",
                (status, report_id, message, job_id),
            )

    def get_job(self, job_id: str) -> dict[str, Any] | None:
        with self._connect() as db:
            row = db.execute(
                "SELECT id, created, plan_id, status, report_id, message, request FROM validation_jobs WHERE id = ?",
                (job_id,),
            ).fetchone()
        if row is None:
            return None
        keys = ("id", "created", "plan_id", "status", "report_id", "message", "request")
        job = dict(zip(keys, row, strict=True))
        job["request"] = json.loads(job["request"])
        return job

    def fail_unfinished_jobs(self, message: str) -> int:
        """Jobs left queued or running by a server that stopped will never finish: mark them."""
        with self._connect() as db:
            cur = db.execute(
                "UPDATE validation_jobs SET status = 'failed', message = ? WHERE status IN ('queued', 'running')",
                (message,),
            )
            return cur.rowcount

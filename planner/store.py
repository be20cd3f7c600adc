"""The results store: plans and validation reports in one SQLite file.

Each row keeps the full JSON of what was stored, plus the columns a query filters on. Every
operation opens its own connection (safe across threads and processes); WAL journaling and a
busy timeout let concurrent writers queue instead of failing, and each insert is one
transaction, so a crash never leaves half a row.

The file: the `path` given, else $BERTH_STORE_PATH, else $XDG_DATA_HOME/berth/berth.sqlite
(~/.local/share/berth/berth.sqlite).
"""

from __future__ import annotations

import json
import os
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

from planner.specs import ValidationReport

BUSY_TIMEOUT_S = 30.0
SCHEMA = """
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
"""


def default_path() -> Path:
    if os.environ.get("BERTH_STORE_PATH"):
        return Path(os.environ["BERTH_STORE_PATH"])
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "berth" / "berth.sqlite"


class Store:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with closing(self._connect()) as db, db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S)
        db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        return db

    def add_validation(self, report: ValidationReport) -> str:
        plan = report.plan
        with closing(self._connect()) as db, db:
            db.execute("INSERT INTO validations VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (report.id, report.created, report.status, report.mode, plan.model.name,
                        plan.cluster.device.name, plan.layout.short(), report.model_dump_json()))
        return report.id

    def get_validation(self, report_id: str) -> ValidationReport | None:
        with closing(self._connect()) as db:
            row = db.execute("SELECT body FROM validations WHERE id = ?", (report_id,)).fetchone()
        return ValidationReport.model_validate_json(row[0]) if row else None

    def validations(self, limit: int | None = None, status: str | None = None) -> list[ValidationReport]:
        query, args = "SELECT body FROM validations", []
        if status:
            query += " WHERE status = ?"
            args.append(status)
        query += " ORDER BY created"
        if limit:
            query += " LIMIT ?"
            args.append(limit)
        with closing(self._connect()) as db:
            rows = db.execute(query, args).fetchall()
        return [ValidationReport.model_validate_json(r[0]) for r in rows]

    def add_plan(self, plan_id: str, created: str, body: dict[str, Any]) -> str:
        with closing(self._connect()) as db, db:
            db.execute("INSERT INTO plans VALUES (?, ?, ?)", (plan_id, created, json.dumps(body)))
        return plan_id

    def get_plan(self, plan_id: str) -> dict[str, Any] | None:
        with closing(self._connect()) as db:
            row = db.execute("SELECT body FROM plans WHERE id = ?", (plan_id,)).fetchone()
        return json.loads(row[0]) if row else None

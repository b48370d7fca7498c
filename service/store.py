"""The job store: one SQLite file under the service's data folder, shared by the server and its
worker processes (WAL mode, so readers never wait for the one writer).

A job's life: `queued` (accepted, waiting for a worker) -> `running` -> `done` | `failed`.
Each (re)queue bumps `attempt`; a worker writes only while the attempt it was given is the
job's current one, so a worker orphaned by a crash can never overwrite a newer attempt.

While it runs, a job's `progress` is the worker's last `autoshard.progress.Progress` (stage,
what it does, a solve's objective and bound) as JSON; its `elapsed_s` is shown as the seconds
since the job started (until it finished).

A done job's HTML reports (`autoshard html`'s page, per list of tensors drawn) are kept in
`reports`: the job writes the plain one with its plan, a page with tensors is written the first
time it is asked for; a report is never built twice.

Why a failure has a `cause`: an `input` failure (an infeasible memory budget, say) is a
property of the request, so an identical request gets the same answer back; an `interrupted`
or `internal` failure (the server stopped mid-solve, a worker died) says nothing about the
request, so an identical request queues the job again under the same id.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard.document.plan_document import PlanDocument

STATUSES = ("queued", "running", "done", "failed")
CAUSES = ("input", "interrupted", "internal")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 1,
    model_sha256 TEXT NOT NULL,
    model_path TEXT NOT NULL,
    options TEXT NOT NULL,
    progress TEXT,
    error TEXT,
    cause TEXT,
    plan TEXT,
    spmd TEXT,
    spmd_error TEXT,
    report TEXT,
    created REAL NOT NULL,
    started REAL,
    finished REAL
);
CREATE TABLE IF NOT EXISTS reports (
    job_id TEXT NOT NULL,
    tensors TEXT NOT NULL,
    html TEXT NOT NULL,
    PRIMARY KEY (job_id, tensors)
)
"""


def _tensors_key(tensors: Sequence[str]) -> str:
    """A report's key: the tensors it draws, in the order asked (the page draws them so)."""
    return json.dumps(list(tensors))


@dataclass(frozen=True)
class Job:
    id: str
    status: str
    attempt: int
    model_sha256: str
    model_path: str
    options: dict[str, Any]
    progress: dict[str, Any] | None
    error: str | None
    cause: str | None
    plan: PlanDocument | None
    created: float
    started: float | None
    finished: float | None

    @property
    def retryable(self) -> bool:
        """A failure that an identical request should not get back as its answer."""
        return self.status == "failed" and self.cause != "input"

    @property
    def model_name(self) -> str:
        return Path(self.model_path).name

    def elapsed(self) -> float | None:
        """Seconds since the job started, until it finished; None before it started."""
        if self.started is None:
            return None
        return (self.finished or time.time()) - self.started

    def progress_view(self) -> dict[str, Any] | None:
        if self.progress is None:
            return None
        elapsed = self.elapsed()
        return self.progress | ({} if elapsed is None else {"elapsed_s": round(elapsed, 3)})

    def view(self) -> dict[str, Any]:
        """The job as GET /v1/plans/{id} shows it."""
        return {"id": self.id, "status": self.status, "progress": self.progress_view(),
                "error": self.error,
                "plan": self.plan.to_json() if self.plan is not None else None}  # fmt: skip


def _progress(text: str | None) -> dict[str, Any] | None:
    """A progress column: JSON, or the plain message a service before 2026-11 wrote."""
    if text is None:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    return data if isinstance(data, dict) else {"stage": None, "detail": text}


_JOB_COLUMNS = (
    "id, status, attempt, model_sha256, model_path, options, progress, error, cause, plan, "
    "created, started, finished"
)


def _job(row: tuple[Any, ...]) -> Job:
    """A job of a row of `_JOB_COLUMNS`."""
    (id_, status, attempt, sha, path, options, progress, error, cause, plan) = row[:10]
    return Job(
        id_, status, attempt, sha, path, json.loads(options), _progress(progress), error,
        cause, PlanDocument.from_json(json.loads(plan), f"job {id_}'s plan") if plan else None,
        *row[10:],
    )  # fmt: skip


class Store:
    """Thread-safe access to the jobs table (one connection, one lock per process)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._db.commit()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._db:
            yield self._db

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- reading --

    def get(self, job_id: str) -> Job | None:
        with self._tx() as db:
            row = db.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _job(row)

    def recent(self, limit: int, offset: int = 0) -> list[Job]:
        """`limit` jobs from the `offset`-th newest on, newest first, without their plans (a
        tie in `created` is broken by id, so pages neither repeat nor skip a job)."""
        columns = _JOB_COLUMNS.replace(", plan,", ", NULL,")
        with self._tx() as db:
            rows = db.execute(
                f"SELECT {columns} FROM jobs ORDER BY created DESC, id LIMIT ? OFFSET ?",
                (limit, offset),
            ).fetchall()
        return [_job(row) for row in rows]

    def artifact(self, job_id: str, column: str) -> tuple[str | None, str | None]:
        """(text, error) of an artifact column: `spmd` (with `spmd_error`) or `report`."""
        error_column = {"spmd": "spmd_error", "report": "NULL"}[column]
        with self._tx() as db:
            row = db.execute(
                f"SELECT {column}, {error_column} FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
        return (row[0], row[1]) if row else (None, None)

    def report_html(self, job_id: str, tensors: Sequence[str]) -> str | None:
        """A kept HTML report of a done job drawing `tensors`, or None if not built yet."""
        with self._tx() as db:
            row = db.execute(
                "SELECT html FROM reports WHERE job_id = ? AND tensors = ?",
                (job_id, _tensors_key(tensors)),
            ).fetchone()
        return row[0] if row else None

    def counts(self) -> dict[str, int]:
        with self._tx() as db:
            rows = db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        return {status: 0 for status in STATUSES} | dict(rows)

    # -- the server's writes --

    def create(
        self, job_id: str, model_sha256: str, model_path: str, options: dict[str, Any]
    ) -> bool:
        """Queue a new job; False if a job with this id exists already."""
        with self._tx() as db:
            cursor = db.execute(
                "INSERT OR IGNORE INTO jobs (id, status, model_sha256, model_path, options, "
                "created) VALUES (?, 'queued', ?, ?, ?, ?)",
                (job_id, model_sha256, model_path, json.dumps(options), time.time()),
            )
            return cursor.rowcount == 1

    def requeue(self, job_id: str) -> int | None:
        """Queue a retryable failed job again; its new attempt, or None if it is not one."""
        with self._tx() as db:
            cursor = db.execute(
                "UPDATE jobs SET status = 'queued', attempt = attempt + 1, progress = NULL, "
                "error = NULL, cause = NULL, started = NULL, finished = NULL "
                "WHERE id = ? AND status = 'failed' AND cause != 'input'",
                (job_id,),
            )
            if cursor.rowcount != 1:
                return None
            db.execute("DELETE FROM reports WHERE job_id = ?", (job_id,))
            row = db.execute("SELECT attempt FROM jobs WHERE id = ?", (job_id,)).fetchone()
            return int(row[0])

    def recover(self) -> list[Job]:
        """At startup: a job left `running` by a crash fails with the reason; the queued ones
        are returned to be queued again."""
        with self._tx() as db:
            db.execute(
                "UPDATE jobs SET status = 'failed', cause = 'interrupted', finished = ?, "
                "error = 'the server stopped while this job was running (crash or restart); "
                "submit the same request again to retry' WHERE status = 'running'",
                (time.time(),),
            )
            ids = [r[0] for r in db.execute("SELECT id FROM jobs WHERE status = 'queued'")]
        return [job for job in map(self.get, ids) if job is not None]

    # -- a worker's writes: each applies only to the attempt the worker was given --

    def start(self, job_id: str, attempt: int) -> bool:
        with self._tx() as db:
            cursor = db.execute(
                "UPDATE jobs SET status = 'running', started = ? "
                "WHERE id = ? AND attempt = ? AND status = 'queued'",
                (time.time(), job_id, attempt),
            )
            return cursor.rowcount == 1

    def progress(self, job_id: str, attempt: int, progress: dict[str, Any]) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE jobs SET progress = ? WHERE id = ? AND attempt = ? AND status = 'running'",
                (json.dumps(progress), job_id, attempt),
            )

    def finish(
        self,
        job_id: str,
        attempt: int,
        plan: PlanDocument,
        spmd: str | None,
        spmd_error: str | None,
        report: str,
        html: str | None = None,
    ) -> None:
        """The job is done: its plan, SPMD program, Markdown and (`html`) HTML reports."""
        text = json.dumps(plan.to_json())
        with self._tx() as db:
            cursor = db.execute(
                "UPDATE jobs SET status = 'done', plan = ?, spmd = ?, spmd_error = ?, "
                "report = ?, finished = ? WHERE id = ? AND attempt = ? AND status = 'running'",
                (text, spmd, spmd_error, report, time.time(), job_id, attempt),
            )
            if cursor.rowcount == 1 and html is not None:
                self._keep(db, job_id, (), html)

    def keep_report(self, job_id: str, tensors: Sequence[str], html: str) -> None:
        """Keep a done job's HTML report drawing `tensors`."""
        with self._tx() as db:
            self._keep(db, job_id, tensors, html)

    @staticmethod
    def _keep(db: sqlite3.Connection, job_id: str, tensors: Sequence[str], html: str) -> None:
        db.execute(
            "INSERT OR REPLACE INTO reports (job_id, tensors, html) VALUES (?, ?, ?)",
            (job_id, _tensors_key(tensors), html),
        )

    def fail(self, job_id: str, attempt: int, error: str, cause: str) -> None:
        """Fail a queued or running attempt (a worker that died fails it before it started)."""
        assert cause in CAUSES, cause
        with self._tx() as db:
            db.execute(
                "UPDATE jobs SET status = 'failed', error = ?, cause = ?, finished = ? "
                "WHERE id = ? AND attempt = ? AND status IN ('queued', 'running')",
                (error, cause, time.time(), job_id, attempt),
            )

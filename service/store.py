"""The job store: a SQLite file under the service's data folder, or a PostgreSQL database that
several API replicas share (database.py), and the worker processes beside them.

A job's life: `queued` (accepted, waiting for a worker) -> `running` -> `done` | `failed`.
A replica *claims* a queued job (`claim`: the oldest, under `FOR UPDATE SKIP LOCKED` on
PostgreSQL, so two replicas never claim one job) and owns it while it runs, renewing its
`heartbeat` every few seconds (`beat`). A running job whose heartbeat is older than the lease
lost its replica (killed, cut off): `reap` queues it again for any replica to claim, at most
`MAX_LOST` times, then fails it as `interrupted`. Each (re)queue bumps `attempt`; a worker
writes only while the attempt it was given is the job's current one, so a worker orphaned by
a crash can never overwrite a newer attempt.

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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy
from sqlalchemy.engine import Connection

from autoshard.document.plan_document import PlanDocument
from service.database import database_url, is_postgres, make_engine, retrying

STATUSES = ("queued", "running", "done", "failed")
CAUSES = ("input", "interrupted", "internal")

MAX_LOST = 3  # runs a job may lose to a dead replica or worker before it fails
_T = TypeVar("_T")
_LOST = (
    "the server running this job stopped {n} times (crash or restart); submit the same "
    "request again to retry"
)


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
    """Access to the jobs table from any thread: each call is one transaction on a pooled
    connection, retried while the database is down (database.retrying)."""

    def __init__(self, database: str | Path, migrate: bool = False) -> None:
        self.url = database_url(database)
        self._engine = make_engine(self.url)
        self._postgres = is_postgres(self.url)
        if migrate:
            from service.migrations import upgrade

            retrying(self._engine, lambda: upgrade(self._engine))

    def _tx(self, work: Callable[[Connection], _T]) -> _T:
        def once() -> _T:
            with self._engine.begin() as db:
                return work(db)

        return retrying(self._engine, once)

    def _run(self, sql: str, **params: Any) -> _Read:
        """One statement in its own transaction, its rows read before it commits."""

        def work(db: Connection) -> _Read:
            result = db.execute(sqlalchemy.text(sql), params)
            return _Read(list(result.fetchall()) if result.returns_rows else [], result.rowcount)

        return self._tx(work)

    def close(self) -> None:
        self._engine.dispose()

    # -- reading --

    def get(self, job_id: str) -> Job | None:
        rows = self._run(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = :id", id=job_id).rows
        return _job(rows[0]) if rows else None

    def recent(self, limit: int, offset: int = 0) -> list[Job]:
        """`limit` jobs from the `offset`-th newest on, newest first, without their plans (a
        tie in `created` is broken by id, so pages neither repeat nor skip a job)."""
        columns = _JOB_COLUMNS.replace(", plan,", ", NULL,")
        rows = self._run(
            f"SELECT {columns} FROM jobs ORDER BY created DESC, id LIMIT :limit OFFSET :offset",
            limit=limit, offset=offset,
        ).rows  # fmt: skip
        return [_job(row) for row in rows]

    def artifact(self, job_id: str, column: str) -> tuple[str | None, str | None]:
        """(text, error) of an artifact column: `spmd` (with `spmd_error`) or `report`."""
        error_column = {"spmd": "spmd_error", "report": "NULL"}[column]
        rows = self._run(f"SELECT {column}, {error_column} FROM jobs WHERE id = :id", id=job_id)
        return (rows.rows[0][0], rows.rows[0][1]) if rows.rows else (None, None)

    def report_html(self, job_id: str, tensors: Sequence[str]) -> str | None:
        """A kept HTML report of a done job drawing `tensors`, or None if not built yet."""
        rows = self._run(
            "SELECT html FROM reports WHERE job_id = :id AND tensors = :tensors",
            id=job_id, tensors=_tensors_key(tensors),
        ).rows  # fmt: skip
        return rows[0][0] if rows else None

    def counts(self) -> dict[str, int]:
        rows = self._run("SELECT status, COUNT(*) FROM jobs GROUP BY status").rows
        return {status: 0 for status in STATUSES} | {s: int(n) for s, n in rows}

    # -- the server's writes --

    def create(
        self, job_id: str, model_sha256: str, model_path: str, options: dict[str, Any]
    ) -> bool:
        """Queue a new job; False if a job with this id exists already."""
        done = self._run(
            "INSERT INTO jobs (id, status, model_sha256, model_path, options, created) "
            "VALUES (:id, 'queued', :sha, :path, :options, :now) ON CONFLICT (id) DO NOTHING",
            id=job_id, sha=model_sha256, path=model_path, options=json.dumps(options),
            now=time.time(),
        )  # fmt: skip
        return done.rowcount == 1

    def requeue(self, job_id: str) -> int | None:
        """Queue a retryable failed job again; its new attempt, or None if it is not one."""

        def work(db: Connection) -> int | None:
            row = db.execute(
                sqlalchemy.text(
                    "UPDATE jobs SET status = 'queued', attempt = attempt + 1, progress = NULL, "
                    "error = NULL, cause = NULL, started = NULL, finished = NULL, owner = NULL, "
                    "lost = 0 WHERE id = :id AND status = 'failed' AND cause != 'input' "
                    "RETURNING attempt"
                ),
                {"id": job_id},
            ).fetchone()
            if row is None:
                return None
            db.execute(sqlalchemy.text("DELETE FROM reports WHERE job_id = :id"), {"id": job_id})
            return int(row[0])

        return self._tx(work)

    def claim(self, owner: str) -> Job | None:
        """The oldest queued job, now running and owned by `owner`; None if none is queued.
        Replicas claiming at once each get another job (PostgreSQL skips the rows another
        transaction holds; SQLite has one writer)."""
        lock = " FOR UPDATE SKIP LOCKED" if self._postgres else ""
        rows = self._run(
            "UPDATE jobs SET status = 'running', owner = :owner, started = :now, "
            "heartbeat = :now WHERE id = (SELECT id FROM jobs WHERE status = 'queued' "
            f"ORDER BY created, id LIMIT 1{lock}) AND status = 'queued' "
            f"RETURNING {_JOB_COLUMNS}",
            owner=owner, now=time.time(),
        ).rows  # fmt: skip
        return _job(rows[0]) if rows else None

    def beat(self, owner: str, jobs: Sequence[tuple[str, int]]) -> None:
        """Renew the lease of the (id, attempt) jobs `owner` is running."""
        if jobs:
            self._tx(lambda db: db.execute(
                sqlalchemy.text(
                    "UPDATE jobs SET heartbeat = :now WHERE id = :id AND attempt = :attempt "
                    "AND owner = :owner AND status = 'running'"
                ),
                [{"now": time.time(), "id": i, "attempt": a, "owner": owner} for i, a in jobs],
            ))  # fmt: skip

    def reap(self, lease_s: float) -> int:
        """Queue again each running job whose lease ran out (its replica is gone), or fail it
        once it lost `MAX_LOST` runs; how many there were."""
        expired = "status = 'running' AND (heartbeat IS NULL OR heartbeat < :stale)"
        return self._lose(expired, stale=time.time() - lease_s)

    def release(self, owner: str) -> None:
        """`owner` stops: its running jobs are queued again at once (no run lost)."""
        self._run(
            "UPDATE jobs SET status = 'queued', attempt = attempt + 1, owner = NULL, "
            "progress = NULL, started = NULL WHERE owner = :owner AND status = 'running'",
            owner=owner,
        )

    def lose(self, job_id: str, attempt: int) -> None:
        """The worker running this attempt died: queue the job again, as `reap` does."""
        self._lose("id = :id AND attempt = :attempt AND status = 'running'",
                   id=job_id, attempt=attempt)  # fmt: skip

    def _lose(self, where: str, **params: Any) -> int:
        now = time.time()

        def work(db: Connection) -> int:
            failed = db.execute(
                sqlalchemy.text(
                    "UPDATE jobs SET status = 'failed', cause = 'interrupted', finished = :now, "
                    f"owner = NULL, error = :error WHERE {where} AND lost + 1 >= :most"
                ),
                params | {"now": now, "error": _LOST.format(n=MAX_LOST), "most": MAX_LOST},
            ).rowcount
            queued = db.execute(
                sqlalchemy.text(
                    "UPDATE jobs SET status = 'queued', attempt = attempt + 1, lost = lost + 1, "
                    f"owner = NULL, progress = NULL, started = NULL WHERE {where}"
                ),
                params,
            ).rowcount
            return int(failed + queued)

        return self._tx(work)

    # -- a worker's writes: each applies only to the attempt the worker was given --

    def progress(self, job_id: str, attempt: int, progress: dict[str, Any]) -> None:
        self._run(
            "UPDATE jobs SET progress = :progress WHERE id = :id AND attempt = :attempt "
            "AND status = 'running'",
            progress=json.dumps(progress), id=job_id, attempt=attempt,
        )  # fmt: skip

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

        def work(db: Connection) -> None:
            done = db.execute(
                sqlalchemy.text(
                    "UPDATE jobs SET status = 'done', plan = :plan, spmd = :spmd, "
                    "spmd_error = :spmd_error, report = :report, finished = :now, owner = NULL "
                    "WHERE id = :id AND attempt = :attempt AND status = 'running'"
                ),
                {"plan": text, "spmd": spmd, "spmd_error": spmd_error, "report": report,
                 "now": time.time(), "id": job_id, "attempt": attempt},
            )  # fmt: skip
            if done.rowcount == 1 and html is not None:
                _keep(db, job_id, (), html)

        self._tx(work)

    def finish_sweep(self, job_id: str, attempt: int, table: str, html: str) -> None:
        """A sweep job is done: its table (points.json) and its page of fronts."""

        def work(db: Connection) -> None:
            done = db.execute(
                sqlalchemy.text(
                    "UPDATE jobs SET status = 'done', report = :table, finished = :now, "
                    "owner = NULL WHERE id = :id AND attempt = :attempt AND status = 'running'"
                ),
                {"table": table, "now": time.time(), "id": job_id, "attempt": attempt},
            )
            if done.rowcount == 1:
                _keep(db, job_id, (), html)

        self._tx(work)

    def keep_report(self, job_id: str, tensors: Sequence[str], html: str) -> None:
        """Keep a done job's HTML report drawing `tensors`."""
        self._tx(lambda db: _keep(db, job_id, tensors, html))

    def fail(self, job_id: str, attempt: int, error: str, cause: str) -> None:
        """Fail a queued or running attempt."""
        assert cause in CAUSES, cause
        self._run(
            "UPDATE jobs SET status = 'failed', error = :error, cause = :cause, finished = :now, "
            "owner = NULL WHERE id = :id AND attempt = :attempt "
            "AND status IN ('queued', 'running')",
            error=error, cause=cause, now=time.time(), id=job_id, attempt=attempt,
        )  # fmt: skip


@dataclass(frozen=True)
class _Read:
    """A statement's rows and row count, read inside its transaction."""

    rows: list[Any]
    rowcount: int


def _keep(db: Connection, job_id: str, tensors: Sequence[str], html: str) -> None:
    db.execute(
        sqlalchemy.text(
            "INSERT INTO reports (job_id, tensors, html) VALUES (:id, :tensors, :html) "
            "ON CONFLICT (job_id, tensors) DO UPDATE SET html = excluded.html"
        ),
        {"id": job_id, "tensors": _tensors_key(tensors), "html": html},
    )

"""The job store itself, on SQLite and on a real PostgreSQL: an upgrade keeps every plan of a
store made before Alembic; replicas claiming at once never claim one job twice; a job whose
replica went silent is queued again, and fails after `MAX_LOST` lost runs."""

from __future__ import annotations

import json
import sqlite3
import threading
from typing import Any

import pytest
import sqlalchemy

from autoshard.cli.main import main
from autoshard.document.plan_document import PlanDocument
from service.database import DatabaseError, database_url, make_engine
from service.migrations import revision
from service.store import MAX_LOST, Store

from .conftest import MODELS

# The schema of the services before Alembic (service/store.py until 2026-11), verbatim.
BEFORE_ALEMBIC = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, status TEXT NOT NULL, attempt INTEGER NOT NULL DEFAULT 1,
    model_sha256 TEXT NOT NULL, model_path TEXT NOT NULL, options TEXT NOT NULL,
    progress TEXT, error TEXT, cause TEXT, plan TEXT, spmd TEXT, spmd_error TEXT, report TEXT,
    created REAL NOT NULL, started REAL, finished REAL
);
CREATE TABLE IF NOT EXISTS reports (
    job_id TEXT NOT NULL, tensors TEXT NOT NULL, html TEXT NOT NULL,
    PRIMARY KEY (job_id, tensors)
)
"""


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "jobs.sqlite3")
    return str(request.getfixturevalue("postgres").url())


def test_an_upgrade_keeps_every_plan(tmp_path, capsys) -> None:
    assert main(["plan", str(MODELS / "mlp.onnx"), "--mesh", "2x2", "--dim", "batch=8",
                 "--json"]) == 0  # fmt: skip
    plan = capsys.readouterr().out
    path = tmp_path / "jobs.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(BEFORE_ALEMBIC)
        db.executemany(
            "INSERT INTO jobs (id, status, model_sha256, model_path, options, plan, spmd, "
            "report, created, started) VALUES (?, ?, 'sha', 'm.onnx', '{}', ?, 'mlir', 'md', 1, 2)",
            [("done", "done", plan), ("running", "running", None)],
        )
        db.execute("INSERT INTO reports VALUES ('done', '[]', '<html>')")
    store = Store(path, migrate=True)
    assert revision(make_engine(store.url)) == "0002"
    done = store.get("done")
    assert done is not None and done.plan == PlanDocument.from_json(json.loads(plan), "plan")
    assert store.artifact("done", "spmd") == ("mlir", None)
    assert store.report_html("done", ()) == "<html>"
    # The job a stopped old server was running has no lease: it is queued again.
    assert store.reap(lease_s=30) == 1
    assert store.claim("replica") is not None and store.get("running").attempt == 2  # type: ignore[union-attr]
    Store(path, migrate=True)  # a second upgrade finds the schema current


def test_replicas_claiming_at_once_claim_each_job_once(database: str) -> None:
    Store(database, migrate=True)
    first = Store(database)
    for i in range(60):
        assert first.create(f"job{i:02}", "sha", "m.onnx", {})
    claimed: dict[str, list[str]] = {}

    def replica(name: str) -> None:
        store, mine = Store(database), []
        while (job := store.claim(name)) is not None:
            mine.append(job.id)
        claimed[name] = mine

    threads = [threading.Thread(target=replica, args=(f"r{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = sorted(j for jobs in claimed.values() for j in jobs)
    assert every == [f"job{i:02}" for i in range(60)]  # each once, none left
    assert first.counts()["running"] == 60


def test_a_silent_replica_loses_its_jobs(database: str) -> None:
    store = Store(database, migrate=True)
    store.create("a", "sha", "m.onnx", {})
    runs: list[Any] = []
    for _ in range(MAX_LOST):
        job = store.claim("replica")
        assert job is not None
        runs.append(job.attempt)
        store.beat("replica", [(job.id, job.attempt)])
        assert store.reap(lease_s=60) == 0  # its lease holds
        assert store.reap(lease_s=0) == 1  # it ran out
    assert runs == [1, 2, 3]
    lost = store.get("a")
    assert lost is not None and (lost.status, lost.cause) == ("failed", "interrupted")
    assert lost.error == (
        f"the server running this job stopped {MAX_LOST} times (crash or restart); submit the "
        "same request again to retry"
    )
    assert store.requeue("a") == 4 and store.claim("again") is not None  # asked again, it runs


def test_a_bad_database_url_is_one_line() -> None:
    with pytest.raises(DatabaseError) as error:
        database_url("mysql://me@db/jobs")
    assert str(error.value) == (
        "--database mysql://me@db/jobs: unknown scheme 'mysql'; give "
        "postgresql://USER:PASSWORD@HOST/DB or sqlite:///PATH"
    )
    assert database_url("postgresql://u@h/d") == "postgresql+psycopg://u@h/d"
    assert sqlalchemy.make_url(database_url("x.db")).database.endswith("/x.db")  # type: ignore[union-attr]

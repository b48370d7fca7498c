"""The REST service over real HTTP: `autoshard serve` started as a subprocess on a free port,
its store SQLite or a real PostgreSQL server (postgres.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy

from service.database import database_url

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
UPLOAD_LIMIT = 1 << 20  # 1 MiB: the bundled models fit, a 2 MiB upload does not


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One `python -m autoshard serve` process on `data` (and `database`, else the SQLite file
    in `data`); `flags` are more of its command line."""

    def __init__(
        self,
        data: Path,
        workers: int = 2,
        database: str | None = None,
        flags: tuple = (),
        start_s: float = 30,
    ) -> None:
        self.data, self.workers, self.flags, self.start_s = data, workers, list(flags), start_s
        self.database = database or str(data / "jobs.sqlite3")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data.parent / f"{data.name}-server-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        command = [
            sys.executable, "-m", "autoshard", "serve", "--port", str(self.port), "--data",
            str(self.data), "--max-upload", str(UPLOAD_LIMIT), "--workers", str(self.workers),
            "--database", self.database, *self.flags,
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log)
        deadline = time.monotonic() + self.start_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"server exited: {self.log.read_text()}"
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError(f"server did not start: {self.log.read_text()}")

    def children(self) -> list[int]:
        assert self.process is not None
        pid = self.process.pid
        found = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
        return found

    def kill(self) -> None:
        """SIGKILL: a crash, no shutdown code runs."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def sql(self, query: str, rows: list[dict[str, Any]] | None = None, **params: Any) -> list:
        """Run SQL on the server's store, as the server's own (its rows, if any)."""
        engine = sqlalchemy.create_engine(database_url(self.database))
        try:
            with engine.begin() as db:
                result = db.execute(sqlalchemy.text(query), rows or params)
                return list(result.fetchall()) if result.returns_rows else []
        finally:
            engine.dispose()

    # -- the API --

    def submit(
        self, model: Path | bytes, fields: Mapping[str, str], filename: str = "model.onnx"
    ) -> httpx.Response:
        if isinstance(model, Path):
            filename, model = model.name, model.read_bytes()
        return httpx.post(
            f"{self.url}/v1/plans", files={"model": (filename, model)}, data=dict(fields),
            timeout=60,
        )  # fmt: skip

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=30)

    def wait(self, job_id: str, until: tuple[str, ...] = ("done", "failed"), timeout: float = 45):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job: dict[str, Any] = self.get(f"/v1/plans/{job_id}").json()
            if job["status"] in until:
                return job
            time.sleep(0.02)
        raise AssertionError(f"job {job_id} still {job['status']} after {timeout} s")

    def watch(
        self, job_id: str, timeout: float = 60, look: Callable[[dict], None] = lambda _: None
    ) -> tuple[dict[str, Any], list[dict]]:
        """Poll a job until it ends: the job, and each progress seen while it ran (each also
        given to `look` as it is seen)."""
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job: dict[str, Any] = self.get(f"/v1/plans/{job_id}").json()
            if job["status"] in ("done", "failed"):
                return job, seen
            if job["progress"] is not None and job["progress"] not in seen[-1:]:
                seen.append(job["progress"])
                look(job["progress"])
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} still {job['status']} after {timeout} s")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[1][0] != "Z"


@pytest.fixture(scope="session")
def postgres() -> Iterator[Any]:
    """A PostgreSQL server of the session (postgres.py); skipped where none is installed."""
    from .postgres import Postgres, binaries

    found = binaries()
    if found is None:
        pytest.skip(
            "no PostgreSQL server (initdb) on PATH or under /usr/lib/postgresql: "
            "apt-get install postgresql to run the service's tests on PostgreSQL"
        )
    server = Postgres(found)
    server.start()
    yield server
    server.remove()


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The session's server, once on each store: every test that takes it runs on both."""
    database = request.getfixturevalue("postgres").url() if request.param == "postgresql" else None
    started = Server(tmp_path_factory.mktemp(f"service-{request.param}") / "data", 2, database)
    yield started.start()
    started.stop()


@pytest.fixture
def new_server(tmp_path: Path) -> Iterator[Any]:
    """Servers of one test, stopped after it."""
    made: list[Server] = []

    def make(data: Path | None = None, workers: int = 2, **more: Any) -> Server:
        made.append(Server(data or tmp_path / "data", workers, **more).start())
        return made[-1]

    yield make
    for s in made:
        s.stop()

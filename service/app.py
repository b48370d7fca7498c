"""The FastAPI app of `autoshard serve`: settings, startup (migrate the store, start the
executor and the dispatcher) and shutdown. The data folder holds everything that must survive
a restart:

    DATA/jobs.sqlite3            jobs, plans, SPMD programs and reports (see store.py), unless
                                 --database names a PostgreSQL
    DATA/models/<sha256>/<name>  the uploaded models, once per content and name
    DATA/uploads/HOST-PID/       a replica's uploads in flight (emptied at its startup)

Several replicas share one PostgreSQL and one data folder (a volume every replica and Ray
worker mounts at the same path: a job names its model by path); docs/guide/deploy.md.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

from autoshard import __version__
from autoshard.errors import AutoshardError
from service import sweeps, web
from service.database import database_url, is_postgres
from service.dispatch import Dispatcher, Executor, Timing
from service.routes import router
from service.store import Store
from service.worker import Pool

DEFAULT_MAX_UPLOAD = 2 << 30  # 2 GiB


class ServiceError(AutoshardError):
    """Settings the service cannot start with (an unusable data folder, a bad limit)."""


@dataclass(frozen=True)
class Settings:
    data: Path
    max_upload: int = DEFAULT_MAX_UPLOAD
    workers: int | None = None  # None: one per CPU
    max_time_limit: float = 600.0
    database: str | None = None  # None: DATA/jobs.sqlite3
    executor: str = "local"  # local, ray (a local Ray), or ray://HOST:PORT
    lease_s: float = 30.0

    def __post_init__(self) -> None:
        if self.database is not None:
            database_url(self.database)  # DatabaseError on a bad one
        if not (self.executor in ("local", "ray") or self.executor.startswith("ray://")):
            raise ServiceError(
                f"--executor {self.executor}: give local, ray (a local Ray) or ray://HOST:PORT"
            )
        if self.executor != "local" and importlib.util.find_spec("ray") is None:
            raise ServiceError(
                f"--executor {self.executor} needs Ray: pip install 'autoshard[cluster]'"
            )
        if not self.lease_s > 0:
            raise ServiceError(f"--lease {self.lease_s} must be > 0 seconds")
        if self.max_upload < 1:
            raise ServiceError(f"--max-upload {self.max_upload} must be at least 1 byte")
        if self.workers is not None and self.workers < 1:
            raise ServiceError(f"--workers {self.workers} must be at least 1")
        if not self.max_time_limit > 0:
            raise ServiceError(f"--max-time-limit {self.max_time_limit} must be > 0 seconds")

    @property
    def worker_count(self) -> int:
        return self.workers or os.cpu_count() or 1

    @property
    def db(self) -> str:
        """The store's database: --database, or the SQLite file in the data folder."""
        return self.database or str(self.data / "jobs.sqlite3")

    @property
    def models(self) -> Path:
        return self.data / "models"

    @property
    def uploads(self) -> Path:
        """This replica's uploads in flight: replicas may share the data folder."""
        return self.data / "uploads" / f"{socket.gethostname()}-{os.getpid()}"


def create_app(settings: Settings) -> FastAPI:
    try:
        settings.models.mkdir(parents=True, exist_ok=True)
        embedded = settings.database is None or not is_postgres(database_url(settings.database))
        # Alone on the data folder (SQLite), every upload left there is a stopped server's.
        shutil.rmtree(settings.uploads.parent if embedded else settings.uploads, True)
        settings.uploads.mkdir(parents=True)
    except OSError as error:
        raise ServiceError(f"cannot use data folder '{settings.data}': {error.strerror}") from None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store(settings.db, migrate=True)
        if not is_postgres(store.url):  # embedded: no other server runs its jobs
            store.reap(lease_s=0)
        executor = _executor(settings, store)
        dispatcher = Dispatcher(store, executor, Timing(settings.lease_s))
        executor.on_free = dispatcher.poke
        app.state.store, app.state.executor, app.state.dispatcher = store, executor, dispatcher
        dispatcher.start()
        try:
            yield
        finally:
            await dispatcher.stop()
            executor.shutdown()
            store.release(dispatcher.owner)
            store.close()

    app = FastAPI(
        title="autoshard",
        version=__version__,
        summary="Sharding plans for ONNX models over a device mesh",
        description=(
            "Upload an ONNX model with the options of `autoshard plan`; poll the job; fetch "
            "the plan (exactly what `autoshard plan --json` prints), its SPMD program and a "
            "Markdown report. Identical requests (model sha256 + options) share one job."
        ),
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.include_router(router)
    app.include_router(web.router)
    app.include_router(sweeps.router)
    app.add_exception_handler(OperationalError, _store_down)
    return app


async def _store_down(request: Request, error: Exception) -> JSONResponse:
    """The database stayed unreachable past the store's retries: 503, which a retry fixes."""
    return JSONResponse(
        {"detail": "the job store is unreachable; retry in a few seconds"},
        status_code=503, headers={"Retry-After": "5"},
    )  # fmt: skip


def _executor(settings: Settings, store: Store) -> Executor:
    if settings.executor == "local":
        return Pool(store, settings.worker_count, asyncio.get_running_loop())
    from service.ray_executor import RayExecutor

    return RayExecutor(store, settings.executor, settings.workers, asyncio.get_running_loop())


def serve(settings: Settings, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(create_app(settings), host=host, port=port, log_level="info")

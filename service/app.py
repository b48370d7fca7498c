"""The FastAPI app of `autoshard serve`: settings, startup (recover the store, start the pool)
and shutdown. The data folder holds everything that must survive a restart:

    DATA/jobs.sqlite3            jobs, plans, SPMD programs and reports (see store.py)
    DATA/models/<sha256>/<name>  the uploaded models, once per content and name
    DATA/uploads/                uploads in flight (emptied at startup)
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from autoshard import __version__
from autoshard.errors import AutoshardError
from service import web
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

    def __post_init__(self) -> None:
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
    def db(self) -> Path:
        return self.data / "jobs.sqlite3"

    @property
    def models(self) -> Path:
        return self.data / "models"

    @property
    def uploads(self) -> Path:
        return self.data / "uploads"


def create_app(settings: Settings) -> FastAPI:
    try:
        settings.models.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(settings.uploads, ignore_errors=True)
        settings.uploads.mkdir()
    except OSError as error:
        raise ServiceError(f"cannot use data folder '{settings.data}': {error.strerror}") from None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store(settings.db)
        pool = Pool(store, settings.worker_count, asyncio.get_running_loop())
        app.state.store, app.state.pool = store, pool
        for job in store.recover():  # queued before a stop: queue them again
            pool.submit(job.id, job.attempt, job.model_path, job.options)
        try:
            yield
        finally:
            pool.shutdown()
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
    return app


def serve(settings: Settings, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(create_app(settings), host=host, port=port, log_level="info")

"""Plan jobs as Ray tasks (`autoshard serve --executor ray` for a local Ray the server starts,
`--executor ray://HOST:PORT` or `ray` with RAY_ADDRESS set for a cluster's): the API replicas
share one pool of solvers. A task writes its job's progress and results to the store itself,
as a pool worker does, so its workers must reach the database and the data folder (docs:
guide/deploy.md).

A task whose worker dies is retried by Ray (`RETRIES` times) on another worker; a task owned
by a replica that dies is cancelled by Ray with it, and the job's lease runs out (dispatch.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from autoshard.errors import AutoshardError
from service.store import Job, Store
from service.worker import keep_report, solve_job

log = logging.getLogger("autoshard.service")

RETRIES = 2
_stores: dict[str, Store] = {}  # a Ray worker's connection per database (kept between tasks)


def _store(database: str) -> Store:
    if database not in _stores:
        _stores[database] = Store(database)
    return _stores[database]


def ray_solve(database: str, job_id: str, attempt: int, model_path: str, options: dict) -> None:
    solve_job(_store(database), job_id, attempt, model_path, options)


def ray_report(database: str, job_id: str, tensors: tuple[str, ...]) -> str:
    return keep_report(_store(database), job_id, tensors)


class ExecutorError(AutoshardError):
    """A Ray the service cannot start or reach."""


class RayExecutor:
    """The dispatcher's executor on Ray: at most `workers` jobs in flight from this replica
    (default: the cluster's CPUs)."""

    def __init__(
        self, store: Store, address: str, workers: int | None, loop: asyncio.AbstractEventLoop
    ) -> None:
        import ray

        self.store, self.loop, self._ray = store, loop, ray
        self.on_free: Callable[[], None] = lambda: None
        try:
            ray.init(address=None if address == "ray" else address, include_dashboard=False,
                     log_to_driver=False, logging_level=logging.ERROR)  # fmt: skip
        except (ConnectionError, RuntimeError, ValueError) as error:
            raise ExecutorError(f"cannot start or reach Ray at {address}: {error}") from None
        self.workers = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._solve = ray.remote(max_retries=RETRIES, retry_exceptions=False)(ray_solve)
        self._report = ray.remote(max_retries=RETRIES, retry_exceptions=False)(ray_report)
        self._running: set[tuple[str, int]] = set()
        self._stopping = False  # shutdown kills running jobs: not lost runs (Store.release)

    def running(self) -> list[tuple[str, int]]:
        return sorted(self._running)

    def submit(self, job: Job) -> None:
        key = (job.id, job.attempt)
        self._running.add(key)
        ref = self._solve.remote(self.store.url, job.id, job.attempt, job.model_path, job.options)
        ref.future().add_done_callback(self._on_done(key))

    async def report(self, job_id: str, tensors: tuple[str, ...]) -> str:
        text: str = await asyncio.wrap_future(
            self._report.remote(self.store.url, job_id, tensors).future()
        )
        return text

    def _on_done(self, key: tuple[str, int]) -> Callable[[Future[Any]], None]:
        def done(future: Future[Any]) -> None:
            if not (self._stopping or future.cancelled()) and future.exception() is not None:
                log.error("job %s: Ray task failed: %r", key[0], future.exception())
                self.store.lose(*key)  # its workers lost past the retries: run it again
            self._running.discard(key)
            if not self.loop.is_closed():
                self.loop.call_soon_threadsafe(self.on_free)

        return done

    def shutdown(self) -> None:
        self._stopping = True
        self._ray.shutdown()

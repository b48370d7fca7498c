"""The replica's dispatcher: claims queued jobs from the shared store while its executor has
room, renews the lease of the jobs it runs, and queues again the jobs of replicas that died.

Why the store, not the request, hands a job to a worker: with several API replicas on one
PostgreSQL a job accepted by one replica may run on any, and a replica that dies takes no job
with it (its running jobs' leases run out and another replica claims them again; its queued
ones were never its own). A submission pokes its own replica's dispatcher so a free worker
starts at once; the others find the job at their next look, `poll_s` later at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import anyio

from service.store import Job, Store

log = logging.getLogger("autoshard.service")


class Executor(Protocol):
    """Where claimed jobs run: the local process pool (worker.py) or Ray (ray_executor.py)."""

    workers: int
    on_free: Callable[[], None]  # called (from any thread) when a job of its ends

    def running(self) -> list[tuple[str, int]]: ...  # the (id, attempt) in flight

    def submit(self, job: Job) -> None: ...

    async def report(self, job_id: str, tensors: tuple[str, ...]) -> str: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class Timing:
    """How often the dispatcher looks, and how long a lease holds (a replica is taken for
    dead once its jobs' heartbeats are `lease_s` old; it renews them every `lease_s / 4`)."""

    lease_s: float = 30.0
    poll_s: float = 0.5

    @property
    def beat_s(self) -> float:
        return self.lease_s / 4


class Dispatcher:
    def __init__(self, store: Store, executor: Executor, timing: Timing) -> None:
        self.store, self.executor, self.timing = store, executor, timing
        self.owner = f"{uuid.uuid4().hex[:12]}"
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def poke(self) -> None:
        """A job was queued here: look now."""
        self._poke.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        beaten = reaped = -float("inf")
        while True:
            try:
                now = time.monotonic()
                if now - beaten >= self.timing.beat_s:
                    running = self.executor.running()
                    await anyio.to_thread.run_sync(self.store.beat, self.owner, running)
                    beaten = now
                if now - reaped >= self.timing.beat_s:
                    lost = await anyio.to_thread.run_sync(self.store.reap, self.timing.lease_s)
                    if lost:
                        log.warning("%d job(s) lost their replica: queued again", lost)
                    reaped = now
                await self._claim()
            except asyncio.CancelledError:
                raise
            except Exception:  # the store is down past its retries: look again later
                log.exception("dispatcher: cannot reach the store")
            self._poke.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), self.timing.poll_s)

    async def _claim(self) -> None:
        """Claim queued jobs while the executor has a free worker; each is submitted from the
        event-loop thread (worker.py says why)."""
        while len(self.executor.running()) < self.executor.workers:
            job = await anyio.to_thread.run_sync(self.store.claim, self.owner)
            if job is None:
                return
            self.executor.submit(job)

"""The solver pool: plan jobs run in worker processes, as many as the CPUs; the rest queue.

Why processes: a solve is mostly Python (import, candidate building, lowering, partition)
that holds the GIL; CP-SAT itself releases it, but threads would still serialize the rest.

A job also builds its plan's HTML report (seconds of Python for a large decoder) and keeps
it; a report drawing more tensors is built once, on its first request, by a worker too, so
the server's own thread never holds the GIL for it.

Workers write their job's progress and result to the store themselves, so a result survives
the server even if the server dies right after; each write names the job's attempt (see
store.py). Which job a worker runs is the dispatcher's (dispatch.py): it claims a job from
the store and submits it here. On Linux a worker is killed with its server (PR_SET_PDEATHSIG),
so a crashed server leaves no orphan solving on; every pool submission is made from the
event-loop thread, the thread whose exit would send that signal.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

from autoshard.errors import AutoshardError
from autoshard.progress import Progress
from service.options import PlanOptions
from service.store import Job, Store

log = logging.getLogger("autoshard.service")

SHUTDOWN_GRACE_S = 1.0
_store: Store | None = None  # the worker process's connection (one per process)


def _init_worker(database: str, parent: int) -> None:
    global _store
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the server died before the signal was armed
            os._exit(1)
    _store = Store(database)


class StoreView:
    """A job's progress written to its row: a new stage or step at once, a solve's figures at
    most every `every` seconds (each write is a transaction the server's readers see)."""

    def __init__(self, store: Store, job_id: str, attempt: int, every: float = 0.5) -> None:
        self.store, self.job_id, self.attempt, self.every = store, job_id, attempt, every
        self._step: tuple[str, str] | None = None
        self._written = -math.inf

    def __call__(self, progress: Progress) -> None:
        step = (progress.stage, progress.detail)
        if step != self._step or progress.elapsed_s - self._written >= self.every:
            self.store.progress(self.job_id, self.attempt, progress.to_json())
            self._step, self._written = step, progress.elapsed_s


def run_job(job_id: str, attempt: int, model_path: str, options_json: dict) -> None:
    """Solve one job in a pool worker and store its plan, SPMD program and reports."""
    store = _store
    assert store is not None, "run_job runs in a pool worker"
    solve_job(store, job_id, attempt, model_path, options_json)


def solve_job(store: Store, job_id: str, attempt: int, model_path: str, options_json: dict) -> None:
    """Solve a claimed job and store its results (on any executor's worker)."""
    from autoshard.explain.report import plan_markdown
    from autoshard.html import plan_html
    from autoshard.pipeline import plan_request, print_spmd
    from autoshard.progress import Tracker

    job = store.get(job_id)
    if job is None or (job.status, job.attempt) != ("running", attempt):
        return  # a newer attempt owns the job (this one was retried after its replica died)
    if options_json.get("kind") == "sweep":
        from service.sweeps import run_sweep_job

        try:
            run_sweep_job(store, job_id, attempt, model_path, options_json)
        except AutoshardError as error:
            store.fail(job_id, attempt, str(error), "input")
        return
    options = PlanOptions.from_json(options_json)
    tracker = Tracker(StoreView(store, job_id, attempt))
    try:
        requested = plan_request(options.request(model_path), tracker)
        spmd = spmd_error = None
        try:
            spmd = print_spmd(requested.partition(tracker), "mesh")
        except AutoshardError as error:  # the plan stands; only its SPMD program is missing
            spmd_error = f"cannot partition the plan: {error}"
        document = requested.document
        html = plan_html(document, model_path, (), requested.lowered)  # `autoshard html`'s
        store.finish(job_id, attempt, document, spmd, spmd_error, plan_markdown(document), html)
    except AutoshardError as error:  # the message names the model as the user did
        store.fail(job_id, attempt, str(error).replace(model_path, Path(model_path).name), "input")
    except Exception as error:
        log.error("job %s failed:\n%s", job_id, traceback.format_exc())
        store.fail(job_id, attempt, f"internal error: {type(error).__name__}: {error}", "internal")


def build_report(job_id: str, tensors: tuple[str, ...]) -> str:
    """In a pool worker: a done job's HTML report drawing `tensors`, kept in the store."""
    assert _store is not None, "build_report runs in a pool worker"
    return keep_report(_store, job_id, tensors)


def keep_report(store: Store, job_id: str, tensors: tuple[str, ...]) -> str:
    """A done job's HTML report drawing `tensors`, built and kept in the store."""
    from autoshard.html import plan_html

    job = store.get(job_id)
    assert job is not None and job.plan is not None, f"job {job_id} has no plan"
    html = plan_html(job.plan, job.model_path, tensors)
    store.keep_report(job_id, tensors, html)
    return html


class Pool:
    """A process pool for plan jobs (the dispatcher's executor); submit from the event-loop
    thread only."""

    def __init__(self, store: Store, workers: int, loop: asyncio.AbstractEventLoop) -> None:
        self.store, self.workers, self.loop = store, workers, loop
        self.on_free: Callable[[], None] = lambda: None  # a worker is free again
        self._running: set[tuple[str, int]] = set()
        self._stopping = False  # shutdown kills running jobs: not lost runs (Store.release)
        self._executor = self._start()

    def _start(self) -> ProcessPoolExecutor:
        # spawn, not fork: forking a process that runs an event loop and threads is unsafe.
        return ProcessPoolExecutor(
            self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(self.store.url, os.getpid()),
        )

    def running(self) -> list[tuple[str, int]]:
        return sorted(self._running)

    def submit(self, job: Job) -> None:
        if getattr(self._executor, "_broken", False):
            self._executor = self._start()
        key = (job.id, job.attempt)
        self._running.add(key)
        future = self._executor.submit(run_job, job.id, job.attempt, job.model_path, job.options)
        future.add_done_callback(self._on_done(key))

    async def report(self, job_id: str, tensors: tuple[str, ...]) -> str:
        """A done job's HTML report drawing `tensors`, built by a worker (`build_report`)."""
        if getattr(self._executor, "_broken", False):
            self._executor = self._start()
        return await asyncio.wrap_future(self._executor.submit(build_report, job_id, tensors))

    def _on_done(self, key: tuple[str, int]) -> Callable[[Future[None]], None]:
        def done(future: Future[None]) -> None:
            # Killed at shutdown: queued again by `Store.release`, with no run counted lost.
            if not (self._stopping or future.cancelled()) and future.exception() is not None:
                log.error("job %s: worker failed: %r", key[0], future.exception())
                self.store.lose(*key)  # a worker died (killed, out of memory): run it again
            self._running.discard(key)
            if not self.loop.is_closed():
                self.loop.call_soon_threadsafe(self.on_free)

        return done

    def shutdown(self) -> None:
        """Stop now: running jobs are killed (their leases run out and they are queued again,
        by this server's next start or another replica)."""
        self._stopping = True
        executor = self._executor
        processes = list(getattr(executor, "_processes", {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for process in processes:  # idle workers exit cleanly at once; busy ones are killed
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()

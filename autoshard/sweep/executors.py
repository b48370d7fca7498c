"""Where a sweep's points are planned: a local process pool (`--executor local`) or Ray (a
local instance the sweep starts and stops, or a user's cluster at `--ray-address`).

Both hand each finished row back as it comes (`on_row`) and neither stops at a point's
failure (`points.plan_point` returns its error as a row). A worker lost mid-point (killed,
out of memory) plans that point again: Ray by its task retries (`max_retries`), the pool by
resubmitting it once on a fresh pool; a point that loses its worker twice records so.
"""

from __future__ import annotations

import concurrent.futures as futures
import importlib.util
import logging
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

from autoshard.sweep.grid import SweepError
from autoshard.sweep.points import Task, plan_point

OnRow = Callable[[dict[str, Any]], None]
RETRIES = 1  # plans again of a point whose worker was lost


def default_executor() -> str:
    """Ray where it is installed, else the local pool."""
    return "ray" if importlib.util.find_spec("ray") is not None else "local"


def run_local(tasks: Sequence[Task], workers: int, on_row: OnRow) -> None:
    """Plan the tasks on a pool of `workers` processes (spawned: a fork would copy the
    parent's threads' locks)."""
    pending = list(tasks)
    tries = dict.fromkeys((t.key for t in tasks), 0)
    context = multiprocessing.get_context("spawn")
    while pending:
        lost: list[Task] = []
        with futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            running = {pool.submit(plan_point, task): task for task in pending}
            for done in futures.as_completed(running):
                task = running[done]
                try:
                    on_row(done.result())
                except futures.process.BrokenProcessPool:
                    lost.append(task)
        pending = []
        for task in lost:
            tries[task.key] += 1
            if tries[task.key] > RETRIES:
                on_row(_lost_row(task))
            else:
                pending.append(task)


def _lost_row(task: Task) -> dict[str, Any]:
    return {"key": task.key, "point": task.point.to_json(), "devices": task.point.devices,
            "status": "error", "error": f"the worker planning it was lost {RETRIES + 1} times",
            "wall_s": 0.0}  # fmt: skip


def run_ray(tasks: Sequence[Task], workers: int, address: str | None, on_row: OnRow) -> None:
    """Plan the tasks as Ray tasks: on the cluster at `address`, else on a local instance of
    `workers` CPUs started here and stopped when the sweep ends."""
    try:
        import ray
    except ImportError:
        raise SweepError(
            "--executor ray needs Ray: pip install 'autoshard[sweep]' (or use --executor local)"
        ) from None
    try:
        if address:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        else:
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.ERROR)  # fmt: skip
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise SweepError(f"cannot start or reach Ray at {address or 'local'}: {error}") from None
    try:
        remote = ray.remote(max_retries=RETRIES, retry_exceptions=False)(plan_point)
        refs = {remote.remote(task): task for task in tasks}
        waiting = list(refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            try:
                on_row(ray.get(ready[0]))
            except ray.exceptions.RayError:  # its worker lost past the retries
                on_row(_lost_row(refs[ready[0]]))
    finally:
        ray.shutdown()

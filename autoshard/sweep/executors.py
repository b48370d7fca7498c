"""Where a sweep's points are planned: a local process pool (`--executor local`) or Ray (a
local instance the sweep starts and stops, or a user's cluster at `--ray-address`).

Both plan the points that differ in their budget alone together on one worker
(`points.budget_groups`: one search shared), hand each finished group's rows back as they come
(`on_row`), and neither stops at a point's failure (`points.plan_point` returns its error as a
row). A worker lost mid-group (killed, out of memory) plans that group again: Ray by its task
retries (`max_retries`), the pool by resubmitting it once on a fresh pool; a group that loses
its worker twice records so for each of its points.
"""

from __future__ import annotations

import concurrent.futures as futures
import importlib.util
import logging
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

from autoshard.sweep.grid import SweepError
from autoshard.sweep.points import Task, budget_groups, plan_points

OnRow = Callable[[dict[str, Any]], None]
RETRIES = 1  # plans again of a point whose worker was lost


def default_executor() -> str:
    """Ray where it is installed, else the local pool."""
    return "ray" if importlib.util.find_spec("ray") is not None else "local"


def run_local(tasks: Sequence[Task], workers: int, on_row: OnRow) -> None:
    """Plan the tasks on a pool of `workers` processes (spawned: a fork would copy the
    parent's threads' locks)."""
    pending = budget_groups(tasks)
    tries = dict.fromkeys((group[0].key for group in pending), 0)
    context = multiprocessing.get_context("spawn")
    while pending:
        lost: list[list[Task]] = []
        with futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            running = {pool.submit(plan_points, group): group for group in pending}
            for done in futures.as_completed(running):
                group = running[done]
                try:
                    rows = done.result()
                except futures.process.BrokenProcessPool:
                    lost.append(group)
                    continue
                for row in rows:
                    on_row(row)
        pending = []
        for group in lost:
            tries[group[0].key] += 1
            if tries[group[0].key] > RETRIES:
                for task in group:
                    on_row(_lost_row(task))
            else:
                pending.append(group)


def _lost_row(task: Task) -> dict[str, Any]:
    return {"key": task.key, "point": task.point.to_json(), "devices": task.point.devices,
            "status": "error", "error": f"the worker planning it was lost {RETRIES + 1} times",
            "wall_s": 0.0, "cpu_s": 0.0}  # fmt: skip


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
        remote = ray.remote(max_retries=RETRIES, retry_exceptions=False)(plan_points)
        refs = {remote.remote(group): group for group in budget_groups(tasks)}
        waiting = list(refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            try:
                rows = ray.get(ready[0])
            except ray.exceptions.RayError:  # its worker lost past the retries
                rows = [_lost_row(task) for task in refs[ready[0]]]
            for row in rows:
                on_row(row)
    finally:
        ray.shutdown()

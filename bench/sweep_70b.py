"""Time a sweep of the shape-only Llama-3-70B training step, each point planned alone (as
before budgets shared a search) and with the budgets of a point sharing one (`search.shared`).

    python bench/sweep_70b.py [--devices 64-1024] [--max-axes 4] [--mesh 8x8,4x16]
                              [--memory 40GiB,60GiB,80GiB] [--batch 4,8] [--time-limit 600]
                              [--ways alone,shared,alone-pool,shared-pool] [--workers 2]

The issue's grid is every mesh shape the search takes (`--max-axes`, default the search's
limit) of 64 to 1,024 H100s (dgx-h100 links), three budgets and two batch sizes (seq 2048,
bf16-mixed Adam, recompute as the search decides); its point count is printed first. The
points planned are those of `--mesh` where given (a sample: a point costs seconds of CPU),
else the whole grid. `alone` and `shared` plan the points in this process, in the sweep's
order, the imports kept as a sweep's worker keeps them: `alone` each point by itself,
`shared` each group of points differing in budget alone, largest budget first (what a sweep
worker does now). `alone-pool` and `shared-pool` plan them on a pool of `--workers`
processes: each point a task of its own (the sweep's pool before), or each group a task
(`run_local`). Per way: points, wall and CPU seconds in all (the pool's included), the
median point's CPU seconds, and the points whose plan (status, step time, memory, plan hash)
the first way found too. Run each way in a process of its own (`--ways alone`, then `--ways
shared`) to compare them cold: a process keeps caches of what it planned.

Figures (2-core machine shared with other jobs, CPU seconds):
- The grid: 2,130 points, 355 meshes (5 of one axis, 35 of two, 110 of three, 205 of four)
  x 3 budgets x 2 batches: 710 groups of points differing in budget alone (one search each).
- `--mesh 8x8,4x16` (12 points, load 10-25): each point alone 177.7 s (median 11.3),
  budgets sharing a search 107.2 (8.6); free budgets 1-1.8 s, binding 40 GiB 7-32 s.
- `--mesh 4x4x2x2,64 --ways shared` (load 15-18): the first point (4x4x2x2, 80 GiB, batch
  4) spent 288 s building its problem (pricing reshards: `reshard.planner._plan`, one path
  search per pair of shardings where their states are too many for `basis.step_graph`) and
  passed its 600 s wall limit there, no plan; stopped after 39 min wall. Four-axis meshes are
  58 % of the grid: their problems alone are at least 205 x 2 x 288 s, about 33 CPU hours.
  The grid does not finish in minutes on two cores: the reshard pricing of four-axis meshes
  must become tables first.
- A binding budget builds every rung of `--recompute auto`'s ladder (5-6 steps); a worker kept
  4 graphs, so each next budget imported the model and built its problems again (a 4-layer
  decoder on 2x2, budgets 1GiB..2MB: imports 1,1,2,3,3); now 1 (`points.RUNGS`).
  `--mesh 8x8 --batch 4 --ways shared` (no budget binds): 12.6 s before, 12.5 after (the
  first budget 9.4-9.6 s, the others 1.5 s each, the plan found before).
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import multiprocessing
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import onnx

from autoshard.limits import MAX_SEARCH_AXES
from autoshard.sweep.executors import run_local
from autoshard.sweep.grid import device_counts, expand, meshes
from autoshard.sweep.points import Task, budget_groups, plan_point, plan_points

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "models"))

from make_models import build_decoder_shape_only  # noqa: E402

SHAPE = dict(hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)  # Llama-3-70B
SAME = ("status", "step_time_s", "memory_bytes_per_device", "plan_sha256")


def tasks_of(args: argparse.Namespace, model: Path) -> tuple[int, list[Task]]:
    """The issue's grid's point count, and the tasks planned."""
    batches = [int(b) for b in args.batch.split(",")]
    budgets = args.memory.split(",")
    grid = meshes(device_counts(args.devices), [], args.max_axes)
    swept = args.mesh.split(",") if args.mesh else grid
    points = expand(swept, ["dgx-h100"], [None], budgets, {"batch": batches, "seq": [2048]},
                    "training", {})  # fmt: skip
    tasks = [Task(key=str(p), point=p, model=str(model), objective="time",
                  time_limit=args.time_limit) for p in points]  # fmt: skip
    return len(grid) * len(budgets) * len(batches), tasks


def _alone(task: Task) -> dict[str, Any]:
    return plan_point(task, None)


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def run(way: str, tasks: list[Task], workers: int) -> tuple[list[dict[str, Any]], float, float]:
    """The rows of `tasks` planned `way`, with the wall and CPU seconds of it all (its pool's
    processes' included)."""
    wall, cpu, children = time.perf_counter(), time.process_time(), _children_cpu()
    rows: list[dict[str, Any]] = []
    if way == "alone":
        rows = [_alone(task) for task in tasks]
    elif way == "shared":
        rows = [row for group in budget_groups(tasks) for row in plan_points(group)]
    elif way == "alone-pool":  # the sweep's pool as it was: each point a task of its own
        context = multiprocessing.get_context("spawn")
        with futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            rows = list(pool.map(_alone, tasks))
    elif way == "shared-pool":  # the sweep's pool (`run_local`): a group of budgets a task
        run_local(tasks, workers, rows.append)
    else:
        raise SystemExit(f"unknown way {way!r}: alone, shared, alone-pool, shared-pool")
    used = time.process_time() - cpu + _children_cpu() - children
    return rows, time.perf_counter() - wall, used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", default="64-1024")
    parser.add_argument("--max-axes", type=int, default=MAX_SEARCH_AXES)
    parser.add_argument("--mesh", default="8x8,4x16", help="the points planned ('': the grid)")
    parser.add_argument("--memory", default="40GiB,60GiB,80GiB")
    parser.add_argument("--batch", default="4,8")
    parser.add_argument("--time-limit", type=float, default=600.0)
    parser.add_argument(
        "--ways",
        default="alone,shared",
        help="alone, shared (in this process), alone-pool, shared-pool",
    )
    parser.add_argument("--workers", type=int, default=2, help="the pools' processes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "70b.onnx"
        onnx.save(build_decoder_shape_only(80, **SHAPE).proto, model)  # type: ignore[arg-type]
        total, tasks = tasks_of(args, model)
        print(f"the grid: {total} points; planned here: {len(tasks)}", flush=True)
        found: dict[str, dict[str, tuple[Any, ...]]] = {}
        print(f"{'way':8} {'points':>6} {'wall s':>8} {'cpu s':>8} {'median cpu s':>13} "
              f"{'same':>5}", flush=True)  # fmt: skip
        for way in args.ways.split(","):
            rows, wall, cpu = run(way, tasks, args.workers)
            found[way] = {row["key"]: tuple(row.get(k) for k in SAME) for row in rows}
            other = next((f for w, f in found.items() if w != way), found[way])
            same = sum(other[k] == v for k, v in found[way].items())
            median = statistics.median(row["cpu_s"] for row in rows)
            print(f"{way:8} {len(rows):>6} {wall:>8.1f} {cpu:>8.1f} {median:>13.2f} "
                  f"{same:>5}", flush=True)  # fmt: skip
            for row in rows:
                print(f"    {row['point']['mesh']:>6} {row['point']['memory']:>6} "
                      f"batch={row['point']['dims']['batch']} {row['status']:>10} "
                      f"{row['cpu_s']:>7.2f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

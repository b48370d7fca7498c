"""`autoshard sweep`: its flags and the command (`autoshard.sweep` does the work)."""

from __future__ import annotations

import argparse
import enum
import os
import sys
from pathlib import Path
from typing import Any

from autoshard.cli.flags import MESH_NAMES, Parser, progress_flags
from autoshard.search.options import Objective
from autoshard.training.options import Attention, Optimizer, Precision, Recompute

LISTS = "comma-separated: each value is a point of the grid"
TRAINING_CHOICES: dict[str, type[enum.StrEnum] | None] = {
    "optimizer": Optimizer, "precision": Precision, "micro-batches": None,
    "recompute": Recompute, "attention": Attention,
}  # fmt: skip
"""The training flags a sweep takes lists of, and the choices each value has."""


def add_sweep_command(commands: Any) -> None:
    sweep: Parser = commands.add_parser(
        "sweep", help="plan a model over a grid of meshes, clusters, budgets and batches"
    )
    sweep.add_argument("model", help="path to an .onnx file")
    sweep.add_argument(
        "-o",
        "--out",
        required=True,
        metavar="OUT",
        help="output folder (results.jsonl, points.csv, points.json, front.html); "
        "a sweep given the same folder again plans only the points it lacks",
    )
    grid = sweep.add_argument_group("the grid")
    grid.add_argument(
        "--devices",
        help="device counts, e.g. 64,128,256, or 32-256 (every power "
        "of two); each planned on every mesh of at most --max-axes axes",
    )
    grid.add_argument(
        "--mesh", help=f"meshes instead of --devices, e.g. 8x8,4x16 ({LISTS}); {MESH_NAMES}"
    )
    grid.add_argument(
        "--max-axes",
        type=int,
        help="most axes of a factorised mesh (default and "
        "largest: the search's limit, MAX_SEARCH_AXES)",
    )
    grid.add_argument("--cluster", help=f"cluster presets or files, e.g. dgx-h100,selene ({LISTS})")
    grid.add_argument("--device", help=f"device presets ({LISTS})")
    grid.add_argument("--memory", help=f"memory budgets per device, e.g. 40GiB,80GiB ({LISTS})")
    grid.add_argument(
        "--dim",
        action="append",
        metavar="NAME=SIZES",
        help="bind a symbolic dim to sizes, e.g. batch=256,512 (repeatable)",
    )
    train = sweep.add_argument_group("training step (with --mode training; each a list)")
    train.add_argument("--mode", default="inference", help="inference (default) or training")
    for name, kind in TRAINING_CHOICES.items():
        choices = ", ".join(m.value for m in kind) if kind else "counts, e.g. 1,4"
        train.add_argument(f"--{name}", help=f"as autoshard plan's --{name}: {choices} ({LISTS})")
    run = sweep.add_argument_group("each plan and where it runs")
    run.add_argument("--objective", choices=[str(o) for o in Objective], default="time")
    run.add_argument(
        "--time-limit",
        type=float,
        default=60.0,
        help="seconds each point's plan may take (default 60)",
    )
    run.add_argument(
        "--executor",
        choices=("local", "ray"),
        help="local: a process pool; ray: Ray tasks (default where Ray is installed)",
    )
    _pipeline_flags(sweep)
    run.add_argument("--workers", type=int, help="points planned at once (default: the CPUs)")
    run.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="plan on this Ray cluster (default: a local Ray the sweep starts)",
    )
    run.add_argument(
        "--price-per-device-hour",
        type=float,
        metavar="PRICE",
        help="price a device-hour: the cost front and a cost column",
    )
    run.add_argument("--limit", type=int, metavar="N", help="plan at most N points this run")
    progress_flags(sweep)
    sweep.set_defaults(run=cmd_sweep, dump_after=None)


def _pipeline_flags(sweep: Parser) -> None:
    group = sweep.add_argument_group("pipeline (with --mode training; for every point)")
    group.add_argument(
        "--pipeline-axis",
        metavar="N",
        help="pipeline the repeated layers over this axis of every mesh (with --mode training)",
    )
    group.add_argument(
        "--pipeline", choices=("auto", "none"), default="none",
        help="auto: every mesh of two axes or more is also planned pipelined over its first "
        "axis (named pp), where the model has as many repeated layers as that axis has devices",
    )  # fmt: skip
    group.add_argument(
        "--global-batch",
        metavar="DIM",
        help="read the grid's --dim DIM sizes as global batches: each split into micro-batches "
        "(--micro-batches, or with --pipeline-axis the search's choice of divisors)",
    )
    group.add_argument(
        "--schedule", metavar="NAME",
        help="the pipeline's schedule: 1f1b (default), gpipe, interleaved[:V]",
    )  # fmt: skip


def _list(text: str | None) -> list[Any]:
    return [None] if text is None else [v.strip() for v in text.split(",") if v.strip()]


def _sweep_of(args: argparse.Namespace) -> Any:
    from autoshard.cost.schedule import Schedule
    from autoshard.limits import MAX_SEARCH_AXES
    from autoshard.sweep.executors import default_executor
    from autoshard.sweep.grid import SweepError, device_counts, expand, meshes
    from autoshard.sweep.run import Sweep

    if args.schedule is not None:
        Schedule.parse(args.schedule)  # a bad name is the command's error, not every point's
        if args.pipeline_axis is None and args.pipeline != "auto":
            raise SweepError(f"--schedule {args.schedule} orders a pipeline: give "
                             "--pipeline-axis or --pipeline auto")  # fmt: skip
    max_axes = args.max_axes or MAX_SEARCH_AXES
    if not 1 <= max_axes <= MAX_SEARCH_AXES:
        raise SweepError(f"--max-axes {max_axes}: choose 1..{MAX_SEARCH_AXES} (MAX_SEARCH_AXES)")
    if args.ray_address and args.executor == "local":
        raise SweepError("--ray-address runs on Ray: drop --executor local")
    if args.devices and args.mesh:
        raise SweepError("give --devices or --mesh, not both")
    counts = device_counts(args.devices) if args.devices else []
    grid_meshes = meshes(counts, _list(args.mesh) if args.mesh else [], max_axes)
    dims: dict[str, list[int]] = {}
    for text in args.dim or ():
        name, _, sizes = text.partition("=")
        try:
            dims[name.strip()] = [int(s) for s in sizes.split(",") if s.strip()]
        except ValueError:
            raise SweepError(f"--dim {text!r} is not NAME=SIZES (e.g. batch=256,512)") from None
        if not name.strip() or not dims[name.strip()] or min(dims[name.strip()]) < 1:
            raise SweepError(f"--dim {text!r} is not NAME=SIZES of sizes >= 1 (e.g. batch=256,512)")
    if args.global_batch is not None and args.global_batch not in dims:
        raise SweepError(f"--global-batch {args.global_batch} names no --dim of the grid: give "
                         f"--dim {args.global_batch}=SIZES")  # fmt: skip
    if args.pipeline == "auto":
        grid_meshes = _with_pipelines(args, grid_meshes, dims)
    training = {
        n: _list(getattr(args, n))
        for n in ("optimizer", "precision", "micro_batches", "recompute", "attention")
        if getattr(args, n) is not None
    }
    points = expand(
        grid_meshes,
        _list(args.cluster),
        _list(args.device),
        _list(args.memory),
        dims,
        args.mode,
        training,
    )
    _check(points, grid_meshes[0])
    workers = args.workers or os.cpu_count() or 1
    if workers < 1 or (args.limit is not None and args.limit < 0):
        raise SweepError("--workers must be at least 1 and --limit at least 0")
    return Sweep(
        model=Path(args.model),
        points=tuple(points),
        out=Path(args.out),
        objective=args.objective,
        time_limit=args.time_limit,
        executor=args.executor or ("ray" if args.ray_address else default_executor()),
        workers=workers,
        ray_address=args.ray_address,
        price=args.price_per_device_hour,
        limit=args.limit,
        pipeline_axis=args.pipeline_axis,
        schedule=args.schedule,
        global_batch=args.global_batch,
    )


def _with_pipelines(
    args: argparse.Namespace, grid_meshes: list[str], dims: dict[str, list[int]]
) -> list[str]:
    """`--pipeline auto`'s meshes (`grid.with_pipelines`), for the model's repeated layers
    (imported at the grid's first dims)."""
    from autoshard.analysis.shorten import layer_run
    from autoshard.pipeline import load_graph
    from autoshard.sweep.grid import SweepError, with_pipelines

    if args.mode != "training":
        raise SweepError("--pipeline auto pipelines a training step: add --mode training")
    if args.pipeline_axis is not None:
        raise SweepError("give --pipeline auto or --pipeline-axis, not both")
    run = layer_run(load_graph(args.model, {n: sizes[0] for n, sizes in dims.items()}, None))
    return with_pipelines(grid_meshes, run.count if run is not None else 0)


def _check(points: list[Any], mesh: str) -> None:
    """Every cluster, budget and training step of the grid made once up front, so a bad one
    is the command's error, not every point's."""
    from autoshard.cost.cluster import make_cluster
    from autoshard.cost.devices import CLUSTERS
    from autoshard.sweep.grid import SweepError
    from autoshard.training.options import requested

    seen = set()
    for point in points:
        key = (point.cluster, point.device, point.memory, point.mode, point.training)
        if key in seen:
            continue
        seen.add(key)
        if point.cluster and point.cluster not in CLUSTERS and not Path(point.cluster).exists():
            raise SweepError(
                f"unknown cluster {point.cluster!r}: a preset ({', '.join(CLUSTERS)}) or a file"
            )
        make_cluster(mesh, point.device, None, None, point.memory, point.cluster)
        requested(
            point.mode,
            dict(point.training),
            lambda n: "--" + n.replace("_", "-"),
            "--mode training",
        )


def cmd_sweep(args: argparse.Namespace) -> int:
    from autoshard.sweep.run import run_sweep

    sweep = _sweep_of(args)

    def tell(line: str) -> None:  # a line per point: few enough to show from the start
        if not args.quiet:
            print(f"autoshard: {line}", file=sys.stderr, flush=True)

    outcome = run_sweep(sweep, tell)
    ok = sum(row["status"] == "ok" for row in outcome.rows)
    print(
        f"sweep of {sweep.model.name}: {len(outcome.rows)} of {len(sweep.points)} points done "
        f"({outcome.planned} planned now, {outcome.resumed} before), {ok} with a plan"
        + (f"; {outcome.left} left (--limit)" if outcome.left else "")
    )
    for name in ("points.csv", "points.json", "front.html"):
        print(f"written {sweep.out / name}")
    return 0

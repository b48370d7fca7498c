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
        help="the pipeline's schedule: 1f1b (default), gpipe, interleaved[:V], zb-h1",
    )  # fmt: skip


def _sweep_of(args: argparse.Namespace) -> Any:
    from autoshard.sweep.ask import SweepAsk, sweep_of
    from autoshard.sweep.executors import default_executor
    from autoshard.sweep.grid import SweepError

    if args.ray_address and args.executor == "local":
        raise SweepError("--ray-address runs on Ray: drop --executor local")
    dims: dict[str, list[int]] = {}
    for text in args.dim or ():
        name, _, sizes = text.partition("=")
        try:
            dims[name.strip()] = [int(s) for s in sizes.split(",") if s.strip()]
        except ValueError:
            raise SweepError(f"--dim {text!r} is not NAME=SIZES (e.g. batch=256,512)") from None
        if not name.strip() or not dims[name.strip()] or min(dims[name.strip()]) < 1:
            raise SweepError(f"--dim {text!r} is not NAME=SIZES of sizes >= 1 (e.g. batch=256,512)")
    return sweep_of(SweepAsk(
        model=Path(args.model), out=Path(args.out), devices=args.devices, mesh=args.mesh,
        max_axes=args.max_axes, cluster=args.cluster, device=args.device, memory=args.memory,
        dims=dims, mode=args.mode,
        training={name.replace("-", "_"): getattr(args, name.replace("-", "_"))
                  for name in TRAINING_CHOICES},
        objective=args.objective, time_limit=args.time_limit,
        executor=args.executor or ("ray" if args.ray_address else default_executor()),
        workers=args.workers or os.cpu_count() or 1, ray_address=args.ray_address,
        price=args.price_per_device_hour, limit=args.limit, pipeline_axis=args.pipeline_axis,
        pipeline=args.pipeline, schedule=args.schedule, global_batch=args.global_batch,
    ))  # fmt: skip


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

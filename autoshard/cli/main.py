"""The `autoshard` command: its parser (one subcommand per `cmd_*`) and `main`."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable, Sequence

from autoshard import __version__
from autoshard.cli.calibrate import cmd_calibrate
from autoshard.cli.commands import (
    cmd_diff,
    cmd_explain,
    cmd_html,
    cmd_inspect,
    cmd_layout,
    cmd_partition,
    cmd_plan,
    cmd_propagate,
    cmd_report,
    cmd_reshard,
    cmd_run,
    cmd_serve,
    cmd_verify,
)
from autoshard.cli.export import cmd_export
from autoshard.cli.flags import (
    EXIT_USAGE,
    MESH_NAMES,
    IntermixedParser,
    Parser,
    cluster_flags,
    dim_flag,
    html_flags,
    model_flags,
    pipeline_flags,
    progress_flags,
    run_flags,
    shape_flag,
    training_flags,
)
from autoshard.cli.solve import cmd_solve
from autoshard.cli.sweep import add_sweep_command
from autoshard.errors import AutoshardError
from autoshard.mlir.syntax import Dialect
from autoshard.search.options import Objective

Commands = argparse._SubParsersAction  # the subparsers of `autoshard`


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="autoshard", description="Auto-sharding planner for ML models.")
    parser.add_argument("--version", action="version", version=f"autoshard {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add_command in COMMANDS:
        add_command(commands)
    return parser


def _inspect_command(commands: Commands) -> None:
    inspect = commands.add_parser("inspect", help="summarize an ONNX model")
    inspect.add_argument("model", help="path to an .onnx file")
    inspect.add_argument(
        "--dim", action="append", type=dim_flag, metavar="NAME=SIZE", help="bind a symbolic dim"
    )
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(run=cmd_inspect)


def _propagate_command(commands: Commands) -> None:
    propagate = commands.add_parser(
        "propagate", help="complete shardings from annotations and list the collectives"
    )
    model_flags(propagate)
    propagate.add_argument("--json", action="store_true", help="machine-readable output")
    cluster_flags(propagate)
    training_flags(propagate)
    propagate.add_argument(
        "--emit",
        choices=("summary", "mlir"),
        default="summary",
        help="mlir: print the sharded program as MLIR instead of the summary",
    )
    propagate.add_argument(
        "--dialect",
        choices=[str(d) for d in Dialect],
        default=str(Dialect.MESH),
        help="MLIR spelling for --emit mlir: the mesh dialect or upstream LLVM 22's shard",
    )
    html_flags(propagate)
    propagate.set_defaults(run=cmd_propagate)


def _plan_command(commands: Commands) -> None:
    plan = commands.add_parser("plan", help="search the cheapest sharding plan (CP-SAT)")
    model_flags(plan, mesh_from="in --cluster")
    cluster_flags(plan)
    training_flags(plan)
    pipeline_flags(plan)
    plan.add_argument(
        "--objective", choices=[str(o) for o in Objective], default=str(Objective.TIME),
        help="minimize compute + communication time (default) or communication bytes",
    )  # fmt: skip
    plan.add_argument(
        "--time-limit", type=float, default=60.0,
        help="seconds of wall clock the command may take, from its start (default 60): where "
        "they run out the best plan found so far is the answer (FEASIBLE, with its gap), and "
        "'no plan' only where none was found. Also the solver's budget in CP-SAT's "
        "deterministic seconds, which make the same plan on every run while the wall clock "
        "does not bind",
    )  # fmt: skip
    plan.add_argument("-o", "--out", metavar="PLAN.json", help="write the plan JSON here")
    plan.add_argument("--json", action="store_true", help="print the plan JSON")
    progress_flags(plan)
    html_flags(plan)
    plan.set_defaults(run=cmd_plan)


def _calibrate_command(commands: Commands) -> None:
    calibrate = commands.add_parser(
        "calibrate", help="measure this machine's device and write a cluster file for plan"
    )
    calibrate.add_argument(
        "-o", "--out", default="cluster.json", metavar="FILE", help="default cluster.json"
    )
    calibrate.add_argument("--quick", action="store_true", help="small shapes, about 2 s")
    calibrate.add_argument(
        "--ranks", type=int, metavar="N",
        help="local processes to time collectives over (default: one per GPU, 4 on CPU; "
        "0: links not measured)",
    )  # fmt: skip
    calibrate.add_argument(
        "--backend", choices=("gloo", "nccl"), help="default nccl with GPUs, else gloo"
    )
    calibrate.add_argument(
        "--torch", action="store_true",
        help="measure torch's kernels (bfloat16 on a CUDA GPU, else float32 on the CPU) "
        "instead of onnxruntime's",
    )  # fmt: skip
    calibrate.add_argument("--json", action="store_true", help="print the cluster file")
    calibrate.set_defaults(run=cmd_calibrate)


def _reshard_command(commands: Commands) -> None:
    reshard = commands.add_parser(
        "reshard", help="the collectives that turn one sharding of a tensor into another"
    )
    reshard.add_argument("--mesh", required=True, help="device mesh, e.g. 2x2x2")
    reshard.add_argument("--shape", required=True, type=shape_flag, help="tensor shape, e.g. 4x4")
    reshard.add_argument("--from", dest="source", required=True, help="e.g. '[[0], [1, 2]]'")
    reshard.add_argument("--to", dest="target", required=True, help="e.g. '[[0, 1], [2]]'")
    reshard.add_argument(
        "--itemsize", type=int, default=4, help="bytes per element (default 4: float32)"
    )
    reshard.add_argument("--json", action="store_true", help="machine-readable output")
    reshard.set_defaults(run=cmd_reshard)


def _partition_command(commands: Commands) -> None:
    partition = commands.add_parser(
        "partition", help="write each device's program and weights (SPMD IR, safetensors)"
    )
    model_flags(partition, mesh_from="the plan's, with --plan")
    partition.add_argument(
        "--plan",
        metavar="PLAN.json",
        help="partition this plan (from autoshard plan -o); without --mesh or --dim, its own",
    )
    partition.add_argument("-o", "--out", required=True, metavar="OUT", help="output folder")
    partition.add_argument(
        "--dialect",
        choices=[str(d) for d in Dialect],
        default=str(Dialect.MESH),
        help="MLIR spelling of OUT/spmd.mlir: the mesh dialect or upstream LLVM 22's shard",
    )
    partition.add_argument(
        "--forward", action="store_true",
        help="a pipelined plan: write its forward only (run against onnxruntime), not its "
        "training step",
    )  # fmt: skip
    partition.add_argument("--json", action="store_true", help="machine-readable output")
    training_flags(partition)
    progress_flags(partition)
    partition.set_defaults(run=cmd_partition)


def _verify_command(commands: Commands) -> None:
    verify = commands.add_parser(
        "verify", help="run a partition on all devices and compare with onnxruntime"
    )
    verify.add_argument("out", metavar="OUT", help="folder written by autoshard partition")
    verify.add_argument("--model", required=True, help="the .onnx file it was made from")
    verify.add_argument(
        "--dim",
        action="append",
        type=dim_flag,
        metavar="NAME=SIZE",
        help="must agree with the partition's dims (they are in its manifest)",
    )
    verify.add_argument("--inputs", metavar="NPZ", help="inputs by name (default: seeded random)")
    verify.add_argument(
        "--rtol",
        type=float,
        help="relative tolerance (default 1e-5 for float32, 1e-2 for 16-bit floats)",
    )
    verify.add_argument(
        "--steps",
        type=int,
        default=3,
        metavar="N",
        help="a training step's partition: train N steps against PyTorch autograd (default 3)",
    )
    verify.add_argument(
        "--distributed",
        action="store_true",
        help="run as one process per device on torch.distributed (autoshard run), not in-process",
    )
    verify.add_argument(
        "--float64",
        action="store_true",
        help="a training step's partition: compute it in float64, to tell a plan's error from "
        "float32 rounding",
    )
    run_flags(verify)
    _loss_flag(verify)
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.set_defaults(run=cmd_verify)


def _loss_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--loss", help="a training step's partition: the loss it trains, which must be the "
        "one it was planned with (its manifest's; default: that one)",
    )  # fmt: skip


def _run_command(commands: Commands) -> None:
    run = commands.add_parser(
        "run", help="run a partition as one process per device on torch.distributed"
    )
    run.add_argument("out", metavar="OUT", help="folder written by autoshard partition")
    run.add_argument("--inputs", metavar="NPZ", help="inputs by name (default: seeded random)")
    run.add_argument(
        "--check",
        metavar="MODEL",
        help="compare the outputs with onnxruntime on this model (a training step's partition: "
        "train it against PyTorch autograd on this model; required)",
    )
    run.add_argument(
        "--steps",
        type=int,
        default=3,
        metavar="N",
        help="a training step's partition: train N steps (default 3)",
    )
    run.add_argument(
        "--dim",
        action="append",
        type=dim_flag,
        metavar="NAME=SIZE",
        help="must agree with the partition's dims (they are in its manifest)",
    )
    run.add_argument(
        "--float64",
        action="store_true",
        help="a training step's partition: compute it in float64, to tell a plan's error from "
        "float32 rounding",
    )
    run_flags(run)
    _loss_flag(run)
    run.add_argument("--json", action="store_true", help="machine-readable output")
    run.set_defaults(run=cmd_run)


def _layout_command(commands: Commands) -> None:
    layout = commands.add_parser("layout", help="draw which device holds which part of a tensor")
    layout.add_argument(
        "--mesh", required=True, help=f"device mesh, e.g. 2x3 or dp=2,tp=3; {MESH_NAMES}"
    )
    layout.add_argument("--shape", required=True, type=shape_flag, help="tensor shape, e.g. 4x6")
    layout.add_argument("--sharding", required=True, help="e.g. '[[], [0, 1]]'")
    layout.add_argument("--json", action="store_true", help="machine-readable output")
    layout.set_defaults(run=cmd_layout)


def _report_command(commands: Commands) -> None:
    report = commands.add_parser(
        "report", help="compare plans with baseline plans: the CI cost-regression report"
    )
    report.add_argument("--baseline", required=True, help="plan JSON file or directory of them")
    report.add_argument("--current", required=True, help="plan JSON file or directory of them")
    report.add_argument(
        "--threshold", default="2%", help="relative change that counts (default 2%%)"
    )
    report.add_argument("--markdown", metavar="OUT.md", help="also write the Markdown report")
    report.add_argument("--json", action="store_true", help="print the comparison as JSON")
    report.set_defaults(run=cmd_report)


def _diff_command(commands: Commands) -> None:
    diff = commands.add_parser(
        "diff", help="what changed between two plans: shardings by layer, collectives, costs"
    )
    diff.add_argument("a", metavar="A.json", help="the plan to compare from")
    diff.add_argument("b", metavar="B.json", help="the plan to compare to")
    diff.add_argument("--json", action="store_true", help="print the diff as JSON")
    diff.set_defaults(run=cmd_diff)


def _html_command(commands: Commands) -> None:
    html = commands.add_parser(
        "html", help="a saved plan's HTML report (what autoshard plan --html writes)"
    )
    html.add_argument("plan", metavar="PLAN.json", help="a plan from autoshard plan -o")
    html.add_argument(
        "--model", help="the .onnx file of the plan (default: its model.file beside the plan)"
    )
    html.add_argument(
        "--tensor", action="append", metavar="VALUE",
        help="also draw this tensor's layout (repeatable; the largest weight is always drawn)",
    )  # fmt: skip
    html.add_argument("-o", "--out", required=True, metavar="REPORT.html", help="write it here")
    html.set_defaults(run=cmd_html)


def _explain_command(commands: Commands) -> None:
    explain = commands.add_parser(
        "explain", help="why a plan shards a value or op so, and why not another sharding"
    )
    explain.__class__ = IntermixedParser  # `explain PLAN --model M NAME`: NAME after an option
    explain.add_argument("plan", metavar="PLAN.json", help="a plan from autoshard plan -o")
    explain.add_argument(
        "name", nargs="?", metavar="VALUE_OR_OP", help="the value or op to explain"
    )
    explain.add_argument(
        "--model", help="the .onnx file of the plan (default: its model.file beside the plan)"
    )
    explain.add_argument(
        "--why-not", metavar="NAME=SHARDING",
        help="solve again with value NAME produced so (or op NAME computing with that option) "
        "and compare: CHOSEN CHEAPER, TARGET CHEAPER, SAME COST or INFEASIBLE",
    )  # fmt: skip
    explain.add_argument("-o", "--out", metavar="TARGET.json", help="write the --why-not plan")
    cluster_flags(explain)
    explain.add_argument("--json", action="store_true", help="machine-readable output")
    explain.set_defaults(run=cmd_explain)


def _export_command(commands: Commands) -> None:
    export = commands.add_parser(
        "export", help="a plan as DTensor placements, JAX PartitionSpecs or ONNX sharding"
    )
    export.add_argument("plan", metavar="PLAN.json", help="a plan from autoshard plan -o")
    export.add_argument(
        "--to", required=True, choices=["dtensor", "jax", "onnx"],
        help="dtensor: -o writes an apply_plan(model, mesh) module; jax: the PartitionSpecs "
        "JSON; onnx: the model with IR v11 sharding metadata",
    )  # fmt: skip
    export.add_argument(
        "--model", help="the .onnx file of the plan (default: its model.file beside the plan)"
    )
    export.add_argument(
        "--checkpoint", metavar="FILE",
        help="the source model's weights (.safetensors or a torch state_dict): names by content",
    )  # fmt: skip
    export.add_argument("-o", "--out", metavar="OUT", help="write the export here")
    export.add_argument("--json", action="store_true", help="print the export as JSON")
    export.set_defaults(run=cmd_export)


def _serve_command(commands: Commands) -> None:
    serve = commands.add_parser("serve", help="run the REST service (FastAPI on uvicorn)")
    serve.add_argument("--host", default="127.0.0.1", help="address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument(
        "--data", default="autoshard-data", help="folder of the job store and uploaded models"
    )
    serve.add_argument("--max-upload", default="2GiB", help="largest model upload (default 2GiB)")
    serve.add_argument(
        "--workers", type=int, help="concurrent solves (default: the number of CPUs)"
    )
    serve.add_argument(
        "--max-time-limit", type=float, default=600.0,
        help="largest time_limit a request may ask for, seconds (default 600)",
    )  # fmt: skip
    serve.add_argument(
        "--database", metavar="URL",
        help="the job store: postgresql://USER:PASSWORD@HOST/DB, shared by API replicas "
        "(pip install 'autoshard[postgres]'), or sqlite:///PATH (default: DATA/jobs.sqlite3)",
    )  # fmt: skip
    serve.add_argument(
        "--executor", default="local",
        help="where jobs run: local (a process pool, default), ray (a local Ray) or "
        "ray://HOST:PORT (a Ray cluster; pip install 'autoshard[cluster]')",
    )  # fmt: skip
    serve.add_argument(
        "--lease", type=float, default=30.0, metavar="S",
        help="a running job whose replica is silent this long is queued again (default 30)",
    )  # fmt: skip
    serve.set_defaults(run=cmd_serve)


def _solve_command(commands: Commands) -> None:
    solve = commands.add_parser(
        "solve", help="solve an IOPDDL contest problem (ASPLOS 2025) with the planner's solver"
    )
    solve.add_argument("problem", metavar="PROBLEM.json[.gz]", help="a contest problem file")
    solve.add_argument(
        "--time-limit", type=float, default=60.0,
        help="seconds of wall clock, reading the problem included: the best solution found "
        "by then, a greedy one at least (default 60)",
    )  # fmt: skip
    solve.add_argument(
        "-o", "--out", metavar="SOLUTION.json",
        help="write the solution here (the contest's list of strategy indices); without it, "
        "print it as the last line",
    )  # fmt: skip
    solve.set_defaults(run=cmd_solve)


COMMANDS: tuple[Callable[[Commands], None], ...] = (
    _inspect_command,
    _propagate_command,
    _plan_command,
    add_sweep_command,
    _calibrate_command,
    _reshard_command,
    _partition_command,
    _verify_command,
    _run_command,
    _layout_command,
    _report_command,
    _diff_command,
    _html_command,
    _explain_command,
    _export_command,
    _solve_command,
    _serve_command,
)
"""Each subcommand's parser, in the order `--help` lists them."""


GC_THRESHOLD = 100_000
"""Allocations between the collector's young-generation passes while a command runs (Python's
default: 700). A plan's graph, rows and program are millions of small objects that live to the
end; at the default every pass over the older generations walks them again for no garbage."""


def main(argv: Sequence[str] | None = None) -> int:
    threshold = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD, *threshold[1:])
    try:
        args = build_parser().parse_args(argv)
        return int(args.run(args))
    except AutoshardError as error:
        print(f"autoshard: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("autoshard: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head`: the reader has all it wanted
        # Python's recipe: point stdout at devnull so the flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    finally:
        gc.set_threshold(*threshold)  # (`main` runs inside other programs' processes too)


if __name__ == "__main__":
    sys.exit(main())

"""The `autoshard` command line: parses flags, calls the library, formats results.

Every user error ends as one line on stderr (`autoshard: error: ...`) and exit code 2; no
traceback reaches the user for bad input. Every command takes `--json` for machine output.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoshard.cli.flags import (
    PROGRESS_DELAY_S,
    dims_of,
)
from autoshard.cli.pipelined import is_pipelined, partition_pipelined, run_pipelined_forward
from autoshard.cli.summaries import (
    breakdown_summary,
    cost_summary,
    objective_note,
    pipeline_summary,
    print_checks,
    print_training,
)
from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.passes import Stage
from autoshard.search.options import Objective
from autoshard.sharding import Sharding

if TYPE_CHECKING:  # the pipeline is imported by the commands that run it, not at startup
    from autoshard.cost.cluster import Cluster
    from autoshard.document.plan_document import PlanDocument
    from autoshard.pipeline import AfterStage
    from autoshard.progress import Tracker


def emit(data: object) -> None:
    print(json.dumps(data, indent=2))


# ---- commands ---------------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
    from autoshard.ir.summary import format_summary, inspect_model

    summary = inspect_model(args.model, dims_of(args.dim))
    if args.json:
        emit(summary)
    else:
        print(format_summary(summary))
    return 0


def cmd_layout(args: argparse.Namespace) -> int:
    from autoshard.explain.layout import draw_layout, layout_json

    mesh = Mesh.parse(args.mesh)
    sharding = Sharding.parse(args.sharding).check(mesh, args.shape)
    if args.json:
        emit(layout_json(mesh, args.shape, sharding))
    else:
        print(draw_layout(mesh, args.shape, sharding))
    return 0


def cmd_propagate(args: argparse.Namespace) -> int:
    from autoshard.cost.price import price
    from autoshard.document.plan_document import model_info, plan_document
    from autoshard.names import parameter_names
    from autoshard.pipeline import propagated

    cluster = _cluster(args)
    mesh = cluster.mesh
    annotations = _annotations(args)
    partition = Stage.PARTITION in (args.dump_after or ())  # only to print it
    training = _training(args)
    lowered = propagated(
        args.model, dims_of(args.dim), mesh, annotations, _dump_after(args), partition, training
    )
    graph, result, program = lowered.graph, lowered.plan, lowered.program
    if args.emit == "mlir":
        from autoshard.mlir import print_program

        print(print_program(program, args.dialect), end="")
        return 0
    cost = price(program, graph, cluster, overlap=training.overlap if training else None)
    info = model_info(args.model, graph, dims_of(args.dim))
    document = plan_document(
        graph, cluster, result, program, cost, info, training=training,
        names=parameter_names(args.model),
    )  # fmt: skip
    if args.html:
        from autoshard.html import write_html

        write_html(args.html, _html_text(args, document, lowered))
    if args.json:
        emit(document.to_json())
        return 0
    print(
        f"model {graph.name} on mesh {mesh}: {len(graph.ops)} ops, {len(annotations)} annotations"
    )
    print(textwrap.fill(document.story or "", width=100))
    for name, op in document.ops.items():
        print(f"  {name} ({op.type}): {op.sharding_option or 'replicated (no rule)'}")
    collectives = document.collectives
    print(f"collectives: {len(collectives)}, {program.bytes_per_device} bytes per device")
    for c in collectives:
        print(
            f"  {c.value}: {c.kind} mesh_axes = {list(c.mesh_axes)}  {c.source} -> {c.target}"
            f"  ({c.bytes_per_device} B)"
        )
    if result.unruled:
        print(f"computed replicated (no rule): {', '.join(result.unruled)}")
    print(cost_summary(cost, cluster, document.ops))
    if args.html:
        print(f"report written to {args.html}")
    return 0


def _html_text(args: argparse.Namespace, document: PlanDocument, lowered: Any) -> str:
    """--html: the plan's HTML report, drawn from the plan just made."""
    from autoshard.html import plan_html

    return plan_html(document, args.model, args.html_tensor or (), lowered)


def _cluster(args: argparse.Namespace) -> Cluster:
    from autoshard.cost.cluster import make_cluster

    return make_cluster(
        args.mesh, args.device, args.bandwidth, args.latency, args.memory, args.cluster
    )


def _cluster_on(args: argparse.Namespace) -> Callable[[Mesh], Cluster] | None:
    """The cluster the flags give on a saved plan's mesh; None when no flag is given."""
    from autoshard.cost.cluster import make_cluster

    flags = (args.device, args.bandwidth, args.latency, args.memory, args.cluster)
    if flags == (None,) * len(flags):
        return None
    return lambda mesh: make_cluster(str(mesh), *flags)


def _training(args: argparse.Namespace) -> Any:
    """The training step the flags ask for (None: the forward pass)."""
    from autoshard.training.options import OPTIONS, requested

    given = {name: getattr(args, name) for name in OPTIONS}
    return requested(
        args.mode, given, lambda name: "--" + name.replace("_", "-"), "--mode training"
    )


def _pipeline(args: argparse.Namespace, mesh: Mesh) -> Any:
    """The pipeline the flags and the mesh's axis names ask for (None: none)."""
    from autoshard.search.pipelined import pipeline_ask

    return pipeline_ask(mesh, args.pipeline_axis, args.schedule, args.pipeline == "auto")


def _dump_after(args: argparse.Namespace) -> AfterStage | None:
    """The dump points asked for with --dump-after, printing in the command's dialect."""
    if not args.dump_after:
        return None
    from autoshard.pipeline import dump_after

    return dump_after(set(args.dump_after), getattr(args, "dialect", "mesh"))


@contextmanager
def _progress(args: argparse.Namespace) -> Iterator[Tracker | None]:
    """The run's progress on stderr: a line redrawn in place on a terminal, plain lines
    otherwise (and while --dump-after prints there too); none with --quiet."""
    if args.quiet:
        yield None
        return
    from autoshard.progress import LinesView, TerminalView, Tracker

    delay = 0.0 if args.verbose else PROGRESS_DELAY_S
    terminal = sys.stderr.isatty() and not args.dump_after
    view = TerminalView(sys.stderr, delay) if terminal else LinesView(sys.stderr, delay)
    try:
        yield Tracker(view)
    finally:
        view.close()


def cmd_plan(args: argparse.Namespace) -> int:
    from autoshard.deadline import Deadline

    deadline = Deadline.start(args.time_limit)  # (before the pipeline's imports: they count)
    from autoshard.pipeline import PlanRequest, plan_request
    from autoshard.search.microbatch import GlobalBatch

    dims, annotations, training = dims_of(args.dim), _annotations(args), _training(args)
    batch = args.global_batch
    with _progress(args) as tracker:
        after = _dump_after(args)
        cluster = _cluster(args)
        request = PlanRequest(
            model_path=args.model, cluster=cluster, dims=dims, annotations=annotations,
            objective=Objective(args.objective), time_limit=args.time_limit, training=training,
            pipeline=_pipeline(args, cluster.mesh), global_batch=batch and GlobalBatch.parse(
                batch, args.micro_batches),
        )  # fmt: skip
        requested = plan_request(request, tracker, after, deadline)
        document, planned, cluster = requested.document, requested.planned, requested.cluster
        assert document.solver is not None and document.solver.objective is not None
        note = objective_note(document.solver.objective, planned.cost, args.objective)
        if tracker is not None and note is not None:  # the last progress line says it too
            tracker.detail(note)
    # The report is drawn before either file is written: an interrupt or an error while it is
    # drawn (seconds, on a large model) leaves no plan without its report.
    html = _html_text(args, document, requested.lowered) if args.html else None
    if args.out:
        from autoshard.document.plan_document import write_document

        write_document(args.out, document)
    if html is not None:
        from autoshard.html import write_html

        write_html(args.html, html)
    if args.json:
        emit(document.to_json())
        return 0
    solver, search, timing = document.solver, document.search, document.timing
    assert solver is not None and search is not None and timing is not None  # a search's plan
    layers = search.repeated_layers.layers
    print(f"plan for {args.model} on mesh {cluster.mesh} ({cluster.mesh.size} devices)")
    print(textwrap.fill(document.story or "", width=100))
    if document.pipeline is not None:
        print(pipeline_summary(document.pipeline))
    print(cost_summary(planned.cost, cluster, document.ops))
    print(
        f"collectives: {len(document.collectives)}; solver {solver.status}, gap "
        f"{solver.gap:.2%}, {timing.solve_s:.2f} s; problem {search.groups} groups, "
        f"{search.choices} choices"
        + (f" ({layers} repeated layers solved once)" if layers > 1 else "")
    )
    if note is not None:
        print(note)
    print(breakdown_summary(document.breakdown or {}))
    if document.recipes is not None:
        from autoshard.document.recipes import recipes_table

        print("\n".join(recipes_table(document.recipes)))
    if planned.plan.unruled:
        print(f"computed replicated (no rule): {', '.join(planned.plan.unruled)}")
    if args.out:
        print(f"plan written to {args.out}")
    if args.html:
        print(f"report written to {args.html}")
    return 0


def cmd_html(args: argparse.Namespace) -> int:
    from autoshard.document.plan_document import read_document
    from autoshard.export.held import find_model
    from autoshard.html import plan_html, write_html

    document = read_document(args.plan)
    model = find_model(args.plan, document, args.model)
    write_html(args.out, plan_html(document, model, args.tensor or ()))
    print(f"report written to {args.out}")
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    from autoshard.reshard import plan_reshard

    mesh = Mesh.parse(args.mesh)
    src = Sharding.parse(args.source).check(mesh, args.shape)
    dst = Sharding.parse(args.target).check(mesh, args.shape)
    plan = plan_reshard(src, dst, args.shape, mesh, args.itemsize)
    total = sum(c.bytes_per_device for c in plan)
    if args.json:
        emit({"collectives": [c.to_json() for c in plan], "bytes_per_device": total})
        return 0
    rank = len(args.shape)
    print(f"{src.text(rank)} -> {dst.text(rank)} on mesh {mesh}: {len(plan)} collectives")
    for c in plan:
        print(f"  {c}  {c.src.text(rank)} -> {c.dst.text(rank)}  ({c.bytes_per_device} B)")
    print(f"bytes per device: {total}")
    return 0


def _annotations(args: argparse.Namespace) -> list[Any]:
    from autoshard.annotations import load_annotations, parse_annotate_flag

    annotations = [parse_annotate_flag(a) for a in args.annotate or ()]
    if args.annotations:
        annotations += load_annotations(args.annotations)
    return annotations


def cmd_partition(args: argparse.Namespace) -> int:
    from pathlib import Path

    from autoshard.execute.artifacts import write_partition
    from autoshard.pipeline import Setup

    annotations = tuple(_annotations(args))
    plan, training, dims = None, _training(args), dims_of(args.dim)
    if args.plan and is_pipelined(args.plan):
        return partition_pipelined(args, annotations)
    if args.forward:
        raise AutoshardError(
            "--forward partitions a pipelined plan's forward only; this partition is of "
            f"{'plan ' + args.plan if args.plan else '--mesh'}, which has no pipeline: leave it out"
        )
    if not args.plan:
        if args.mesh is None:
            raise AutoshardError("partition needs --mesh (or --plan, whose mesh it takes)")
        mesh = Mesh.parse(args.mesh)
    else:
        from autoshard.document.plan_document import planned_dims, read_plan_document

        if annotations:
            raise AutoshardError("give either --plan or annotations, not both")
        mesh = _planned_mesh(args.plan, args.mesh)
        dims = dims or planned_dims(args.plan)  # no --dim: the plan's
        plan = read_plan_document(args.plan, mesh, args.model, dims)
        planned = plan.training
        if args.mode == "training" and planned != training:
            raise AutoshardError(
                f"plan {args.plan} is for {planned or 'the forward pass'}, not {training}; "
                "leave out --mode and the training flags to partition it as planned"
            )
        training = planned
    setup = Setup(
        model=Path(args.model), mesh=mesh, dims=dims, annotations=annotations,
        plan=plan, training=training,
    )  # fmt: skip
    with _progress(args) as tracker:
        manifest = write_partition(setup, args.out, args.dialect, _dump_after(args), tracker)
    if args.json:
        emit(
            {k: v for k, v in manifest.items() if k != "devices"}
            | {
                "devices": [
                    {k: v for k, v in d.items() if k != "slices"} for d in manifest["devices"]
                ]
            }
        )
        return 0
    devices, collectives = manifest["devices"], manifest["collectives"]
    print(
        f"partitioned {args.model} on mesh {mesh} ({len(devices)} devices): "
        f"{len(collectives)} collectives, {manifest['bytes_per_device']} bytes per device"
    )
    if manifest["shape_only"]:
        print("shape-only model (weight data absent): no weight files written")
    else:
        total = sum(d["bytes"] for d in devices)
        print(f"weights: {len(devices)} files in {args.out}/weights ({total} bytes)")
    print(f"SPMD program: {args.out}/{manifest['spmd']['file']} ({args.dialect} dialect)")
    print(f"manifest: {args.out}/manifest.json")
    return 0


def _planned_mesh(plan: str, given: str | None) -> Mesh:
    """The mesh plan file `plan` was made for: `--mesh` may leave it out, or must repeat it."""
    from autoshard.document.plan_document import read_document

    planned = read_document(plan).mesh
    if given is not None and str(Mesh.parse(given)) != str(planned):
        raise AutoshardError(
            f"plan {plan} is for mesh {planned}, not {given}: leave out --mesh to "
            "partition it on the plan's mesh, or plan again for this one"
        )
    return planned


def cmd_verify(args: argparse.Namespace) -> int:
    from autoshard.execute.artifacts import load_inputs, read_manifest, setup_of, verify_folder

    inputs = load_inputs(args.inputs) if args.inputs else None
    if "pipeline" in read_manifest(args.out):
        return run_pipelined_forward(args, args.model, inputs, "verify")
    if "training" in read_manifest(args.out):
        return _verify_training(args, inputs)
    if args.distributed:
        from autoshard.run import run_partition

        setup_of(read_manifest(args.out), args.model, dims_of(args.dim))  # the same model, dims
        run = run_partition(
            args.out, args.backend, inputs, args.model, args.timeout, rtol=args.rtol
        )
        assert run is not None  # not under torchrun: this process is the launcher
        checks, devices, data = run.checks, run.devices, run.to_json()
    else:
        report = verify_folder(args.out, args.model, dims_of(args.dim), inputs, args.rtol)
        checks, devices, data = report.outputs, report.devices, report.to_json()
    ok = all(c.ok for c in checks.values())
    if args.json:
        emit(data)
    else:
        how = f" as {devices} processes ({args.backend})" if args.distributed else ""
        print(f"verify {args.out} on {devices} devices{how}: {'ok' if ok else 'FAILED'}")
        print_checks(checks)
    return 0 if ok else 1


def _verify_training(args: argparse.Namespace, inputs: Any) -> int:
    """A training step's partition trained `--steps` steps against PyTorch autograd, in this
    process or (`--distributed`) as one process per device."""
    if args.rtol is not None or args.steps < 1:
        raise AutoshardError(
            f"verify trains a training step's partition to 1e-5 for --steps N >= 1 (got "
            f"{args.steps}); --rtol is for forward passes"
        )
    if args.distributed:
        return _run_training(args, args.model, inputs, "verify")
    from autoshard.execute.artifacts import verify_training_folder

    floats = "float64" if args.float64 else "float32"
    report = verify_training_folder(
        args.out, args.model, dims_of(args.dim), args.steps, inputs, floats, args.loss
    )
    if args.json:
        emit(report.to_json())
    else:
        print_training(args.out, report)
    return 0 if report.ok else 1


def _run_training(args: argparse.Namespace, model: str | None, inputs: Any, how: str) -> int:
    """`run` (or `verify --distributed`) of a training step's partition on torch.distributed."""
    if model is None or args.steps < 1:
        raise AutoshardError(
            f"'{args.out}' is the partition of a training step: run trains it against PyTorch "
            f"autograd on its model for --steps N >= 1; give --check MODEL (got steps "
            f"{args.steps})"
        )
    from autoshard.run.train import run_training

    floats = "float64" if args.float64 else "float32"
    report = run_training(args.out, model, dims_of(args.dim), args.steps, args.backend, inputs,
                          args.timeout, floats=floats, loss=args.loss)  # fmt: skip
    if args.json:
        emit(report.to_json())
    else:
        print_training(args.out, report, how)
    return 0 if report.ok else 1


def cmd_run(args: argparse.Namespace) -> int:
    from autoshard.execute.artifacts import load_inputs, read_manifest
    from autoshard.run import run_partition

    inputs = load_inputs(args.inputs) if args.inputs else None
    if "pipeline" in read_manifest(args.out):
        return run_pipelined_forward(args, args.check, inputs, "run")
    if "training" in read_manifest(args.out):
        return _run_training(args, args.check, inputs, "run")
    report = run_partition(args.out, args.backend, inputs, args.check, args.timeout)
    if report is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    if args.json:
        emit(report.to_json())
        return 0 if report.ok else 1
    status = "" if not report.checks else (": ok" if report.ok else ": FAILED")
    print(f"ran {args.out} as {report.devices} processes ({report.backend}){status}")
    if report.checks:
        print_checks(report.checks)
    else:
        for name, value in report.outputs.items():
            print(f"  {name}: {'x'.join(map(str, value.shape))} {value.dtype}")
    print(f"wall time {report.wall_s:.2f} s; per rank (compute, then collectives by kind):")
    for rank in report.ranks:
        kinds = ", ".join(
            f"{kind} {c['count']}x {c['seconds'] * 1e3:.2f} ms"
            for kind, c in rank["collectives"].items()  # type: ignore[attr-defined]
        )
        compute = rank["compute_s"] * 1e3  # type: ignore[operator]
        print(f"  rank {rank['rank']}: compute {compute:.2f} ms; {kinds or 'no collectives'}")
    return 0 if report.ok else 1


def cmd_report(args: argparse.Namespace) -> int:
    from autoshard.explain.report import (
        compare,
        comparison_json,
        comparison_markdown,
        load_entries,
        parse_threshold,
    )
    from autoshard.files import write_atomic

    threshold = parse_threshold(args.threshold)
    comparison = compare(load_entries(args.baseline), load_entries(args.current), threshold)
    markdown = comparison_markdown(comparison)
    if args.markdown:
        write_atomic(Path(args.markdown), markdown.encode())
    if args.json:
        emit(comparison_json(comparison))
    else:
        print(markdown, end="")
    return 1 if comparison.regressed else 0


def cmd_diff(args: argparse.Namespace) -> int:
    from autoshard.document.plan_document import read_document
    from autoshard.explain.diff import diff_plans, diff_text

    diff = diff_plans(read_document(args.a), read_document(args.b))
    if args.json:
        emit(diff)
    else:
        print(diff_text(diff))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from autoshard.explain.saved import explain, explain_text, load_saved

    if not args.name and not args.why_not:
        raise AutoshardError("explain: name a value or op, or give --why-not NAME=SHARDING")
    if args.out and not args.why_not:
        raise AutoshardError("explain: -o writes the plan --why-not finds: give --why-not")
    model = args.model
    if model is None:  # as `autoshard html` finds it: the plan's model.file beside the plan
        from autoshard.document.plan_document import read_document
        from autoshard.export.held import find_model

        model = find_model(args.plan, read_document(args.plan), None)
    saved = load_saved(args.plan, model, _cluster_on(args))
    data: dict[str, Any] = {}
    if args.name:
        data["explain"] = explain(saved, args.name)
    if args.why_not:
        from autoshard.explain.whynot import why_not, why_not_text

        data["why_not"], target = why_not(saved, args.why_not)
        if args.out and target is not None:
            from autoshard.document.plan_document import write_document

            write_document(args.out, target)
    if args.json:
        emit(data)
        return 0
    if "explain" in data:
        print(explain_text(data["explain"]))
    if "why_not" in data:
        print(why_not_text(data["why_not"]))
        if args.out and data["why_not"]["verdict"] != "INFEASIBLE":
            print(f"the target plan written to {args.out} (autoshard diff {args.plan} {args.out})")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from autoshard.units import parse_size
    from service.app import Settings, serve

    settings = Settings(
        Path(args.data), parse_size(args.max_upload, "--max-upload"), args.workers,
        args.max_time_limit, args.database, args.executor, args.lease,
    )  # fmt: skip
    serve(settings, args.host, args.port)
    return 0

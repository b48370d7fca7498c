"""The `autoshard` command line: parses flags, calls the library, formats results.

Every user error ends as one line on stderr (`autoshard: error: ...`) and exit code 2; no
traceback reaches the user for bad input. Every command takes `--json` for machine output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from autoshard import __version__
from autoshard.cost.cluster import CLUSTERS
from autoshard.errors import AutoshardError, LimitError
from autoshard.limits import check_elements
from autoshard.mesh import Mesh
from autoshard.mlir.syntax import Dialect
from autoshard.passes import Stage
from autoshard.search.options import Objective
from autoshard.sharding import Sharding

if TYPE_CHECKING:  # the pipeline is imported by the commands that run it, not at startup
    from autoshard.pipeline import AfterStage
    from autoshard.progress import Tracker

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line, like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Intermixed(_Parser):
    """Positionals may follow options (argparse otherwise leaves an optional positional given
    after an option unread)."""

    _mixing = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._mixing:  # parse_known_intermixed_args calls back here
            return super().parse_known_args(args, namespace)
        self._mixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._mixing = False


def _dim(text: str) -> tuple[str, int]:
    name, sep, size = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--dim {text!r} is not NAME=SIZE (e.g. --dim batch=8)")
    try:
        value = int(size)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--dim {text!r}: size {size!r} is not an integer"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--dim {text!r}: size must be >= 1")
    return name.strip(), value


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not like 4x6") from None
    if any(d < 0 for d in dims):
        raise argparse.ArgumentTypeError(f"shape {text!r} has a negative dim")
    try:
        check_elements(dims, f"--shape {text}")
    except LimitError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return dims


def _dims(pairs: Sequence[tuple[str, int]] | None) -> dict[str, int]:
    dims: dict[str, int] = {}
    for name, size in pairs or ():
        if name in dims and dims[name] != size:
            raise AutoshardError(f"--dim {name} given twice ({dims[name]} and {size})")
        dims[name] = size
    return dims


def _emit(data: object) -> None:
    print(json.dumps(data, indent=2))


# ---- commands ---------------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
    from autoshard.ir.summary import format_summary, inspect_model

    summary = inspect_model(args.model, _dims(args.dim))
    if args.json:
        _emit(summary)
    else:
        print(format_summary(summary))
    return 0


def cmd_layout(args: argparse.Namespace) -> int:
    from autoshard.layout import draw_layout, layout_json

    mesh = Mesh.parse(args.mesh)
    sharding = Sharding.parse(args.sharding).check(mesh, args.shape)
    if args.json:
        _emit(layout_json(mesh, args.shape, sharding))
    else:
        print(draw_layout(mesh, args.shape, sharding))
    return 0


def cmd_propagate(args: argparse.Namespace) -> int:
    from autoshard.cost.model import price
    from autoshard.document import describe
    from autoshard.export.names import parameter_names
    from autoshard.pipeline import propagated
    from autoshard.story import strategy_story

    cluster = _cluster(args)
    mesh = cluster.mesh
    annotations = _annotations(args)
    partition = Stage.PARTITION in (args.dump_after or ())  # only to print it
    training = _training(args)
    lowered = propagated(
        args.model, _dims(args.dim), mesh, annotations, _dump_after(args), partition, training
    )
    graph, result, program = lowered.graph, lowered.plan, lowered.program
    if args.emit == "mlir":
        from autoshard.mlir import print_program

        print(print_program(program, args.dialect), end="")
        return 0
    cost = price(program, graph, cluster)
    collectives = program.collectives_json()
    data: dict[str, Any] = {
        "story": strategy_story(graph, result, collectives, parameter_names(args.model)),
        **describe(result, graph, cost),
        "collectives": collectives,
        "cost": cost.to_json(),
    }
    if args.html:
        from autoshard.document import model_info, plan_document

        info = model_info(args.model, graph, _dims(args.dim))
        document = plan_document(graph, cluster, result, program, cost, info, training=training)
        _write_html(args, document, lowered)
    if args.json:
        _emit(data)
        return 0
    print(
        f"model {graph.name} on mesh {mesh}: {len(graph.ops)} ops, {len(annotations)} annotations"
    )
    print(textwrap.fill(data["story"], width=100))
    for name, op in data["ops"].items():
        print(f"  {name} ({op['type']}): {op['sharding_option'] or 'replicated (no rule)'}")
    collectives = data["collectives"]
    print(f"collectives: {len(collectives)}, {program.bytes_per_device} bytes per device")
    for c in collectives:
        print(
            f"  {c['value']}: {c['kind']} mesh_axes = {c['mesh_axes']}  {c['from']} -> {c['to']}"
            f"  ({c['bytes_per_device']} B)"
        )
    if result.unruled:
        print(f"computed replicated (no rule): {', '.join(result.unruled)}")
    print(_cost_summary(cost, cluster, data["ops"]))
    if args.html:
        print(f"report written to {args.html}")
    return 0


def _write_html(args: argparse.Namespace, document: dict[str, Any], lowered: Any) -> None:
    """--html: the plan's HTML report, drawn from the plan just made."""
    from autoshard.html import plan_html, write_html

    write_html(args.html, plan_html(document, args.model, args.html_tensor or (), lowered))


def _cluster(args: argparse.Namespace) -> Any:
    from autoshard.cost.cluster import make_cluster

    return make_cluster(
        args.mesh, args.device, args.bandwidth, args.latency, args.memory, args.cluster
    )


def _cost_summary(cost: Any, cluster: Any, ops: dict[str, dict[str, Any]]) -> str:
    from autoshard.cost.cluster import format_bytes as _size

    by_type: dict[str, float] = {}
    for op in ops.values():
        by_type[op["type"]] = by_type.get(op["type"], 0.0) + op.get("compute_s", 0.0)
    top = sorted(by_type.items(), key=lambda kv: (-kv[1], kv[0]))[:4]
    share = [f"{t} {s / (cost.compute_time_s or 1):.0%}" for t, s in top if s]
    lines = [
        f"memory per device: {_size(cost.memory_bytes_per_device)} of {_size(cluster.memory)} "
        f"({cost.memory_bytes_per_device / cluster.memory:.1%})",
        f"compute: {cost.compute_time_s * 1e3:.3f} ms per device on {cluster.device.name} "
        f"(roofline per op; {', '.join(share) or 'no op'})",
        "links: " + "; ".join(cluster.describe_links()),
        f"communication: {_size(cost.comm_bytes_per_device)} per device, "
        f"{cost.comm_time_s * 1e3:.3f} ms",
    ]
    for axes, (sent, seconds) in cost.by_axes.items():
        if sent:
            lines.append(f"  mesh axes {axes}: {_size(sent)}, {seconds * 1e3:.3f} ms")
    lines.append(f"objective (compute + communication): {cost.objective * 1e3:.3f} ms")
    if cost.phases:
        lines.append("training step by phase:")
        for name, phase in cost.phases.items():
            lines.append(
                f"  {name}: {(phase.compute_time_s + phase.comm_time_s) * 1e3:.3f} ms "
                f"(compute {phase.compute_time_s * 1e3:.3f} ms, communication "
                f"{_size(phase.comm_bytes_per_device)}, {phase.comm_time_s * 1e3:.3f} ms)"
            )
        held = ", ".join(f"{k} {_size(v)}" for k, v in cost.memory_by_kind.items() if v)
        lines.append(f"memory at the peak: {held}")
    return "\n".join(lines)


def _breakdown_summary(block: dict[str, Any]) -> str:
    """The top lines of a plan's `breakdown`: each run of repeated layers (one layer, and all),
    the rest, the costliest collectives, and the memory at the peak by kind."""

    from autoshard.cost.cluster import format_bytes as _size

    def kinds(held: dict[str, int]) -> str:
        return ", ".join(f"{kind} {_size(n)}" for kind, n in held.items() if n) or "nothing"

    def spent(s: dict[str, Any]) -> str:
        comm = s["comm_s_by_mesh_axes"]
        axes = ", ".join(f"axes {axes} {t * 1e3:.3f} ms" for axes, t in comm.items())
        return f"compute {s['compute_s'] * 1e3:.3f} ms, communication " + (axes or "none")

    lines = []
    for run in block["repeated_layers"]:
        lines.append(
            f"{run['phase']} layers ({run['layers']} x {run['ops_per_layer']} ops): one layer "
            f"{spent(run['one_layer'])}; all {spent(run['all_layers'])}"
        )
    lines.append(f"the rest: {spent(block['rest'])}")
    for c in block["top_collectives"][:3]:
        lines.append(
            f"  top collective: {c['kind']} of {c['value']} over mesh axes {c['mesh_axes']} "
            f"for {c['op']}, {c['time_s'] * 1e3:.3f} ms"
        )
    peak = block["memory_peak"]
    during = f", during {peak['at_op']}" if peak["at_op"] else ""
    lines.append(f"memory at the peak: {_size(peak['bytes_per_device'])}{during}")
    for run in block["repeated_layers"]:
        held = run["memory_at_peak"]
        if any(held["all_layers"].values()):
            lines.append(
                f"  {run['phase']} layers: {kinds(held['all_layers'])}; the most in layer "
                f"{held['one_layer_index']}: {kinds(held['one_layer'])}"
            )
    lines.append(f"  the rest: {kinds(block['rest']['memory_at_peak'])}")
    return "\n".join(lines)


def _training(args: argparse.Namespace) -> Any:
    """The training step the flags ask for (None: the forward pass)."""
    from autoshard.training.options import OPTIONS, requested

    given = {name: getattr(args, name) for name in OPTIONS}
    return requested(
        args.mode, given, lambda name: "--" + name.replace("_", "-"), "--mode training"
    )


def _dump_after(args: argparse.Namespace) -> AfterStage | None:
    """The dump points asked for with --dump-after, printing in the command's dialect."""
    if not args.dump_after:
        return None
    from autoshard.pipeline import dump_after

    return dump_after(set(args.dump_after), getattr(args, "dialect", "mesh"))


PROGRESS_DELAY_S = 1.0  # a run quicker than this shows no progress (unless --verbose)


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
    from autoshard.pipeline import PlanRequest, plan_request

    request = PlanRequest(
        model_path=args.model, mesh=args.mesh, dims=_dims(args.dim), device=args.device,
        bandwidth=args.bandwidth, latency=args.latency, memory=args.memory,
        cluster_file=args.cluster, annotations=_annotations(args),
        objective=Objective(args.objective), time_limit=args.time_limit,
        training=_training(args),
    )  # fmt: skip
    with _progress(args) as tracker:
        requested = plan_request(request, tracker, _dump_after(args))
    document, planned, cluster = requested.document, requested.planned, requested.cluster
    if args.out:
        from autoshard.document import write_document

        write_document(args.out, document)
    if args.html:
        _write_html(args, document, requested.lowered)
    if args.json:
        _emit(document)
        return 0
    solver, search, timing = document["solver"], document["search"], document["timing"]
    layers = search["repeated_layers"]
    print(f"plan for {args.model} on mesh {cluster.mesh} ({cluster.mesh.size} devices)")
    print(textwrap.fill(document["story"], width=100))
    print(_cost_summary(planned.cost, cluster, document["ops"]))
    print(
        f"collectives: {len(document['collectives'])}; solver {solver['status']}, gap "
        f"{solver['gap']:.2%}, {timing['solve_s']:.2f} s; problem {search['groups']} groups, "
        f"{search['choices']} choices"
        + (f" ({layers['layers']} repeated layers solved once)" if layers["layers"] > 1 else "")
    )
    print(_breakdown_summary(document["breakdown"]))
    if "strategy" in document:
        counts = document["strategy"]["counts"]
        print("weights: " + ", ".join(f"{n} {kind}" for kind, n in counts.items()))
    if planned.plan.unruled:
        print(f"computed replicated (no rule): {', '.join(planned.plan.unruled)}")
    if args.out:
        print(f"plan written to {args.out}")
    if args.html:
        print(f"report written to {args.html}")
    return 0


def cmd_html(args: argparse.Namespace) -> int:
    from autoshard.document import read_document
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
        _emit({"collectives": [c.to_json() for c in plan], "bytes_per_device": total})
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

    from autoshard.artifacts import write_partition
    from autoshard.pipeline import Setup

    mesh = Mesh.parse(args.mesh)
    annotations = tuple(_annotations(args))
    plan, training, dims = None, _training(args), _dims(args.dim)
    if args.plan:
        from autoshard.document import planned_dims, read_plan_document, training_of

        if annotations:
            raise AutoshardError("give either --plan or annotations, not both")
        dims = dims or planned_dims(args.plan)  # no --dim: the plan's
        plan = read_plan_document(args.plan, mesh, args.model, dims)
        planned = training_of(plan, args.plan)
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
        _emit(
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


def cmd_verify(args: argparse.Namespace) -> int:
    from autoshard.artifacts import load_inputs, read_manifest, setup_of, verify_folder

    inputs = load_inputs(args.inputs) if args.inputs else None
    if args.distributed:
        from autoshard.run import run_partition

        setup_of(read_manifest(args.out), args.model, _dims(args.dim))  # the same model, dims
        run = run_partition(
            args.out, args.backend, inputs, args.model, args.timeout, rtol=args.rtol
        )
        assert run is not None  # not under torchrun: this process is the launcher
        checks, devices, data = run.checks, run.devices, run.to_json()
    else:
        report = verify_folder(args.out, args.model, _dims(args.dim), inputs, args.rtol)
        checks, devices, data = report.outputs, report.devices, report.to_json()
    ok = all(c.ok for c in checks.values())
    if args.json:
        _emit(data)
    else:
        how = f" as {devices} processes ({args.backend})" if args.distributed else ""
        print(f"verify {args.out} on {devices} devices{how}: {'ok' if ok else 'FAILED'}")
        _print_checks(checks)
    return 0 if ok else 1


def _print_checks(checks: Any) -> None:
    for name, check in checks.items():
        replica = (
            f", replicas differ by {check.max_replica_err:.3g}" if check.max_replica_err else ""
        )
        print(
            f"  {name}: max abs err {check.max_abs_err:.3g}, max rel err "
            f"{check.max_rel_err:.3g} (tolerance {check.tolerance:g}){replica}"
            f"  {'ok' if check.ok else 'FAILED'}"
        )


def cmd_run(args: argparse.Namespace) -> int:
    from autoshard.artifacts import load_inputs
    from autoshard.run import run_partition

    inputs = load_inputs(args.inputs) if args.inputs else None
    report = run_partition(args.out, args.backend, inputs, args.check, args.timeout)
    if report is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    if args.json:
        _emit(report.to_json())
        return 0 if report.ok else 1
    status = "" if not report.checks else (": ok" if report.ok else ": FAILED")
    print(f"ran {args.out} as {report.devices} processes ({report.backend}){status}")
    if report.checks:
        _print_checks(report.checks)
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
    from autoshard.files import write_atomic
    from autoshard.report import (
        compare,
        comparison_json,
        comparison_markdown,
        load_entries,
        parse_threshold,
    )

    threshold = parse_threshold(args.threshold)
    comparison = compare(load_entries(args.baseline), load_entries(args.current), threshold)
    markdown = comparison_markdown(comparison)
    if args.markdown:
        write_atomic(Path(args.markdown), markdown.encode())
    if args.json:
        _emit(comparison_json(comparison))
    else:
        print(markdown, end="")
    return 1 if comparison.regressed else 0


def cmd_diff(args: argparse.Namespace) -> int:
    from autoshard.diff import diff_plans, diff_text
    from autoshard.document import read_document

    diff = diff_plans(read_document(args.a), read_document(args.b))
    if args.json:
        _emit(diff)
    else:
        print(diff_text(diff))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from autoshard.explain import explain, explain_text, load_saved

    if not args.name and not args.why_not:
        raise AutoshardError("explain: name a value or op, or give --why-not NAME=SHARDING")
    if args.out and not args.why_not:
        raise AutoshardError("explain: -o writes the plan --why-not finds: give --why-not")
    saved = load_saved(
        args.plan, args.model, args.device, args.bandwidth, args.latency, args.memory,
        args.cluster,
    )  # fmt: skip
    data: dict[str, Any] = {}
    if args.name:
        data["explain"] = explain(saved, args.name)
    if args.why_not:
        from autoshard.whynot import why_not, why_not_text

        data["why_not"], target = why_not(saved, args.why_not)
        if args.out and target is not None:
            from autoshard.document import write_document

            write_document(args.out, target)
    if args.json:
        _emit(data)
        return 0
    if "explain" in data:
        print(explain_text(data["explain"]))
    if "why_not" in data:
        print(why_not_text(data["why_not"]))
        if args.out and data["why_not"]["verdict"] != "INFEASIBLE":
            print(f"the target plan written to {args.out} (autoshard diff {args.plan} {args.out})")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from autoshard.cost.calibrate import calibrate
    from autoshard.files import write_atomic
    from autoshard.run import measure

    def progress(message: str) -> None:
        print(f"autoshard: {message}", file=sys.stderr, flush=True)

    ranks = measure.check_ranks(args.ranks)
    backend = args.backend or measure.default_backend()
    if ranks:
        measure.check_backend(ranks, backend)
    probe = None
    if args.torch:
        from autoshard.cost.probes import TorchProbe

        try:
            import torch  # noqa: F401
        except ImportError:
            message = "calibrate --torch needs torch: pip install 'autoshard[run]'"
            raise AutoshardError(message) from None

        probe = TorchProbe("cuda" if measure.cuda_devices() else "cpu")
    calibration = calibrate(args.quick, progress, probe)
    if ranks:
        sizes, repeats = (measure.QUICK_SIZES, 5) if args.quick else (measure.SIZES, 10)
        links = measure.measure_links(ranks, backend, sizes, repeats, progress=progress)
        calibration = calibration.with_links(links)
    else:
        progress("links not measured (--ranks 0, or no torch): the host's copy rate stands in")
    data = calibration.to_json()
    write_atomic(Path(args.out), (json.dumps(data, indent=2) + "\n").encode())
    if args.json:
        _emit(data)
    else:
        print(f"cluster file written to {args.out}: plan with --cluster {args.out} --mesh N")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from autoshard.export import Target, export_plan
    from autoshard.files import write_atomic

    target = Target(args.to)
    if target is Target.ONNX and not args.out:
        raise AutoshardError("--to onnx writes a model: give -o OUT.onnx")
    exported = export_plan(args.plan, target, args.model, args.checkpoint)
    if args.out:
        write_atomic(Path(args.out), exported.payload)
    document = exported.document
    if args.json:
        _emit(document)
        return 0
    if target is Target.ONNX:
        print(
            f"{document['nodes_annotated']} of {document['nodes']} nodes annotated for "
            f"{document['devices']} devices (IR version {document['ir_version']})"
        )
    else:
        if target is Target.DTENSOR and document["parallelize"]["fallback"]:
            print(f"no parallel style applies: {document['parallelize']['fallback']}")
        for name, entry in document["parameters"].items():
            value = entry["placements"] if target is Target.DTENSOR else entry["text"]
            line = f"  {name}: {', '.join(value) if isinstance(value, list) else value}"
            if "style" in entry:
                line += f"  [{entry['style']}]"
            if "strategy" in entry:
                state = entry["optimizer_state"]
                line += f"  {entry['strategy']}, optimizer state "
                line += ", ".join(state) if isinstance(state, list) else state
            print(line)
        for weight, why in document["unnamed"].items():
            print(f"  ONNX weight {weight}: {why}")
    for warning in document["warnings"]:
        print(f"warning: {warning}")
    if args.out:
        print(f"{target} export written to {args.out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from autoshard.cost.cluster import parse_size
    from service.app import Settings, serve

    settings = Settings(
        Path(args.data), parse_size(args.max_upload, "--max-upload"), args.workers,
        args.max_time_limit,
    )  # fmt: skip
    serve(settings, args.host, args.port)
    return 0


def _model_flags(parser: argparse.ArgumentParser, mesh_required: bool) -> None:
    """The model, its mesh, bound dims and annotations: what propagate, plan and partition
    share."""
    parser.add_argument("model", help="path to an .onnx file")
    mesh_help = "device mesh, e.g. 4x8" + ("" if mesh_required else " (or in --cluster)")
    parser.add_argument("--mesh", required=mesh_required, help=mesh_help)
    parser.add_argument(
        "--dim", action="append", type=_dim, metavar="NAME=SIZE", help="bind a symbolic dim"
    )
    parser.add_argument(
        "--annotate",
        action="append",
        metavar="VALUE=SHARDING",
        help="required result annotation, e.g. x='[[0]]' (repeatable)",
    )
    parser.add_argument("--annotations", metavar="FILE", help="annotations JSON file")
    parser.add_argument(
        "--dump-after", action="append", choices=[str(s) for s in Stage], metavar="STAGE",
        help=f"print the program as MLIR to stderr after STAGE ({', '.join(Stage)}; repeatable)",
    )  # fmt: skip


def _html_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--html", metavar="REPORT.html",
        help="also write the plan's HTML report (one self-contained file: strategy, mesh, time "
        "and memory charts, weights, tensor layouts)",
    )  # fmt: skip
    parser.add_argument(
        "--html-tensor", action="append", metavar="VALUE",
        help="draw this tensor's layout in the HTML report too (repeatable; the largest weight "
        "is always drawn)",
    )  # fmt: skip


def _training_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training step (with --mode training)")
    group.add_argument(
        "--mode", default="inference", metavar="MODE",
        help="inference (the forward pass, default) or training (forward, backward, gradient "
        "sync, optimizer step)",
    )  # fmt: skip
    group.add_argument("--optimizer", help="adam (default), adamw, sgd (momentum) or none")
    group.add_argument(
        "--precision", help="bf16-mixed (default), fp16-mixed or fp32: the dtype of weights, "
        "activations and gradients; mixed keeps fp32 master weights and moments",
    )  # fmt: skip
    group.add_argument(
        "--micro-batches", type=int, metavar="N",
        help="gradient accumulation: forward and backward N times per gradient sync",
    )  # fmt: skip
    group.add_argument(
        "--recompute", help="none (default) or layers: recompute each repeated layer's "
        "activations in its backward",
    )  # fmt: skip


def _progress_flags(parser: argparse.ArgumentParser) -> None:
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument(
        "-q", "--quiet", action="store_true", help="no progress on stderr (errors still are)"
    )
    shown.add_argument(
        "-v", "--verbose", action="store_true",
        help=f"progress from the start (otherwise only once a run passes {PROGRESS_DELAY_S:g} s)",
    )  # fmt: skip


def _run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), default="gloo",
        help="torch.distributed backend (default gloo; nccl on GPUs)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=60.0, metavar="S",
        help="seconds a collective may wait for its peers (default 60)",
    )  # fmt: skip


def _cluster_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", help="device preset: h100, a100, mi300x, tpu-v5e, l4")
    parser.add_argument(
        "--bandwidth", help="link bandwidth per mesh axis, e.g. 25GB/s,450GB/s (or one for all)"
    )
    parser.add_argument("--latency", help="link latency per mesh axis, e.g. 5us,1us")
    parser.add_argument("--memory", help="memory budget per device, e.g. 16GiB")
    parser.add_argument(
        "--cluster",
        metavar="FILE|PRESET",
        help=f"cluster file (JSON or YAML) or preset: {', '.join(CLUSTERS)}",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autoshard", description="Auto-sharding planner for ML models.")
    parser.add_argument("--version", action="version", version=f"autoshard {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    inspect = commands.add_parser("inspect", help="summarize an ONNX model")
    inspect.add_argument("model", help="path to an .onnx file")
    inspect.add_argument(
        "--dim", action="append", type=_dim, metavar="NAME=SIZE", help="bind a symbolic dim"
    )
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(run=cmd_inspect)

    propagate = commands.add_parser(
        "propagate", help="complete shardings from annotations and list the collectives"
    )
    _model_flags(propagate, mesh_required=True)
    propagate.add_argument("--json", action="store_true", help="machine-readable output")
    _cluster_flags(propagate)
    _training_flags(propagate)
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
        help="MLIR spelling for --emit mlir: seed 003's mesh or upstream LLVM 22's shard",
    )
    _html_flags(propagate)
    propagate.set_defaults(run=cmd_propagate)

    plan = commands.add_parser("plan", help="search the cheapest sharding plan (CP-SAT)")
    _model_flags(plan, mesh_required=False)
    _cluster_flags(plan)
    _training_flags(plan)
    plan.add_argument(
        "--objective", choices=[str(o) for o in Objective], default=str(Objective.TIME),
        help="minimize compute + communication time (default) or communication bytes",
    )  # fmt: skip
    plan.add_argument(
        "--time-limit", type=float, default=60.0,
        help="the solver's limit in CP-SAT's deterministic seconds, which make the same plan "
        "on every run (one took 2-3 s of wall time on a 2-core machine; default 60)",
    )  # fmt: skip
    plan.add_argument("-o", "--out", metavar="PLAN.json", help="write the plan JSON here")
    plan.add_argument("--json", action="store_true", help="print the plan JSON")
    _progress_flags(plan)
    _html_flags(plan)
    plan.set_defaults(run=cmd_plan)

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

    reshard = commands.add_parser(
        "reshard", help="the collectives that turn one sharding of a tensor into another"
    )
    reshard.add_argument("--mesh", required=True, help="device mesh, e.g. 2x2x2")
    reshard.add_argument("--shape", required=True, type=_shape, help="tensor shape, e.g. 4x4")
    reshard.add_argument("--from", dest="source", required=True, help="e.g. '[[0], [1, 2]]'")
    reshard.add_argument("--to", dest="target", required=True, help="e.g. '[[0, 1], [2]]'")
    reshard.add_argument(
        "--itemsize", type=int, default=4, help="bytes per element (default 4: float32)"
    )
    reshard.add_argument("--json", action="store_true", help="machine-readable output")
    reshard.set_defaults(run=cmd_reshard)

    partition = commands.add_parser(
        "partition", help="write each device's program and weights (SPMD IR, safetensors)"
    )
    _model_flags(partition, mesh_required=True)
    partition.add_argument(
        "--plan",
        metavar="PLAN.json",
        help="partition this plan (from autoshard plan -o); without --dim, its dims",
    )
    partition.add_argument("-o", "--out", required=True, metavar="OUT", help="output folder")
    partition.add_argument(
        "--dialect",
        choices=[str(d) for d in Dialect],
        default=str(Dialect.MESH),
        help="MLIR spelling of OUT/spmd.mlir: seed 003's mesh or upstream LLVM 22's shard",
    )
    partition.add_argument("--json", action="store_true", help="machine-readable output")
    _training_flags(partition)
    _progress_flags(partition)
    partition.set_defaults(run=cmd_partition)

    verify = commands.add_parser(
        "verify", help="run a partition on all devices and compare with onnxruntime"
    )
    verify.add_argument("out", metavar="OUT", help="folder written by autoshard partition")
    verify.add_argument("--model", required=True, help="the .onnx file it was made from")
    verify.add_argument(
        "--dim",
        action="append",
        type=_dim,
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
        "--distributed",
        action="store_true",
        help="run as one process per device on torch.distributed (autoshard run), not in-process",
    )
    _run_flags(verify)
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.set_defaults(run=cmd_verify)

    run = commands.add_parser(
        "run", help="run a partition as one process per device on torch.distributed"
    )
    run.add_argument("out", metavar="OUT", help="folder written by autoshard partition")
    run.add_argument("--inputs", metavar="NPZ", help="inputs by name (default: seeded random)")
    run.add_argument(
        "--check", metavar="MODEL", help="compare the outputs with onnxruntime on this model"
    )
    _run_flags(run)
    run.add_argument("--json", action="store_true", help="machine-readable output")
    run.set_defaults(run=cmd_run)

    layout = commands.add_parser("layout", help="draw which device holds which part of a tensor")
    layout.add_argument("--mesh", required=True, help="device mesh, e.g. 2x3 or dp=2,tp=3")
    layout.add_argument("--shape", required=True, type=_shape, help="tensor shape, e.g. 4x6")
    layout.add_argument("--sharding", required=True, help="e.g. '[[], [0, 1]]'")
    layout.add_argument("--json", action="store_true", help="machine-readable output")
    layout.set_defaults(run=cmd_layout)

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

    diff = commands.add_parser(
        "diff", help="what changed between two plans: shardings by layer, collectives, costs"
    )
    diff.add_argument("a", metavar="A.json", help="the plan to compare from")
    diff.add_argument("b", metavar="B.json", help="the plan to compare to")
    diff.add_argument("--json", action="store_true", help="print the diff as JSON")
    diff.set_defaults(run=cmd_diff)

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
    explain = commands.add_parser(
        "explain", help="why a plan shards a value or op so, and why not another sharding"
    )
    explain.__class__ = _Intermixed  # `explain PLAN --model M NAME`: NAME after an option
    explain.add_argument("plan", metavar="PLAN.json", help="a plan from autoshard plan -o")
    explain.add_argument(
        "name", nargs="?", metavar="VALUE_OR_OP", help="the value or op to explain"
    )
    explain.add_argument("--model", required=True, help="the .onnx file of the plan")
    explain.add_argument(
        "--why-not", metavar="NAME=SHARDING",
        help="solve again with value NAME produced so (or op NAME computing with that option) "
        "and compare: CHOSEN CHEAPER, TARGET CHEAPER, SAME COST or INFEASIBLE",
    )  # fmt: skip
    explain.add_argument("-o", "--out", metavar="TARGET.json", help="write the --why-not plan")
    _cluster_flags(explain)
    explain.add_argument("--json", action="store_true", help="machine-readable output")
    explain.set_defaults(run=cmd_explain)

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
    serve.set_defaults(run=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
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


if __name__ == "__main__":
    sys.exit(main())

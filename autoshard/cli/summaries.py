"""The text summaries the commands print: the cost, its breakdown, the checks of a run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autoshard.document.blocks import OpEntry


def cost_summary(cost: Any, cluster: Any, ops: Mapping[str, OpEntry]) -> str:
    from autoshard.units import format_bytes as _size

    by_type: dict[str, float] = {}
    for op in ops.values():
        by_type[op.type] = by_type.get(op.type, 0.0) + (op.compute_s or 0.0)
    top = sorted(by_type.items(), key=lambda kv: (-kv[1], kv[0]))[:4]
    share = [f"{t} {s / (cost.compute_time_s or 1):.0%}" for t, s in top if s]
    lines = [
        f"memory per device: {_size(cost.memory_bytes_per_device)} of {_size(cluster.memory)} "
        f"({cost.memory_bytes_per_device / cluster.memory:.1%})"
        + (f"; {cluster.describe_budget()}" if cluster.reserve else ""),
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
    if cost.schedule is not None:
        run = cost.schedule
        lines.append(
            f"step time (critical path, communication overlapped): {run.step_time_s * 1e3:.3f} "
            f"ms; communication exposed {run.exposed_s * 1e3:.3f} ms, hidden "
            f"{run.hidden_s * 1e3:.3f} ms; overlap slowdown {run.slowdown_s * 1e3:.3f} ms"
        )
    if cost.phases:
        lines.append("training step by phase:")
        for name, phase in cost.phases.items():
            ran = cost.schedule.phases.get(name) if cost.schedule is not None else None
            hidden = f", {ran.hidden_s * 1e3:.3f} ms hidden" if ran and ran.hidden_s >= 5e-7 else ""
            lines.append(
                f"  {name}: {(phase.compute_time_s + phase.comm_time_s) * 1e3:.3f} ms "
                f"(compute {phase.compute_time_s * 1e3:.3f} ms, communication "
                f"{_size(phase.comm_bytes_per_device)}, {phase.comm_time_s * 1e3:.3f} ms{hidden})"
            )
        held = ", ".join(f"{k} {_size(v)}" for k, v in cost.memory_by_kind.items() if v)
        lines.append(f"memory at the peak: {held}")
    return "\n".join(lines)


def objective_note(searched: float, cost: Any, objective: str) -> str | None:
    """Why the search's objective (`searched`, as progress showed it) is not the program's,
    where the two read differently: where readers of several groups share two shardings of one
    value, the search prices the second per group, the program makes it once
    (docs/concepts/search.md). None where they agree,
    or differ by the search's integer scaling alone (which may cross a unit: 1024 B, 1 KiB)."""
    from autoshard.units import in_units

    unit = "B" if objective == "bytes" else "s"
    made = cost.comm_bytes_per_device if unit == "B" else cost.objective
    scaling = abs(searched - made) <= 1e-6 * max(abs(searched), abs(made))
    if scaling or in_units(searched, unit) == in_units(made, unit):
        return None
    why = " (a reshard counted per reader)" if searched > made else ""
    return f"search objective {in_units(searched, unit)}{why}; the program: {in_units(made, unit)}"


def breakdown_summary(block: Mapping[str, Any]) -> str:
    """The top lines of a plan's `breakdown`: each run of repeated layers (one layer, and all),
    the rest, the costliest collectives, and the memory at the peak by kind."""

    from autoshard.units import format_bytes as _size

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


def print_checks(checks: Any) -> None:
    for name, check in checks.items():
        replica = (
            f", replicas differ by {check.max_replica_err:.3g}" if check.max_replica_err else ""
        )
        print(
            f"  {name}: max abs err {check.max_abs_err:.3g}, max rel err "
            f"{check.max_rel_err:.3g} (tolerance {check.tolerance:g}){replica}"
            f"  {'ok' if check.ok else 'FAILED'}"
        )


def pipeline_summary(block: Mapping[str, Any]) -> str:
    """A pipelined plan's `pipeline` block in lines: the whole mesh, the step, each stage."""
    from autoshard.cost.schedule import Schedule
    from autoshard.units import format_bytes as _size

    budget = block["memory_budget_bytes"]
    deferred = Schedule.parse(block["schedule"]).splits_backward
    lines = [
        f"pipeline on mesh {block['mesh']} (axis {block['axis']}): step "
        f"{block['step_time_s'] * 1e3:.3f} ms ({block['schedule']}, {block['micro_batches']} "
        f"micro-batches), bubble {block['bubble']:.1%}, p2p "
        f"{_size(block['p2p']['bytes_per_device_per_micro_batch'])} per micro-batch, "
        f"{block['p2p']['time_s'] * 1e6:.1f} us (the cost below: a stage's model, "
        f"{block.get('stage_model_layers', '?')} layers and the ends, on a stage's devices, "
        "the plan each stage runs its layers in)"
    ]
    for c in block.get("considered", ()):
        lines.append(f"  considered: {c['words']}")
    for s, stage in enumerate(block["stages"]):
        first, stop = stage["layers"]
        compute, memory = stage["compute"], stage["memory"]
        weight = (f" (weight gradients {compute.get('weight_s', 0.0) * 1e3:.3f} ms, deferred)"
                  if deferred else "")  # fmt: skip
        lines.append(
            f"  stage {s}: layers {first}..{stop - 1}, forward {compute['forward_s'] * 1e3:.3f} "
            f"ms + backward {compute['backward_s'] * 1e3:.3f} ms{weight} per micro-batch, memory "
            f"{_size(memory['bytes_per_device'])} of {_size(budget)} "
            f"({memory['micro_batches_in_flight']:g} micro-batches in flight)"
        )
    for tied in block.get("tied", ()):
        first, last = tied["stages"]
        lines.append(
            f"  tied {tied['weight']}: a copy on stages {first} and {last} "
            f"({_size(tied['copy_bytes_per_device'])} per device), its gradients all-reduced "
            f"once a step ({_size(tied['sync']['bytes_per_device'])} per device, "
            f"{tied['sync']['time_s'] * 1e6:.1f} us)"
        )
    return "\n".join(lines)


def print_training(out: str, report: Any, how: str = "verify") -> None:
    """A training verification: the worst error of each kind, then each failure's line (a
    distributed run: then each rank's step time, compute and collectives)."""
    status = "ok" if report.ok else "FAILED"
    timing = report.timing
    where = f" as {report.devices} processes ({timing['backend']})" if timing else ""
    where += " in float64" if report.floats == "float64" else ""
    print(f"{how} {out}: {report.steps} training steps on {report.devices} devices{where} "
          f"against torch autograd: {status}")  # fmt: skip
    for what in ("loss", "gradient", "weight", "state"):
        checks = [c for c in report.checks if c.what == what]  # no weight updates: no optimizer
        if checks:
            tolerance = checks[0].tolerance
            print(f"  {what}: max rel err {report.worst(what):.3g} (tolerance {tolerance:g})")
    for failure in report.failures:
        print(f"  {failure.line()}")
    if timing:
        print(f"wall time {timing['wall_s']:.2f} s; per rank (mean step, compute, collectives):")
        for rank in timing["ranks"]:
            steps = rank["step_s"]
            kinds = ", ".join(f"{kind} {c['count']}x {c['seconds'] * 1e3:.2f} ms"
                              for kind, c in rank["collectives"].items())  # fmt: skip
            print(f"  rank {rank['rank']}: step {sum(steps) / len(steps) * 1e3:.2f} ms, compute "
                  f"{rank['compute_s'] * 1e3:.2f} ms; {kinds or 'no collectives'}")  # fmt: skip

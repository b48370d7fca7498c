"""A pipelined plan: the pipeline a request asks for, checked, and its price from one
intra-stage plan (docs/concepts/pipeline.md).

The intra-stage plan is solved once: the search plans the whole step on the sub-mesh without
the pipeline axis (`sub_cluster`), at the micro-batch size; `price_pipeline` then cuts that
plan's priced ops into stages. The repeated layers are split evenly over the stages (the first
stages take one more where they do not divide); an op outside the layers goes to the first
stage where it comes before them in its phase (the embedding) and to the last where it comes
after (the head, the loss), the backward mirrored, and a gradient's sync and update to the
stage that computed it. A stage's forward and backward seconds per
micro-batch are its ops' seconds and their collectives' per run; its gradient sync and update
run once, after the pipeline drains. The schedule (`cost.schedule.simulate`) turns them and
the boundary send into the step's critical path and the activations each stage keeps.
Approximations: every layer of a run is priced alike, the sub-plan is chosen under the
budget times the stages (a 1F1B first stage holds `p` micro-batches of `L/p` layers, as much
as the whole sub-plan's one; `plan_pipelined` lowers it where a stage does not fit), and
memory is what the sub-plan holds at its peak, regrouped by stage, its activations times the
micro-batches in flight.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoshard.analysis.repeats import Run, find_repeats
from autoshard.cost.cluster import Cluster
from autoshard.cost.liveness import held_bytes
from autoshard.cost.price import Cost, held_at_peak, send_time
from autoshard.cost.schedule import Pipeline, Schedule, StageTime, simulate
from autoshard.deadline import NEVER, Deadline
from autoshard.errors import PipelineError
from autoshard.ir.graph import Graph
from autoshard.mesh import Mesh
from autoshard.plan import Plan
from autoshard.program import Program
from autoshard.progress import Tracker
from autoshard.search.budget import NoPlanFits, Planned, auto_plan
from autoshard.search.options import SolverOptions

PIPELINE_AXIS = "pp"
"""The mesh axis name that asks for a pipeline over that axis (`--mesh pp=8,dp=8,tp=8`)."""

_ORDERED = ("forward", "backward", "gradient_sync", "optimizer")


@dataclass(frozen=True)
class PipelineAsk:
    """A pipeline over mesh axis `axis`, in `schedule`'s order; the micro-batches are the
    training step's."""

    axis: int
    schedule: Schedule = Schedule()


def pipeline_ask(mesh: Mesh, axis: str | None, schedule: str | None) -> PipelineAsk | None:
    """The pipeline asked for: over `axis` (a number or name), else over the axis named `pp`;
    None where neither (a `schedule` then is an error: there is no pipeline to order)."""
    if axis is None and PIPELINE_AXIS in mesh.axis_names:
        axis = PIPELINE_AXIS
    if axis is None:
        if schedule is not None:
            raise PipelineError(
                f"--schedule {schedule} needs a pipeline: name a mesh axis {PIPELINE_AXIS} "
                f"or give --pipeline-axis (mesh {mesh} has axes {mesh.axes_text()})"
            )
        return None
    try:
        index = mesh.axis(axis)
    except ValueError as error:
        raise PipelineError(f"--pipeline-axis: {error}") from None
    return PipelineAsk(index, Schedule() if schedule is None else Schedule.parse(schedule))


def check_pipeline(ask: PipelineAsk, mesh: Mesh, layers: int, micro_batches: int) -> Pipeline:
    """The pipeline `ask` makes on `mesh` for a model of `layers` repeated layers, or the
    error naming what cannot be."""
    stages = mesh.shape[ask.axis]
    if not layers:
        raise PipelineError(
            "a pipeline cuts repeated layers into stages, and the model has none: plan it "
            "without a pipeline axis"
        )
    if mesh.ndim < 2:
        raise PipelineError(
            f"pipeline axis {ask.axis} is the whole mesh {mesh}: add an axis for the stages' "
            f"devices (e.g. pp={stages},dp=1)"
        )
    if stages > layers:
        raise PipelineError(
            f"pipeline axis {ask.axis} has {stages} stages but the model has {layers} repeated "
            f"layers; choose a pipeline axis of at most {layers}"
        )
    pipeline = Pipeline(stages, micro_batches, ask.schedule)
    chunks = stages * ask.schedule.virtual
    if ask.schedule.virtual > 1 and chunks > layers:
        most = layers // stages
        instead = f"interleaved:{most} at most, or 1f1b" if most >= 2 else "1f1b or gpipe"
        raise PipelineError(
            f"schedule {ask.schedule.flag} on {stages} stages cuts the model into {chunks} "
            f"chunks but it has {layers} repeated layers; choose {instead}"
        )
    return pipeline


def sub_cluster(cluster: Cluster, axis: int) -> Cluster:
    """The cluster of one stage: the mesh without the pipeline axis, its links, the budget
    times the stages (the module's docstring)."""
    keep = [a for a in range(cluster.mesh.ndim) if a != axis]
    names = tuple(cluster.mesh.axis_names[a] for a in keep) if cluster.mesh.axis_names else ()
    mesh = Mesh(tuple(cluster.mesh.shape[a] for a in keep), names, cluster.mesh.name)
    return dataclasses.replace(
        cluster, mesh=mesh, bandwidth=tuple(cluster.bandwidth[a] for a in keep),
        latency=tuple(cluster.latency[a] for a in keep),
        memory=cluster.memory * cluster.mesh.shape[axis],
    )  # fmt: skip


@dataclass(frozen=True)
class StagePrice:
    """One stage: its repeated layers, devices, seconds per micro-batch (forward, backward),
    seconds once per step (gradient sync and update), and memory per device: what it holds
    besides activations, its activations per micro-batch, how many it keeps, the total."""

    layers: range
    devices: int
    forward_s: float
    backward_s: float
    update_s: float
    held_bytes: int
    activation_bytes: int
    in_flight: float
    memory_bytes: int

    def to_json(self) -> dict[str, object]:
        return {
            "layers": [self.layers.start, self.layers.stop],
            "devices": self.devices,
            "compute": {"forward_s": self.forward_s, "backward_s": self.backward_s,
                        "update_s": self.update_s},
            "memory": {"bytes_per_device": self.memory_bytes, "held_bytes": self.held_bytes,
                       "activation_bytes_per_micro_batch": self.activation_bytes,
                       "micro_batches_in_flight": self.in_flight},
        }  # fmt: skip


@dataclass(frozen=True)
class PipelinePrice:
    """A pipelined plan's price: its stages, the boundary send (bytes per device per
    micro-batch, seconds), the step's critical path plus the update, and the bubble."""

    pipeline: Pipeline
    axis: int
    stages: tuple[StagePrice, ...]
    send_bytes: int
    send_s: float
    step_s: float
    bubble: float

    @property
    def memory_bytes(self) -> int:
        """The most any stage's device holds."""
        return max(stage.memory_bytes for stage in self.stages)

    def __str__(self) -> str:
        """As the story says it."""
        p = self.pipeline
        return (f"pipeline of {p.stages} stages ({p.schedule}, {p.micro_batches} micro-batches, "
                f"bubble {self.bubble:.0%})").replace("%", " %")  # fmt: skip

    def to_json(self) -> dict[str, object]:
        p = self.pipeline
        return {
            "axis": self.axis,
            "schedule": p.schedule.flag,
            "micro_batches": p.micro_batches,
            "bubble": self.bubble,
            "step_time_s": self.step_s,
            "p2p": {"bytes_per_device_per_micro_batch": self.send_bytes,
                    "bytes_per_device": 2 * self.send_bytes * p.micro_batches * p.schedule.virtual,
                    "time_s": self.send_s},
            "stages": [stage.to_json() for stage in self.stages],
        }  # fmt: skip


def split_layers(layers: int, stages: int) -> tuple[range, ...]:
    """Contiguous runs of `layers` over `stages`, the first ones a layer longer where they do
    not divide."""
    each, extra = divmod(layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + each + (1 if s < extra else 0))
    return tuple(range(a, b) for a, b in zip(bounds, bounds[1:], strict=False))


def layer_runs(graph: Graph) -> tuple[int, dict[str, Run]]:
    """The model's repeated layers (the forward's largest run: its count) and, per phase, the
    run of those layers in it (a phase without one has none)."""
    runs = [r for r in find_repeats(graph).runs if r.count >= 2]
    by_phase: dict[str, list[Run]] = {}
    for run in runs:
        by_phase.setdefault(graph.phase(graph.ops[run.start].name), []).append(run)
    forward = max(by_phase.get("forward", []), key=lambda r: (r.ops, -r.start), default=None)
    if forward is None:
        return 0, {}
    chosen = {"forward": forward}
    for phase, found in by_phase.items():
        alike = [r for r in found if r.count == forward.count]
        if phase != "forward" and alike:
            chosen[phase] = max(alike, key=lambda r: (r.ops, -r.start))
    return forward.count, chosen


def stage_of_ops(graph: Graph, layers: Sequence[range], runs: Mapping[str, Run]) -> list[int]:
    """Each op's stage (the module's docstring)."""
    count, last = sum(len(r) for r in layers), len(layers) - 1
    stage_of = [s for s, r in enumerate(layers) for _ in r]
    found: list[int] = []
    made: dict[str, int] = {}  # value -> the stage of its producer
    for i, op in enumerate(graph.ops):
        phase = graph.phase(op.name)
        run = runs.get(phase)
        mirrored = phase == "backward"
        j = run.layer(i) if run is not None else None
        follows = [made[name] for name in op.inputs if name in made]
        if j is not None:
            found.append(stage_of[count - 1 - j if mirrored else j])
        elif phase in ("gradient_sync", "optimizer") and follows:
            found.append(follows[0])  # a gradient's sync and update: where it was computed
        else:
            before = run is not None and i < run.start
            found.append(0 if before != mirrored else last)
        made |= dict.fromkeys(op.outputs, found[-1])
    return found


def boundary_bytes(graph: Graph, plan: Plan, run: Run) -> int:
    """Bytes per device of what one layer hands the next (the residual stream): the values
    the second layer reads that the first computes or reads, as the plan holds them."""
    if run.count < 2:
        return 0
    first = {i for i in run.layers[0]}
    made = {out for i in first for out in graph.ops[i].outputs}
    read = {name for i in first for name in graph.ops[i].inputs}
    crossing = sorted(
        {name for i in run.layers[1] for name in graph.ops[i].inputs if name in made | read}
        - set(graph.weights)
    )
    return sum(
        held_bytes(name, graph.values[name].shape, graph.values[name].dtype,
                   plan.values[name], plan.mesh, graph.fused)
        for name in crossing if name in plan.values
    )  # fmt: skip


def price_pipeline(
    graph: Graph, plan: Plan, program: Program, cost: Cost, cluster: Cluster, ask: PipelineAsk
) -> PipelinePrice:
    """The pipelined step on `cluster` whose intra-stage plan is `plan`, its `program` priced
    `cost` on `sub_cluster(cluster, ask.axis)`; a stage sends the layer boundary
    (`boundary_bytes`) per micro-batch."""
    count, runs = layer_runs(graph)
    pipeline = check_pipeline(ask, cluster.mesh, count, graph.micro_batches)
    sent = boundary_bytes(graph, plan, runs["forward"])
    layers = split_layers(count, pipeline.stages)
    stage = stage_of_ops(graph, layers, runs)
    p = pipeline.stages
    spent = {phase: [0.0] * p for phase in _ORDERED}
    charged: dict[str, float] = {}
    for c in cost.collectives:
        charged[c.op] = charged.get(c.op, 0.0) + c.seconds
    held, _ = held_at_peak(graph, program)
    kept, acts = [0] * p, [0] * p
    for i, op in enumerate(graph.ops):
        seconds = (cost.ops[op.name].seconds if op.name in cost.ops else 0.0) + charged.get(
            op.name, 0.0
        )
        spent[graph.phase(op.name)][stage[i]] += seconds / graph.runs(op.name)
        for kind, size in held.get(op.name, {}).items():
            if kind == "activations":
                acts[stage[i]] += size
            else:
                kept[stage[i]] += size
    kept[0] += sum(held.get("", {}).values())
    times = [StageTime(spent["forward"][s], spent["backward"][s]) for s in range(p)]
    send_s = send_time(sent, (ask.axis,), cluster)
    timeline = simulate(pipeline, times, send_s, training="backward" in graph.phases.values())
    update = [spent["gradient_sync"][s] + spent["optimizer"][s] for s in range(p)]
    devices = cluster.mesh.size // p
    stages = tuple(
        StagePrice(
            layers=layers[s], devices=devices, forward_s=times[s].forward,
            backward_s=times[s].backward, update_s=update[s], held_bytes=kept[s],
            activation_bytes=acts[s], in_flight=timeline.in_flight[s],
            memory_bytes=kept[s] + math.ceil(acts[s] * timeline.in_flight[s]),
        )
        for s in range(p)
    )  # fmt: skip
    return PipelinePrice(
        pipeline=pipeline, axis=ask.axis, stages=stages, send_bytes=sent,
        send_s=send_s, step_s=timeline.step_s + max(update), bubble=timeline.bubble,
    )  # fmt: skip


REFITS = 3
"""How many times the intra-stage plan is searched again, under a lower budget, where its
largest stage does not fit: each is a solve."""


def plan_pipelined(
    graph: Graph,
    cluster: Cluster,
    ask: PipelineAsk,
    options: SolverOptions,
    tracker: Tracker | None = None,
    deadline: Deadline = NEVER,
) -> tuple[Planned, PipelinePrice, Cluster]:
    """The intra-stage plan searched on `sub_cluster(cluster, ask.axis)`, its pipeline priced,
    and the sub-cluster it was found on. Where the largest stage does not fit the budget, the
    search runs again under the sub-cluster's budget scaled down by the overshoot (`REFITS`
    times at most, while some plan fits it): the budget times the stages bounds a stage's
    weights and activations together, not as the schedule keeps them."""
    sub = sub_cluster(cluster, ask.axis)
    planned = auto_plan(graph, sub, (), options, tracker, deadline)
    priced = price_pipeline(graph, planned.plan, planned.program, planned.cost, cluster, ask)
    for _ in range(REFITS):
        if priced.memory_bytes <= cluster.memory:
            break
        lower = dataclasses.replace(sub, memory=sub.memory * cluster.memory // priced.memory_bytes)
        try:
            again = auto_plan(graph, lower, (), options, tracker, deadline)
        except NoPlanFits:
            break
        sub, planned = lower, again
        priced = price_pipeline(graph, planned.plan, planned.program, planned.cost, cluster, ask)
    return planned, priced, sub

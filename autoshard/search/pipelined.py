"""A pipelined plan: the pipeline a request asks for, checked, and its price from an
intra-stage plan (docs/concepts/pipeline.md; the search for it: `search.pipesearch`).

`layer_costs` cuts a stage's plan's priced ops into parts: the ops before the repeated layers
(the embedding), each layer, the ops after them (the final norm, the head, the loss). An op of
a layer goes to its layer (the backward mirrored); an op outside the layers to the first part
where it comes before them in its phase and to the last where it comes after; a gradient's
sync and update to the part that computed it. A part's forward and backward seconds per
micro-batch are its ops' seconds and their collectives' per run; its gradient sync and update
run once, after the pipeline drains. `price_stages` splits the model's layers into contiguous
stages so that the slowest is the fastest (`balanced_split`: the first stage also runs the
embedding, the last the head), sums each stage's parts, and the schedule
(`cost.schedule.simulate`) turns them and the boundary send into the step's critical path and
the activations each stage keeps. A weight read at both ends (an embedding tied to the head,
`search.tied`) is a copy on the first stage and on the last, its gradients summed by an
all-reduce of the two before their updates (`cost.price.tied_sync_time`). Approximations:
every layer of a run is priced alike (a stage deeper than the plan's model repeats its last
layer), and memory is what the plan holds at its peak, regrouped by part, its activations
times the micro-batches in flight.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoshard.analysis.repeats import Run, find_repeats
from autoshard.annotations import Annotation
from autoshard.cost.cluster import Cluster
from autoshard.cost.liveness import held_bytes
from autoshard.cost.price import Cost, held_at_peak, send_time, tied_sync_time
from autoshard.cost.schedule import Pipeline, Schedule, StageTime, simulate
from autoshard.errors import PipelineError
from autoshard.ir.graph import Graph
from autoshard.mesh import Mesh
from autoshard.plan import Plan
from autoshard.program import Program
from autoshard.search.backward_split import weight_gradient_ops
from autoshard.search.tied import TiedCost, tied_costs

PIPELINE_AXIS = "pp"
"""The mesh axis name that asks for a pipeline over that axis (`--mesh pp=8,dp=8,tp=8`)."""

_ORDERED = ("forward", "backward", "gradient_sync", "optimizer")


@dataclass(frozen=True)
class PipelineAsk:
    """A pipeline over mesh axis `axis`: `stages` of its positions (0: the axis's size; fewer
    split it, each stage's devices keeping `size / stages` of it), run in `schedule`'s order
    (None: the fastest that fits, `search.pipesearch`); the micro-batches are the training
    step's."""

    axis: int
    schedule: Schedule | None = None
    stages: int = 0

    def on(self, mesh: Mesh) -> int:
        """The stages on `mesh`."""
        return self.stages or mesh.shape[self.axis]


@dataclass(frozen=True)
class AutoPipeline:
    """Pipelining allowed (`--pipeline auto`): the search tries the divisors of mesh axis
    `axis` (None: the outermost) as stages, or none (`search.pipesearch.choose_pipeline`);
    `schedule` fixes the schedule (None: the search picks)."""

    axis: int | None = None
    schedule: Schedule | None = None


def pipeline_ask(
    mesh: Mesh, axis: str | None, schedule: str | None, auto: bool = False
) -> PipelineAsk | AutoPipeline | None:
    """The pipeline asked for: over `axis` (a number or name), else over the axis named `pp`;
    the search's choice where `auto` (over that axis where there is one); None where neither (a
    `schedule` then is an error: there is no pipeline to order)."""
    if axis is None and PIPELINE_AXIS in mesh.axis_names:
        axis = PIPELINE_AXIS
    order = None if schedule is None else Schedule.parse(schedule)
    if axis is None and not auto:
        if schedule is not None:
            raise PipelineError(
                f"--schedule {schedule} needs a pipeline: name a mesh axis {PIPELINE_AXIS}, "
                f"give --pipeline-axis or --pipeline auto (mesh {mesh} has axes "
                f"{mesh.axes_text()})"
            )
        return None
    try:
        index = None if axis is None else mesh.axis(axis)
    except ValueError as error:
        raise PipelineError(f"--pipeline-axis: {error}") from None
    if auto:
        return AutoPipeline(index, order)
    assert index is not None
    return PipelineAsk(index, order)


def check_pipeline(ask: PipelineAsk, mesh: Mesh, layers: int, micro_batches: int) -> Pipeline:
    """The pipeline `ask` makes on `mesh` for a model of `layers` repeated layers (its
    schedule 1F1B where the search picks), or the error naming what cannot be."""
    stages = ask.on(mesh)
    schedule = ask.schedule or Schedule()
    if not layers:
        raise PipelineError(
            "a pipeline cuts repeated layers into stages, and the model has none: plan it "
            "without a pipeline axis"
        )
    if mesh.ndim < 2 and stages == mesh.shape[ask.axis]:
        raise PipelineError(
            f"pipeline axis {ask.axis} is the whole mesh {mesh}: add an axis for the stages' "
            f"devices (e.g. pp={stages},dp=1)"
        )
    if stages > layers:
        raise PipelineError(
            f"pipeline axis {ask.axis} has {stages} stages but the model has {layers} repeated "
            f"layers; choose a pipeline axis of at most {layers}"
        )
    pipeline = Pipeline(stages, micro_batches, schedule)
    chunks = stages * schedule.virtual
    if schedule.virtual > 1 and chunks > layers:
        most = layers // stages
        instead = f"interleaved:{most} at most, or 1f1b" if most >= 2 else "1f1b or gpipe"
        raise PipelineError(
            f"schedule {schedule.flag} on {stages} stages cuts the model into {chunks} "
            f"chunks but it has {layers} repeated layers; choose {instead}"
        )
    return pipeline


def sub_cluster(cluster: Cluster, axis: int, stages: int = 0) -> Cluster:
    """The cluster of one stage of `stages` on mesh axis `axis` (0: the axis's size): the mesh
    without the axis, or with `size / stages` of it where the stages split it, its links,
    the budget per device as it is (a stage's model holds a stage's layers)."""
    size = cluster.mesh.shape[axis]
    left = size // (stages or size)
    keep = [a for a in range(cluster.mesh.ndim) if a != axis or left > 1]
    names = tuple(cluster.mesh.axis_names[a] for a in keep) if cluster.mesh.axis_names else ()
    shape = tuple(left if a == axis else cluster.mesh.shape[a] for a in keep)
    return dataclasses.replace(
        cluster, mesh=Mesh(shape, names, cluster.mesh.name),
        bandwidth=tuple(cluster.bandwidth[a] for a in keep),
        latency=tuple(cluster.latency[a] for a in keep), memory=cluster.memory,
    )  # fmt: skip


def stage_annotations(
    annotations: Sequence[Annotation], axis: int, mesh: Mesh, stages: int = 0
) -> tuple[Annotation, ...]:
    """`annotations` of the whole `mesh` as a stage's mesh names them (`sub_cluster`): the
    axes after the pipeline axis one lower where the stages take the whole axis; an
    annotation splitting over that axis is refused (a stage holds its own layers, not a
    slice of the others'); where the stages split it, what is left of it keeps its number."""
    dropped = (stages or mesh.shape[axis]) == mesh.shape[axis]
    found = []
    for annotation in annotations:
        sharding = annotation.sharding
        used = {a for axes in sharding.split_axes for a in axes} | set(sharding.partial_axes)
        if axis in used and dropped:
            raise PipelineError(
                f"annotation {annotation} uses the pipeline axis {axis} of mesh {mesh}; a "
                f"stage's devices are the other axes: split over those"
            )
        if not dropped:
            found.append(annotation)
            continue
        lower = {a: a - (a > axis) for a in used}
        found.append(dataclasses.replace(annotation, sharding=dataclasses.replace(
            sharding, split_axes=tuple(tuple(lower[a] for a in axes)
                                       for axes in sharding.split_axes),
            partial_axes=tuple(lower[a] for a in sharding.partial_axes),
        )))  # fmt: skip
    return tuple(found)


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
    weight_s: float = 0.0  # of `backward_s`, the weight gradients' (what zero bubble defers)

    def to_json(self) -> dict[str, object]:
        return {
            "layers": [self.layers.start, self.layers.stop],
            "devices": self.devices,
            "compute": {"forward_s": self.forward_s, "backward_s": self.backward_s,
                        "weight_s": self.weight_s, "update_s": self.update_s},
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
    tied: tuple[TiedCost, ...] = ()
    tied_s: tuple[float, ...] = ()  # each tied weight's gradient sum (seconds, once a step)
    chunks: tuple[range, ...] = ()  # an interleaved schedule's virtual stages, in order
    chunk_times: tuple[StageTime, ...] = ()  # each chunk's seconds per micro-batch

    @property
    def memory_bytes(self) -> int:
        """The most any stage's device holds."""
        return max(stage.memory_bytes for stage in self.stages)

    def __str__(self) -> str:
        """As the story says it."""
        p = self.pipeline
        tied = ""
        if trained := [t.weight for t in self.tied if t.gradient_bytes]:
            tied = (f"; the tied {', '.join(trained)} held on stages 0 and {p.stages - 1}, "
                    "its gradients summed after the backward")  # fmt: skip
        return (f"pipeline of {p.stages} stages ({p.schedule}, {p.micro_batches} micro-batches, "
                f"bubble {self.bubble:.0%}{tied})").replace("%", " %")  # fmt: skip

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
            **({"chunks": self.chunks_json()} if p.schedule.virtual > 1 else {}),
            **({"tied": self.tied_json()} if self.tied else {}),
        }  # fmt: skip

    def tied_json(self) -> list[dict[str, object]]:
        """The weights the first and the last stage both hold (`search.tied`): each stage's
        copy's bytes per device and, for a trained one, its gradient's all-reduce."""
        ends = [0, self.pipeline.stages - 1]
        return [{"weight": t.weight, "stages": ends, "copy_bytes_per_device": t.copy_bytes,
                 "sync": {"bytes_per_device": t.gradient_bytes, "time_s": seconds}}
                for t, seconds in zip(self.tied, self.tied_s, strict=True)]  # fmt: skip

    def chunks_json(self) -> list[dict[str, object]]:
        """An interleaved schedule's virtual stages: the layers split into `stages * virtual`
        chunks so that the slowest is the fastest (`balanced_split`: the first chunk also runs
        the embedding, the last the head; evenly where those cost nothing), chunk `c` on stage
        `c % stages` (Megatron's and torch's order; the price counts each stage's layers, not
        where its chunks fall), as the partition and the exports place them."""
        p = self.pipeline
        layers = self.stages[-1].layers.stop
        chunks = self.chunks or split_layers(layers, p.stages * p.schedule.virtual)
        found: list[dict[str, object]] = []
        for i, c in enumerate(chunks):
            found.append({"layers": [c.start, c.stop], "stage": i % p.stages})
            if i < len(self.chunk_times):
                t = self.chunk_times[i]
                found[-1]["compute"] = {"forward_s": t.forward, "backward_s": t.backward,
                                        "weight_s": t.weight}  # fmt: skip
        return found


def split_layers(layers: int, stages: int) -> tuple[range, ...]:
    """Contiguous runs of `layers` over `stages`, the first ones a layer longer where they do
    not divide."""
    return _runs([layers // stages + (1 if s < layers % stages else 0) for s in range(stages)])


def _runs(counts: Sequence[int]) -> tuple[range, ...]:
    bounds = [0, *itertools.accumulate(counts)]
    return tuple(range(a, b) for a, b in itertools.pairwise(bounds))


def balanced_split(
    layers: int, stages: int, layer_s: float, first_s: float, last_s: float, least: int = 1
) -> tuple[range, ...]:
    """Contiguous runs of `layers` over `stages` (at least `least` layers each) whose slowest
    stage is the fastest, a layer taking `layer_s`, the first stage `first_s` more (the
    embedding) and the last `last_s` more (the head, the loss). Of the counts that reach
    the least bound, the extra layers go to the stages with the most room, the latest first.

    Worked example: 10 layers, 4 stages, 1 s a layer, the head 1.5 s: the bound 3 s gives
    3, 3, 3 and 1; the extra 0 layers leave it; an even split (3, 3, 2, 2) would end at
    3.5 s."""
    if stages == 1 or layer_s <= 0:
        return split_layers(layers, stages)
    ends = (first_s, last_s)
    bounds = sorted({extra + n * layer_s for extra in (0.0, *ends) for n in range(1, layers + 1)})
    for bound in bounds:
        counts = [int((bound - (first_s if s == 0 else last_s if s == stages - 1 else 0.0))
                      / layer_s + 1e-9) for s in range(stages)]  # fmt: skip
        if min(counts) >= least and sum(counts) >= layers:
            break
    else:
        return split_layers(layers, stages)
    while sum(counts) > layers:  # give back from the stage that ends latest
        times = [counts[s] * layer_s + (first_s if s == 0 else 0.0)
                 + (last_s if s == stages - 1 else 0.0) for s in range(stages)]  # fmt: skip
        s = max((s for s in range(stages) if counts[s] > least), key=lambda s: (times[s], s))
        counts[s] -= 1
    return _runs(counts)


def place_chunks(
    split: Sequence[range], virtual: int, layer_s: float, first_s: float, last_s: float
) -> tuple[range, ...]:
    """An interleaved schedule's chunks (chunk `c` on position `c % p`), each position's
    layers (`split`, by count) spread over its `virtual` chunks so that its slowest chunk is
    the fastest (`balanced_split`): the first chunk also runs the embedding (`first_s`), the
    last the head (`last_s`); where they cost nothing, evenly.

    Worked example: 10 layers of 1 s, the head 3 s, 2 positions of 2 chunks: the positions
    hold 7 and 3 layers (7 s and 6 s); position 1's 3 layers go 2 to chunk 1 and 1 to chunk 3
    (with the head, 4 s), position 0's 4 and 3: chunks 0..3, 4..5, 6..8, 9."""
    p = len(split)
    counts = [0] * (p * virtual)
    for s, layers in enumerate(split):
        first = first_s if s == 0 else 0.0
        last = last_s if s == p - 1 else 0.0
        for k, run in enumerate(balanced_split(len(layers), virtual, layer_s, first, last)):
            counts[k * p + s] = len(run)
    return _runs(counts)


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


def model_layer(layer: int, depth: int, total: int) -> int:
    """The layer of a stage's model `depth` layers deep that layer `layer` of the model's
    `total` runs as (layers are alike): itself where the stage's model has it short of its
    last, the stage's model's last (which borders the head) for the model's last, a middle
    one for the others (which border layers on both sides)."""
    if layer < depth - 1:
        return layer
    return depth - 1 if layer == total - 1 else max(depth - 2, 0)


@dataclass(frozen=True)
class LayerCosts:
    """An intra-stage plan's price by part of its model: the ops before the repeated layers
    (part 0), each layer (1 .. `depth`), the ops after them (the last part). Per part: the
    forward's and the backward's seconds per micro-batch, the seconds once a step (gradient
    sync, update), the bytes held at the plan's peak besides activations, and the activations'
    bytes of one micro-batch; and the boundary a stage sends per micro-batch."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    update: tuple[float, ...]
    held: tuple[int, ...]
    activations: tuple[int, ...]
    send_bytes: int
    training: bool
    tied: tuple[TiedCost, ...] = ()
    weight: tuple[float, ...] = ()  # of `backward`, the weight gradients' (`search.backward_split`)

    @property
    def depth(self) -> int:
        return len(self.forward) - 2

    def parts(self, stage: int, stages: int, layers: range, total: int) -> list[int]:
        """The parts stage `stage` of `stages` runs, holding `layers` of the model's `total`:
        layer `g` is the plan's model's layer `g` where it has it, the model's last layer
        its last, another a middle one of it (layers are alike; the first and the last
        border the embedding and the head)."""
        first = [0] if stage == 0 else []
        last = [self.depth + 1] if stage == stages - 1 else []
        return first + [self._part(g, total) for g in layers] + last

    def _part(self, layer: int, total: int) -> int:
        return 1 + model_layer(layer, self.depth, total)

    def time(self, parts: Sequence[int]) -> StageTime:
        """The seconds per micro-batch of running `parts`: forward, backward, and of that the
        weight gradients'."""
        weight = sum(self.weight[j] for j in parts) if self.weight else 0.0
        return StageTime(sum(self.forward[j] for j in parts),
                         sum(self.backward[j] for j in parts), weight)  # fmt: skip

    def chunk_parts(self, chunks: Sequence[range], total: int) -> list[list[int]]:
        """The parts each of an interleaved schedule's `chunks` runs: the first the embedding,
        the last the head, each its layers."""
        last = len(chunks) - 1
        return [
            ([0] if c == 0 else [])
            + [self._part(g, total) for g in chunk]
            + ([self.depth + 1] if c == last else [])
            for c, chunk in enumerate(chunks)
        ]

    def layer_s(self) -> float:
        """A layer's forward and backward seconds per micro-batch (the layers' mean)."""
        inner = range(1, self.depth + 1)
        return sum(self.forward[j] + self.backward[j] for j in inner) / max(self.depth, 1)


def layer_parts(graph: Graph, found: tuple[int, Mapping[str, Run]] | None = None) -> list[int]:
    """Each op's part of `graph` as `layer_costs` prices it: 0 before the repeated layers,
    `1 + j` layer `j`'s (the backward mirrored), the last after them; `found`: its
    `layer_runs`, where known."""
    count, runs = found or layer_runs(graph)
    parts = (range(0, 0), *(range(j, j + 1) for j in range(count)), range(count, count))
    return stage_of_ops(graph, parts, runs)


def layer_costs(graph: Graph, plan: Plan, program: Program, cost: Cost) -> LayerCosts:
    """`LayerCosts` of `plan` on `graph`, its `program` priced `cost`: each op's seconds and
    those of the collectives it is charged, per run, and what it holds at the peak, go to
    its part (`stage_of_ops`, each layer a stage of its own); what no op owns (a graph input)
    to the first."""
    count, runs = layer_runs(graph)
    part, n = layer_parts(graph, (count, runs)), count + 2
    spent = {phase: [0.0] * n for phase in _ORDERED}
    weight, deferred = [0.0] * n, weight_gradient_ops(graph, part)
    charged: dict[str, float] = {}
    for c in cost.collectives:
        charged[c.op] = charged.get(c.op, 0.0) + c.seconds
    held, _ = held_at_peak(graph, program)
    kept, acts = [0] * n, [0] * n
    for i, op in enumerate(graph.ops):
        seconds = cost.ops[op.name].seconds if op.name in cost.ops else 0.0
        seconds += charged.get(op.name, 0.0)
        spent[graph.phase(op.name)][part[i]] += seconds / graph.runs(op.name)
        if i in deferred:
            weight[part[i]] += seconds / graph.runs(op.name)
        for kind, size in held.get(op.name, {}).items():
            if kind == "activations":
                acts[part[i]] += size
            else:
                kept[part[i]] += size
    kept[0] += sum(held.get("", {}).values())
    update = [spent["gradient_sync"][j] + spent["optimizer"][j] for j in range(n)]
    return LayerCosts(
        forward=tuple(spent["forward"]), backward=tuple(spent["backward"]), update=tuple(update),
        held=tuple(kept), activations=tuple(acts),
        send_bytes=boundary_bytes(graph, plan, runs["forward"]) if runs else 0,
        training="backward" in graph.phases.values(), tied=tied_costs(graph, plan, part, n - 1),
        weight=tuple(weight),
    )  # fmt: skip


def price_stages(
    costs: LayerCosts, cluster: Cluster, ask: PipelineAsk, layers: int, micro_batches: int
) -> PipelinePrice:
    """The pipelined step on `cluster` of a model of `layers` repeated layers whose stages
    run the plan `costs` prices: the layers split so that the slowest stage is the fastest
    (`balanced_split`), each stage's parts summed, the schedule simulated with the boundary's
    send on the pipeline axis's link."""
    pipeline = check_pipeline(ask, cluster.mesh, layers, micro_batches)
    p, v = pipeline.stages, pipeline.schedule.virtual
    ends = (costs.forward[0] + costs.backward[0], costs.forward[-1] + costs.backward[-1])
    split = balanced_split(layers, p, costs.layer_s(), *ends, least=v)
    chunks = place_chunks(split, v, costs.layer_s(), *ends) if v > 1 else ()
    parts = [costs.parts(s, p, split[s], layers) for s in range(p)]
    chunk_times = [costs.time(ps) for ps in costs.chunk_parts(chunks, layers)]
    times = [_sum(chunk_times[s::p]) for s in range(p)] if chunks else [
        costs.time(ps) for ps in parts]  # fmt: skip
    send_s = send_time(costs.send_bytes, (ask.axis,), cluster)
    timeline = simulate(pipeline, chunk_times or times, send_s, training=costs.training)
    tied = costs.tied if p > 1 else ()  # the ends on two stages: each its copy, summed
    tied_s = tuple(tied_sync_time(t.gradient_bytes, 2, (ask.axis,), cluster) for t in tied)
    update = [sum(costs.update[j] for j in ps) + (sum(tied_s) if s in (0, p - 1) else 0.0)
              for s, ps in enumerate(parts)]  # fmt: skip
    devices = cluster.mesh.size // p
    stages = []
    for s, ps in enumerate(parts):
        kept, acts = sum(costs.held[j] for j in ps), sum(costs.activations[j] for j in ps)
        kept += sum(t.copy_bytes for t in tied if s == (p - 1 if t.first else 0))
        stages.append(StagePrice(
            layers=split[s], devices=devices, forward_s=times[s].forward,
            backward_s=times[s].backward, weight_s=times[s].weight, update_s=update[s],
            held_bytes=kept,
            activation_bytes=acts, in_flight=timeline.in_flight[s],
            memory_bytes=kept + math.ceil(acts * timeline.in_flight[s]),
        ))  # fmt: skip
    return PipelinePrice(
        pipeline=pipeline, axis=ask.axis, stages=tuple(stages), send_bytes=costs.send_bytes,
        send_s=send_s, step_s=timeline.step_s + max(update), bubble=timeline.bubble,
        tied=tied, tied_s=tied_s, chunks=chunks, chunk_times=tuple(chunk_times),
    )  # fmt: skip


def _sum(times: Sequence[StageTime]) -> StageTime:
    return StageTime(sum(t.forward for t in times), sum(t.backward for t in times),
                     sum(t.weight for t in times))  # fmt: skip


def price_pipeline(
    graph: Graph, plan: Plan, program: Program, cost: Cost, cluster: Cluster, ask: PipelineAsk,
    layers: int = 0,
) -> PipelinePrice:  # fmt: skip
    """The pipelined step on `cluster` of a model of `layers` repeated layers (0: `graph`'s)
    whose stages run `plan` (on `graph`: a stage's model, `analysis.shorten`), its `program`
    priced `cost` on the stage's cluster (`sub_cluster`)."""
    costs = layer_costs(graph, plan, program, cost)
    return price_stages(costs, cluster, ask, layers or costs.depth, graph.micro_batches)

"""A pipelined plan mapped onto the stages of the whole model, each lowered and partitioned.

A pipelined plan document decides the *stage's model* (`analysis.shorten`: the forward cut to
`stage_model_layers` repeated layers, embedding and head kept) on a stage's devices. Stage `s`
of the whole model (`analysis.stage_cut`) runs the layers of its range with that plan: each
layer takes the decisions of the stage's model's layer it was priced as
(`search.pipelined.model_layer`, as the exports unroll it), op for op by the repeated layers'
correspondence (`analysis.repeats`), its weights held as that layer's are; the ops outside
the layers (the embedding, the head) keep their own decisions, by name.

A boundary value (what a stage sends on) is held on both sides as the stage's model holds its
counterpart, complete (a partial sum reduced first: `plan.returned`), so the sender's device
and the receiver's device at the same place in their stages hold the same region and the
send moves each device's shard as it is.

This module partitions each stage's forward (`pipelined_partition`); `execute.stage_training`
its whole training step with the same mapping (`stage_map`, `stage_plan_of`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard.analysis.repeats import Run
from autoshard.analysis.shorten import layer_run, shortened
from autoshard.analysis.stage_cut import StageCut, cut_stages
from autoshard.cost.schedule import Schedule
from autoshard.document.plan_document import PlanDocument, decisions_for, plan_from_document
from autoshard.errors import AutoshardError
from autoshard.ir.graph import Graph
from autoshard.mesh import Device, Mesh
from autoshard.pipeline import Built, build, load_graphs
from autoshard.plan import Plan, plan_from_options, returned
from autoshard.search.pipelined import model_layer, split_layers
from autoshard.sharding import Sharding


class StageMapError(AutoshardError):
    """A pipelined plan whose stages cannot be mapped onto the model's layers."""


_MISSING = object()


@dataclass(frozen=True)
class StagePartition:
    """One stage: its cut of the whole model, its plan lowered and partitioned on the stage's
    mesh, and the whole mesh's linear index of each of its devices (in the stage mesh's
    linear order); a training step run by a schedule that splits the backward, the ops of
    its weight gradient (`execute.stage_training.stage_weight_ops`)."""

    cut: StageCut
    built: Built
    devices: tuple[int, ...]
    weight_ops: frozenset[str] = frozenset()  # a zero-bubble training step's `W` ops


@dataclass(frozen=True)
class PipelinedPartition:
    """Every stage of a pipelined plan, the whole mesh and its pipeline axis, the schedule and
    micro-batches, and how each boundary value is held (on the stage mesh). With `virtual`
    > 1, `stages` are the virtual stages (chunks) in order, chunk `c` on the pipeline axis's
    position `c % (len(stages) // virtual)`."""

    forward: Graph
    mesh: Mesh
    axis: int
    schedule: str
    micro_batches: int
    stages: tuple[StagePartition, ...]
    boundary: Mapping[str, Sharding]
    virtual: int = 1

    def position(self, chunk: int) -> int:
        """The pipeline axis's position of stage (chunk) `chunk`."""
        return chunk % (len(self.stages) // self.virtual)


@dataclass(frozen=True)
class StageMap:
    """A pipelined plan mapped onto the whole model: its forward, its repeated layers' `run`,
    each stage's cut, every op's and value's name in the stage's model (`names`), the depth
    of the stage's model, and the whole mesh and its pipeline axis."""

    forward: Graph
    run: Run
    cuts: tuple[StageCut, ...]
    names: Mapping[str, str]
    depth: int
    whole: Mesh
    axis: int


def stage_map(
    document: PlanDocument, path: str | Path, model: str | Path, dims: Mapping[str, int],
    virtual: int = 1,
) -> StageMap:  # fmt: skip
    """Plan document `document` (read from `path`, a pipelined plan) mapped onto the stages
    of the whole model `model` with `dims`, checked to fit; with `virtual` > 1, onto each
    stage's virtual stages (the pipeline block's `chunks`, `search.pipelined.PipelinePrice.
    chunks_json`: chunk `c` on stage `c % stages`)."""
    block = document.pipeline
    assert block is not None
    forward = load_graphs(model, dims, None)[0]
    run = layer_run(forward)
    ranges = [range(*s["layers"]) for s in block["stages"]]
    if run is None:
        raise StageMapError(f"plan {path} is pipelined but model {model} has no repeated layers")
    depth = int(block.get("stage_model_layers") or 0)
    if depth < 1:
        raise StageMapError(f"plan {path}'s pipeline block names no stage_model_layers; plan again")
    deepest = max(len(r) for r in ranges)
    if deepest > depth:
        raise StageMapError(
            f"plan {path}: a stage of {deepest} layers is deeper than the stage's model it "
            f"decides ({depth} layers); plan again"
        )
    if virtual > 1:  # the chunks the plan records (a plan from before: the same rule's)
        recorded = [range(*c["layers"]) for c in block.get("chunks", ())]
        ranges = recorded or list(split_layers(ranges[-1].stop, len(ranges) * virtual))
    cuts = tuple(cut_stages(forward, run, ranges))
    names = _cut_names(forward, run, ranges, depth)
    return StageMap(forward, run, cuts, names, depth, Mesh.parse(str(block["mesh"])),
                    int(block["axis"]))  # fmt: skip


def boundary_of(staged: StageMap, stage_plan: Plan, path: str | Path) -> dict[str, Sharding]:
    """How each boundary value is held: as its counterpart in the stage's model, complete."""
    names = staged.names
    sent = [v for cut in staged.cuts for v in cut.sends]
    if missing := [v for v in sent if names.get(v, v) not in stage_plan.values]:
        raise StageMapError(
            f"plan {path} cannot be mapped onto the stages: the boundary value {missing[0]!r} "
            "has no counterpart in the stage's model it decides"
        )
    return {v: returned(stage_plan.values[names.get(v, v)]) for v in sent}


def pipelined_partition(
    document: PlanDocument, path: str | Path, model: str | Path, dims: Mapping[str, int]
) -> PipelinedPartition:
    """Plan document `document` (read from `path`, a pipelined plan) partitioned stage by
    stage on the whole model `model` with `dims`: each stage's forward; an interleaved
    plan's, chunk by chunk (`stage_map`)."""
    block = document.pipeline
    assert block is not None
    decisions = decisions_for(document, path, document.mesh, model, dims)
    virtual = Schedule.parse(str(block["schedule"])).virtual
    staged = stage_map(document, path, model, dims, virtual)
    positions = len(staged.cuts) // virtual
    cut_model = shortened(staged.forward, staged.depth, staged.run)
    stage_plan = plan_from_document(decisions, cut_model, document.mesh, f"plan {path}")
    boundary = boundary_of(staged, stage_plan, path)
    stages = tuple(
        StagePartition(
            cut=cut,
            built=build(cut.graph, stage_plan_of(cut, stage_plan, staged.names, boundary, path)),
            devices=stage_devices(
                staged.whole, staged.axis, positions, cut.index % positions, document.mesh
            ),  # fmt: skip
        )
        for cut in staged.cuts
    )
    return PipelinedPartition(staged.forward, staged.whole, staged.axis, str(block["schedule"]),
                              int(block["micro_batches"]), stages, boundary, virtual)  # fmt: skip


def _cut_names(graph: Graph, run: Run, ranges: Sequence[range], depth: int) -> dict[str, str]:
    """Each op's and value's name in the stage's model, where it differs: layer `j` of the
    model is the stage's model's layer the search priced it as (`search.pipelined.
    model_layer`: its ops, their results, the weights they read); what is outside the layers
    keeps its name."""
    names: dict[str, str] = {}
    for stage in ranges:
        for j in stage:
            like = run.layers[model_layer(j, depth, run.count)]
            for i, c in zip(run.layers[j], like, strict=True):
                op, twin = graph.ops[i], graph.ops[c]
                names.setdefault(op.name, twin.name)
                for mine, theirs in zip(op.outputs, twin.outputs, strict=True):
                    names.setdefault(mine, theirs)
                for mine, theirs in zip(op.inputs, twin.inputs, strict=True):
                    if mine in graph.weights or mine in graph.constants:
                        names.setdefault(mine, theirs)
    return names


def counterpart(name: str, names: Mapping[str, str]) -> str:
    """The name of `name` in the stage's model: a forward op's or value's by `names`, a
    training step's (`name@grad0`, `name@sync`, ...: `training.step`) by the forward name
    before its first `@`."""
    if name in names:
        return names[name]
    base, at, suffix = name.partition("@")
    return f"{names[base]}@{suffix}" if at and base in names else name


def stage_plan_of(
    cut: StageCut, stage_plan: Plan, names: Mapping[str, str],
    boundary: Mapping[str, Sharding], path: str | Path, graph: Graph | None = None,
) -> Plan:  # fmt: skip
    """The stage's plan of `graph` (its forward, `cut.graph`, or its training step): every
    op's option and every weight's holding its counterpart's in the stage's model; what it
    receives held, and what it sends returned, as `boundary` (by the value's name, or, for a
    training step's gradients it receives and sends, by the name they are held as)."""
    graph = graph or cut.graph

    def twin(name: str, table: Mapping[str, Any], what: str) -> Any:
        found = table.get(counterpart(name, names), _MISSING)
        if found is _MISSING:
            raise StageMapError(
                f"plan {path} cannot be mapped onto stage {cut.index} (layers "
                f"{cut.layers.start}..{cut.layers.stop - 1}): {what} {name!r} has no "
                "counterpart in the stage's model it decides"
            )
        return found

    options = {op.name: twin(op.name, stage_plan.options, "op") for op in graph.ops}
    held = {n: twin(n, stage_plan.values, "value") for n in graph.inputs if n not in boundary}
    held |= {n: twin(n, stage_plan.values, "weight") for n in graph.weights}
    held |= {n: boundary[n] for n in graph.inputs if n in boundary}
    returns = {n: boundary[n] for n in graph.outputs if n in boundary}
    return plan_from_options(graph, stage_plan.mesh, options, held, returns)


def stage_devices(whole: Mesh, axis: int, stages: int, stage: int, mesh: Mesh) -> tuple[int, ...]:
    """The whole mesh's linear index of each device of stage `stage` of `stages` on `axis`,
    in the stage mesh `mesh`'s order: the stage mesh is the whole one without the axis, or
    with `size / stages` of it where the stages split it."""
    left = whole.shape[axis] // stages

    def placed(local: Device) -> tuple[int, ...]:
        if mesh.ndim == whole.ndim:
            c = list(local)
            c[axis] = stage * left + c[axis]
            return tuple(c)
        return (*local[:axis], stage, *local[axis:])

    return tuple(whole.linear_index(placed(d)) for d in mesh.devices())

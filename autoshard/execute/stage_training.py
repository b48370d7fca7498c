"""A pipelined plan's training step, stage by stage: each stage's forward, backward, gradient
sync and optimizer update, lowered and partitioned on the stage's mesh.

A pipelined plan decides the training step of the stage's model (`training.stages`: the
forward cut to `stage_model_layers` repeated layers, embedding and head kept). Stage `s`'s
step (`stage_step`) is the training step of its cut of the whole model
(`analysis.stage_cut`), built as the whole model's is (`training.step`), but for its ends:

- what it sends on that needs a gradient, `y`, has its gradient given, the graph input
  `y@grad0`, received from the next stage in the backward (the last stage's model outputs
  take the loss's gradient, as without a pipeline);
- what it receives that needs a gradient, `x` (the stage before seeds it), has its total
  gradient made and returned, sent back to the stage before.

Every op and value of the step takes the decisions of its counterpart in the stage's model
(`stage_plans.counterpart`: a gradient op by its forward op's name). A boundary value and its
gradient are held on both sides as the stage's model holds the value, complete, each made so
right after its producer (not at the end of the step), so the forward's sends leave before
the backward and a gradient before the sync and update. A weight trained on two stages (tied)
has its gradients summed across them (`execute.tied`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from autoshard.analysis.attention import find_attention
from autoshard.analysis.stage_cut import StageCut
from autoshard.cost.schedule import Schedule
from autoshard.document.plan_document import PlanDocument, decisions_for, plan_from_document
from autoshard.execute.stage_plans import (
    PipelinedPartition,
    StageMapError,
    StagePartition,
    boundary_of,
    counterpart,
    stage_devices,
    stage_map,
    stage_plan_of,
)
from autoshard.ir.graph import Graph, verify
from autoshard.pipeline import build
from autoshard.plan import Plan
from autoshard.search.backward_split import weight_gradient_ops
from autoshard.search.pipelined import layer_parts
from autoshard.sharding import Sharding
from autoshard.training.options import Loss, Training
from autoshard.training.replay import replays
from autoshard.training.stages import stage_steps
from autoshard.training.step import training_graph


def seed_name(value: str) -> str:
    """The graph input holding the gradient of `value` that the next stage sends back."""
    return f"{value}@grad0"


def stage_step(cut: StageCut, training: Training, differentiated: Sequence[str]) -> Graph:
    """Stage `cut`'s training step (module docstring): its sends' gradients given, those of
    `differentiated` (what it receives that the stage before seeds) returned after the
    step's outputs, then its sends themselves."""
    graph = cut.graph
    last = not cut.sends
    returned_here = [n for n in graph.outputs if n not in cut.sends]
    if returned_here and not last:
        raise StageMapError(
            f"stage {cut.index} returns the model output {returned_here[0]!r} but is not the "
            "last stage: a pipelined training step takes the loss on the last stage only"
        )
    if training.fused_attention:
        graph = dataclasses.replace(graph, fused=find_attention(graph))
    own = training if last else dataclasses.replace(training, loss=Loss.SUM)
    step = training_graph(graph, own, replays(graph, own), cut.sends, differentiated)
    step = dataclasses.replace(step, outputs=(*step.outputs, *cut.sends))
    verify(step)
    return step


def seeded(step: Graph, cut: StageCut) -> tuple[str, ...]:
    """What stage `cut` sends whose gradient its step takes (`seed_name`)."""
    return tuple(n for n in cut.sends if seed_name(n) in step.inputs)


def _stage_plan(
    cut: StageCut, step: Graph, stage_plan: Plan, names: Mapping[str, str],
    boundary: Mapping[str, Sharding], gradients: Mapping[str, str], path: str | Path,
) -> Plan:  # fmt: skip
    """The stage step's plan (`stage_plans.stage_plan_of`), the gradients it takes and
    returns held as their values, and every boundary value and gradient it makes held so
    right after its producer."""
    given = dict(boundary)
    given |= {seed_name(n): boundary[n] for n in seeded(step, cut)}
    given |= {g: boundary[x] for x, g in gradients.items()}
    plan = stage_plan_of(cut, stage_plan, names, given, path, step)
    made = {n: given[n] for n in step.outputs if n in given and step.producer(n) is not None}
    return dataclasses.replace(plan, values={**plan.values, **made})


def training_partition(
    document: PlanDocument, path: str | Path, model: str | Path, dims: Mapping[str, int]
) -> tuple[PipelinedPartition, Training]:
    """Plan document `document` (read from `path`, a pipelined training plan) partitioned
    stage by stage on the whole model `model` with `dims`: each stage's training step; an
    interleaved plan's, chunk by chunk (`stage_plans.stage_map`)."""
    block = document.pipeline
    assert block is not None
    decisions = decisions_for(document, path, document.mesh, model, dims)
    training = decisions.training
    if training is None:
        raise StageMapError(f"plan {path} is pipelined but plans no training step; plan again")
    schedule = Schedule.parse(str(block["schedule"]))
    virtual = schedule.virtual
    staged = stage_map(document, path, model, dims, virtual)
    positions = len(staged.cuts) // virtual
    model_step = stage_steps(staged.forward, training).step(staged.depth)
    stage_plan = plan_from_document(decisions, model_step, document.mesh, f"plan {path}")
    boundary = boundary_of(staged, stage_plan, path)
    parts: dict[str, int] = {}  # each op's priced part, where `W` runs apart
    if schedule.splits_backward:
        ops = [op.name for op in model_step.ops]
        parts = dict(zip(ops, layer_parts(model_step), strict=True))
    stages: list[StagePartition] = []
    seeds: tuple[str, ...] = ()
    for cut in staged.cuts:
        differentiated = tuple(n for n in cut.receives if n in seeds)
        step = stage_step(cut, training, differentiated)
        gradients = dict(zip(differentiated, _returned_gradients(step, cut, differentiated),
                             strict=True))  # fmt: skip
        plan = _stage_plan(cut, step, stage_plan, staged.names, boundary, gradients, path)
        devices = stage_devices(staged.whole, staged.axis, positions, cut.index % positions,
                                document.mesh)  # fmt: skip
        weight_ops = stage_weight_ops(step, parts, staged.names, gradients.values())
        stages.append(StagePartition(cut=cut, built=build(step, plan), devices=devices,
                                     weight_ops=weight_ops))  # fmt: skip
        seeds = seeded(step, cut)
    partition = PipelinedPartition(staged.forward, staged.whole, staged.axis,
                                   str(block["schedule"]), int(block["micro_batches"]),
                                   tuple(stages), boundary, virtual)  # fmt: skip
    return partition, training


def stage_weight_ops(
    step: Graph, parts: Mapping[str, int], names: Mapping[str, str], handed_back: Iterable[str]
) -> frozenset[str]:
    """The ops of stage step `step`'s weight gradient (`W`, `search.backward_split`) as the
    search priced them: each op in the part of its counterpart in the stage's model's step
    (`parts`, by name: `search.pipelined.layer_parts`), the gradients it sends back made by
    `B`. None where `parts` is empty (a schedule that runs the backward whole)."""
    if not parts:
        return frozenset()
    part = [parts[counterpart(op.name, names)] for op in step.ops]
    found = weight_gradient_ops(step, part, frozenset(handed_back))
    return frozenset(step.ops[i].name for i in found)


def _returned_gradients(
    step: Graph, cut: StageCut, differentiated: Sequence[str]
) -> tuple[str, ...]:
    """The step's outputs holding the gradients of `differentiated`: just before its sends."""
    end = len(step.outputs) - len(cut.sends)
    return step.outputs[end - len(differentiated) : end]

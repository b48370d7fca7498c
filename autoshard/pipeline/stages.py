"""Each stage on its own, and the stages a saved plan or annotations decide: import (the
forward and the training step), propagate, lower and partition; `autoshard propagate`,
`partition`, `verify` and the pages that lower a saved plan (`autoshard html`, `explain`)."""

from __future__ import annotations

import dataclasses
import enum
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from autoshard.analysis.attention import find_attention
from autoshard.analysis.shorten import shortened
from autoshard.annotations import Annotation
from autoshard.document.blocks import Decisions
from autoshard.document.plan_document import (
    PlanDocument,
    plan_from_document,
)
from autoshard.ir.graph import Graph
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.mlir import print_program
from autoshard.passes import Stage
from autoshard.passes.lower import lower
from autoshard.passes.partition import Partitioned, partition
from autoshard.plan import Plan
from autoshard.program import Program
from autoshard.progress import Tracker
from autoshard.propagate import propagate
from autoshard.training import Training, training_graph
from autoshard.training.replay import replays

AfterStage = Callable[[Stage, Program | Partitioned], None]
"""Told each stage after a plan is decided and what it left (dump points, timings)."""


class PipelineStage(enum.StrEnum):
    """The stages a run reports its progress in, in the order they run; a run goes through
    some of them (`plan`: import, search, document; `partition`: import, propagate or the
    saved plan, lower, partition, write; the service: a plan, then its partition)."""

    IMPORT = "import"  # the model read, its shapes inferred and folded (the training step)
    PROPAGATE = "propagate"  # annotations decide the plan
    SEARCH = "search"  # the search decides: the problem built, CP-SAT, the budget policy
    DOCUMENT = "document"  # the plan document: costs by layer, the strategy in words
    LOWER = "lower"  # reshards materialized as collectives, then the CCL passes
    PARTITION = "partition"  # each device's program and weight slices
    WRITE = "write"  # the partition's files


def enter_stage(tracker: Tracker | None, stage: PipelineStage, detail: str = "") -> None:
    if tracker is not None:
        tracker.stage(stage, detail)


@dataclass(frozen=True, kw_only=True)
class Lowered:
    """A decided plan and its sharded program."""

    graph: Graph
    plan: Plan
    program: Program


@dataclass(frozen=True, kw_only=True)
class Built(Lowered):
    """A decided plan, its sharded program and each device's part of it."""

    partitioned: Partitioned


def build(
    graph: Graph, plan: Plan, after: AfterStage | None = None, tracker: Tracker | None = None
) -> Built:
    """Lower a decided plan and partition its program."""
    enter_stage(tracker, PipelineStage.LOWER)
    program = lower(graph, plan, after)
    enter_stage(tracker, PipelineStage.PARTITION, f"{plan.mesh.size} devices")
    partitioned = partition(program, graph)
    if after is not None:
        after(Stage.PARTITION, partitioned)
    return Built(graph=graph, plan=plan, program=program, partitioned=partitioned)


def print_spmd(partitioned: Partitioned, dialect: str) -> str:
    """The partitioned (SPMD) program as MLIR text."""
    # Device 0's values of the program's rewritten constants (a local rewrite's own constants,
    # such as a masked lookup's row offset, are not in the program).
    own = partitioned.devices[0].constants if partitioned.devices else {}
    constants = {k: v for k, v in own.items() if k in partitioned.program.constants}
    return print_program(partitioned.program, dialect=dialect, constants=constants)


def dump_after(stages: Collection[Stage], dialect: str, out: IO[str] | None = None) -> AfterStage:
    """Print the program as MLIR after each of `stages`, headed as `mlir-opt
    --mlir-print-ir-after` heads its dumps (and, like it, to stderr by default: the stderr of
    the moment it prints)."""

    def dump(stage: Stage, result: Program | Partitioned) -> None:
        if stage in stages:
            text = (
                print_spmd(result, dialect)
                if isinstance(result, Partitioned)
                else print_program(result, dialect)
            )
            header = f"// -----// IR Dump After {stage} //----- //\n"
            print(header + text, file=out or sys.stderr, end="")

    return dump


def load_graph(
    model: str | Path,
    dims: Mapping[str, int],
    training: Training | None,
    tracker: Tracker | None = None,
) -> Graph:
    """The graph planned: the model's forward, or its training step (recomputing what
    `training.replay` finds, when asked; its attention cores fused, when asked:
    `find_attention`)."""
    return load_graphs(model, dims, training, tracker)[1]


def load_graphs(
    model: str | Path,
    dims: Mapping[str, int],
    training: Training | None,
    tracker: Tracker | None = None,
    layers: int = 0,
    forward_only: bool = False,
) -> tuple[Graph, Graph]:
    """The model's forward and the graph planned (`load_graph`): the recipes find Megatron's
    patterns in the forward, where a training step's backward hides them. `layers`: a
    pipeline stage's model, cut to that many repeated layers (`analysis.shorten`; 0: all).
    `forward_only`: the forward twice (attention found as for the step), the step not built."""
    enter_stage(tracker, PipelineStage.IMPORT, Path(model).name)
    graph = import_onnx(model, dims)
    if layers:
        graph = shortened(graph, layers)
    if training is None:
        return graph, graph
    if training.fused_attention:
        graph = dataclasses.replace(graph, fused=find_attention(graph))
    if forward_only:
        return graph, graph
    return graph, training_graph(graph, training, replays(graph, training))


# ---- `autoshard propagate`: annotations decide ----------------------------------------------


def propagated(
    model: str | Path,
    dims: Mapping[str, int],
    mesh: Mesh,
    annotations: Sequence[Annotation],
    after: AfterStage | None = None,
    partition: bool = False,
    training: Training | None = None,
) -> Lowered:
    """Import, propagate the annotations, lower; and partition, when asked."""
    graph = load_graph(model, dims, training)
    plan = propagate(graph, mesh, annotations)
    if partition:
        return build(graph, plan, after)
    return Lowered(graph=graph, plan=plan, program=lower(graph, plan, after))


# ---- `autoshard partition` / `verify`: annotations or a saved plan decide -------------------


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What determines a partition: the model, the mesh, bound dims, and either annotations
    (propagated) or what decides a saved plan (`autoshard plan -o`)."""

    model: Path
    mesh: Mesh
    dims: Mapping[str, int]
    annotations: tuple[Annotation, ...]
    plan: Decisions | None = None
    training: Training | None = None
    layers: int = 0
    """A pipelined plan's: the repeated layers of the stage's model it decides (0: all)."""


def _decide(setup: Setup, tracker: Tracker | None = None) -> tuple[Graph, Plan]:
    """Import, then decide: the saved plan, else propagate the annotations."""
    graph = load_graphs(setup.model, setup.dims, setup.training, tracker, setup.layers)[1]
    if setup.plan is not None:
        return graph, plan_from_document(setup.plan, graph, setup.mesh, "the plan")
    enter_stage(tracker, PipelineStage.PROPAGATE, f"{len(setup.annotations)} annotations")
    return graph, propagate(graph, setup.mesh, setup.annotations)


def build_setup(
    setup: Setup, after: AfterStage | None = None, tracker: Tracker | None = None
) -> Built:
    """Import, decide (the saved plan, else propagate the annotations), lower, partition."""
    return build(*_decide(setup, tracker), after, tracker)


# ---- `autoshard html`, `explain`, the service's report.html: a saved plan -------------------


def lower_document(document: PlanDocument, model: str | Path) -> Lowered:
    """A saved plan's graph, plan and program: the plan document (`autoshard plan -o`) decided
    on the model it was made from (its dims and training step), lowered (`autoshard html`,
    `explain`, the service's report.html)."""
    graph, plan = _decide(Setup(
        model=Path(model), mesh=document.mesh, dims=document.model.dims, annotations=(),
        plan=document.decisions, training=document.training,
        layers=(document.pipeline or {}).get("stage_model_layers", 0),
    ))  # fmt: skip
    return Lowered(graph=graph, plan=plan, program=lower(graph, plan))

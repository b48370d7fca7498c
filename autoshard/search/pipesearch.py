"""The search's pipelines: the intra-stage plan of a pipeline (`plan_pipelined`) and, where
pipelining is allowed, which pipeline, if any (`choose_pipeline`; docs/concepts/pipeline.md).

A stage's plan is searched on a stage's model: the model cut to as many repeated layers as the
deepest even stage holds, at most `DEPTH` (`analysis.shorten`; at least two, so the boundary
between two layers is in it), its embedding and head included, on the stage's devices
(`search.pipelined.sub_cluster`) under the device's budget times the stages (loose: the
fastest plan, found at once). Repeated layers make the stages alike, so one solve stands for
every stage, and its size depends on the stage's depth, not the model's. The plan is then
priced as each stage runs it (`price_stages`: the layers split so the slowest stage is the
fastest) under each schedule the pipeline can run, and the fastest that fits is kept. Where
none fits (the schedule keeps several micro-batches' activations a stage's solve saw once),
the stage is searched again under the memory its plan used less the overshoot and a margin
(`MARGIN`): what the stage holds once drops as much as the plan, its activations, kept several
times, drop more; the problem is built once and solved again under the lower bound.

Allowed to choose (`--pipeline auto`), the search plans the step without a pipeline and with
every divisor `p >= 2` of the pipeline axis (the outermost unless named; at most the layers)
as stages, the axis's other `size / p` positions left to the stages' devices, and keeps the
fastest plan that fits; `PipelineChoice` says what each candidate cost.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autoshard.annotations import Annotation
from autoshard.cost.cluster import Cluster
from autoshard.cost.schedule import Schedule, ScheduleKind
from autoshard.deadline import NEVER, Deadline
from autoshard.errors import PipelineError
from autoshard.ir.graph import Graph
from autoshard.progress import Tracker
from autoshard.search.budget import Planned, auto_plan
from autoshard.search.options import SolverOptions
from autoshard.search.pipelined import (
    AutoPipeline,
    LayerCosts,
    PipelineAsk,
    PipelinePrice,
    check_pipeline,
    layer_costs,
    price_stages,
    stage_annotations,
    sub_cluster,
)
from autoshard.search.solver.outcome import InfeasibleError
from autoshard.units import format_bytes

StageGraph = Callable[[int], Graph]
"""The training step of the model cut to `k` repeated layers (`analysis.shorten`)."""

REFITS = 3
"""How many times a stage's plan is searched again, under a lower budget, where its largest
stage does not fit: each is a solve."""

MARGIN = 1.25
"""How much more than its overshoot a refit takes off the memory a stage's plan used: what a
plan frees is not all the largest stage's (the head's is the last stage's), and a refit
that falls short is another solve under binding memory rows, the search's slowest."""

VIRTUAL = (2, 4, 8)
"""The virtual stages per device interleaved schedules are tried with."""


def schedules(
    stages: int, layers: int, micro_batches: int, training: bool = True
) -> tuple[Schedule, ...]:
    """The schedules a pipeline of `stages` can run: GPipe, 1F1B, and interleaved 1F1B with
    each of `VIRTUAL` whose chunks the layers fill, where the micro-batches divide; and, for a
    training step (a backward to split), ZB-H1."""
    found = [Schedule(ScheduleKind.ONE_F_ONE_B), Schedule(ScheduleKind.GPIPE)]
    if micro_batches % stages == 0:
        found += [Schedule(ScheduleKind.INTERLEAVED, v) for v in VIRTUAL
                  if stages * v <= layers]  # fmt: skip
    if training:
        found.append(Schedule(ScheduleKind.ZB_H1))
    return tuple(found)


def fastest(
    costs: LayerCosts, cluster: Cluster, ask: PipelineAsk, layers: int, micro_batches: int
) -> PipelinePrice:
    """The fastest of `ask`'s schedules (each of `schedules` where it names none) that fits
    the budget; the one needing least memory where none does."""
    stages = ask.on(cluster.mesh)
    tried = (ask.schedule,) if ask.schedule else schedules(stages, layers, micro_batches,
                                                           costs.training)  # fmt: skip
    priced = [
        price_stages(costs, cluster, dataclasses.replace(ask, schedule=s), layers, micro_batches)
        for s in tried
    ]
    fits = [p for p in priced if p.memory_bytes <= cluster.memory]
    if fits:
        return min(fits, key=lambda p: p.step_s)
    return min(priced, key=lambda p: (p.memory_bytes, p.step_s))


DEPTH = 64
"""The most repeated layers a stage's model keeps: a deeper stage repeats its middle layer's
price (`LayerCosts.parts`). Generous: a model cut much shorter than its stages prices their
memory from one layer's share at the peak, which moves with the plan between refits, so
each refit's budget misses."""


def stage_depth(layers: int, stages: int) -> int:
    """The layers of a stage's model: the deepest even stage's, at most `DEPTH`, at least two
    where the model has them (the boundary between two layers is what a stage sends)."""
    return min(layers, max(2, min(DEPTH, math.ceil(layers / stages))))


@dataclass(frozen=True)
class StagePlan:
    """A pipeline's intra-stage plan (on `graph`, the stage's model, and `cluster`, its
    devices and budget), and the pipeline priced."""

    planned: Planned
    graph: Graph
    depth: int
    cluster: Cluster
    priced: PipelinePrice


def plan_pipelined(
    stage_graph: StageGraph,
    cluster: Cluster,
    ask: PipelineAsk,
    layers: int,
    options: SolverOptions,
    annotations: Sequence[Annotation] = (),
    tracker: Tracker | None = None,
    deadline: Deadline = NEVER,
) -> StagePlan:
    """The intra-stage plan of `ask` on `cluster` for a model of `layers` repeated layers
    (the module's docstring), `annotations` naming the stage's mesh; `NoPlanFits` where no
    stage's plan fits its budget."""
    depth = stage_depth(layers, ask.on(cluster.mesh))
    graph = stage_graph(depth)
    check_pipeline(ask, cluster.mesh, layers, graph.micro_batches)
    stages = ask.on(cluster.mesh)
    sub = sub_cluster(cluster, ask.axis, ask.stages)
    sub = dataclasses.replace(sub, memory=sub.memory * stages)
    planned = auto_plan(graph, sub, annotations, options, tracker, deadline)
    m = graph.micro_batches
    priced = fastest(layer_costs(graph, planned.plan, planned.program, planned.cost), cluster,
                     ask, layers, m)  # fmt: skip
    for _ in range(REFITS):
        if priced.memory_bytes <= cluster.memory:
            break
        usage = min(sub.memory, planned.cost.memory_bytes_per_device)
        deepest = max(len(stage.layers) for stage in priced.stages)
        over = (priced.memory_bytes - cluster.memory) * MARGIN * min(depth, deepest) / deepest
        lower = dataclasses.replace(sub, memory=usage - math.ceil(over))
        if lower.memory <= 0:
            break
        try:
            again = auto_plan(graph, lower, annotations, options, tracker, deadline,
                              explain=False, reuse=planned.search)  # fmt: skip
        except InfeasibleError:
            break
        sub, planned = lower, again
        costs = layer_costs(graph, planned.plan, planned.program, planned.cost)
        priced = fastest(costs, cluster, ask, layers, m)
    return StagePlan(planned=planned, graph=graph, depth=depth, cluster=sub, priced=priced)


@dataclass(frozen=True)
class Candidate:
    """One pipeline the search tried (`stages` 1: none): its step, memory, whether it fits,
    and in words what it was (`why`: the reason it has no plan, where it has none)."""

    stages: int
    step_s: float
    memory_bytes: int
    fits: bool
    words: str

    def to_json(self) -> dict[str, object]:
        return {"stages": self.stages, "step_time_s": self.step_s,
                "memory_bytes_per_device": self.memory_bytes, "fits": self.fits,
                "words": self.words}  # fmt: skip


@dataclass(frozen=True)
class PipelineChoice:
    """What `choose_pipeline` chose: the plan (`staged` None: no pipeline), and every
    candidate tried."""

    planned: Planned
    staged: StagePlan | None
    candidates: tuple[Candidate, ...]

    def why(self) -> str:
        """The story's sentence: what the others cost."""
        chosen = self.staged.priced.pipeline.stages if self.staged else 1
        others = [c for c in self.candidates if c.stages != chosen]
        if not others:
            return "no other pipeline to try"
        return "chosen over " + "; ".join(c.words for c in others)


def _words(stages: int, step_s: float, memory: int, budget: int, what: str = "") -> str:
    name = "no pipeline" if stages == 1 else f"{stages} stages ({what})"
    fits = "" if memory <= budget else f", needs {format_bytes(memory)} of {format_bytes(budget)}"
    return f"{name}: {step_s:.4g} s a step{fits}"


def choose_pipeline(
    graph: Graph,
    stage_graph: StageGraph,
    cluster: Cluster,
    auto: AutoPipeline,
    layers: int,
    options: SolverOptions,
    annotations: Sequence[Annotation] = (),
    tracker: Tracker | None = None,
    deadline: Deadline = NEVER,
) -> PipelineChoice:
    """The fastest plan that fits of: `graph` (the whole step) on `cluster` without a
    pipeline, and a pipeline of each divisor of `auto`'s axis (the module's docstring),
    `annotations` naming the whole mesh (a candidate whose pipeline axis they split fails);
    `NoPlanFits` (the one without a pipeline's) where none fits."""
    axis = 0 if auto.axis is None else auto.axis
    size = cluster.mesh.shape[axis]
    budget, tried = cluster.memory, []
    best: tuple[float, Planned, StagePlan | None] | None = None
    try:
        whole = auto_plan(graph, cluster, annotations, options, tracker, deadline, explain=False)
        step = whole.cost.objective
        tried.append(Candidate(1, step, whole.cost.memory_bytes_per_device, True,
                               _words(1, step, 0, budget)))  # fmt: skip
        best = (step, whole, None)
    except InfeasibleError:
        tried.append(Candidate(1, math.inf, 0, False, "no pipeline: no plan fits"))
    for stages in (p for p in range(2, min(size, layers) + 1) if size % p == 0):
        ask = PipelineAsk(axis, auto.schedule, stages)
        try:
            pinned = stage_annotations(annotations, axis, cluster.mesh, stages)
            staged = plan_pipelined(stage_graph, cluster, ask, layers, options, pinned,
                                    tracker, deadline)  # fmt: skip
        except (InfeasibleError, PipelineError) as error:
            why = "no plan fits" if isinstance(error, InfeasibleError) else str(error)
            tried.append(Candidate(stages, math.inf, 0, False, f"{stages} stages: {why}"))
            continue
        priced = staged.priced
        fits = priced.memory_bytes <= budget
        how = f"{priced.pipeline.schedule}, bubble {priced.bubble:.0%}".replace("%", " %")
        words = _words(stages, priced.step_s, priced.memory_bytes, budget, how)
        tried.append(Candidate(stages, priced.step_s, priced.memory_bytes, fits, words))
        if fits and (best is None or priced.step_s < best[0]):
            best = (priced.step_s, staged.planned, staged)
    if best is None:  # the least memory a plan without a pipeline needs, with its proof
        auto_plan(graph, cluster, annotations, options, tracker, deadline)
        raise PipelineError("no pipeline's stages fit the budget")  # (auto_plan raised)
    return PipelineChoice(planned=best[1], staged=best[2], candidates=tuple(tried))

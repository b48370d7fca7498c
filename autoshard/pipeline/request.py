"""`autoshard plan`: the search decides. Import the forward and each training step the
search may try (recomputation, micro-batches, pipeline stages), search, then document the
chosen plan with the recipes priced beside it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from autoshard.analysis.shorten import layer_run
from autoshard.annotations import Annotation, check_annotations
from autoshard.cost.cluster import Cluster
from autoshard.cost.compute import check_precision
from autoshard.cost.replay import recompute_ladder
from autoshard.deadline import Deadline
from autoshard.document.plan_document import (
    PlanDocument,
    model_info,
    plan_document,
)
from autoshard.errors import PipelineError
from autoshard.ir.graph import Graph
from autoshard.mesh import Mesh
from autoshard.names import parameter_names
from autoshard.passes.partition import Partitioned, partition
from autoshard.pipeline.stages import (
    AfterStage,
    Lowered,
    PipelineStage,
    build,
    enter_stage,
    load_graphs,
)
from autoshard.progress import Tracker
from autoshard.search.budget import Planned, auto_plan
from autoshard.search.critical import Answer, fastest_answer
from autoshard.search.microbatch import GlobalBatch, MicroBatchCandidate, chosen_words
from autoshard.search.options import Objective, SolverOptions
from autoshard.search.pipelined import (
    AutoPipeline,
    PipelineAsk,
    check_pipeline,
    stage_annotations,
)
from autoshard.search.pipesearch import PipelineChoice, StagePlan, choose_pipeline, plan_pipelined
from autoshard.search.recipe_prices import RecipePrice, price_recipes
from autoshard.search.recompute import Ladder, Lazy, choose_recompute, recompute_words
from autoshard.search.shared import SearchCache, shared_plan
from autoshard.search.solver.outcome import InfeasibleError
from autoshard.training import Recompute, Training, training_graph
from autoshard.training.replay import replays
from autoshard.training.stages import stage_steps


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What `autoshard plan` is asked: the model, the cluster it is priced on (its mesh and
    memory budget: `Cluster(mesh, memory=bytes)` where the links and device are the defaults),
    bound dims and the search's options. The faces parse the cluster's flag text with
    `make_cluster`: the CLI from its flags, the REST service from its form
    (`service.options.PlanOptions.request`); the library reads values only."""

    model_path: str | Path
    cluster: Cluster
    dims: Mapping[str, int]
    annotations: Sequence[Annotation] = ()
    objective: Objective = Objective.TIME
    time_limit: float = 60.0
    training: Training | None = None
    pipeline: PipelineAsk | AutoPipeline | None = None
    """A pipeline over a mesh axis, or pipelining allowed (`search.pipelined.pipeline_ask`):
    the search plans a stage on the mesh without it, the schedule prices the stages
    (`search.pipesearch`)."""
    global_batch: GlobalBatch | None = None
    """The step's global batch (`search.microbatch`): the model's dim it names is set to a
    micro-batch of it, the micro-batches searched where a pipeline is planned and none given."""


@dataclass(frozen=True, kw_only=True)
class RequestedPlan:
    """The answer to a plan request: the plan document, the search's result, and the graph
    and cluster it was found for (to partition or print the program, to summarize)."""

    document: PlanDocument
    planned: Planned
    graph: Graph
    cluster: Cluster

    @property
    def lowered(self) -> Lowered:
        """The chosen plan and its program (what the HTML report draws)."""
        return Lowered(graph=self.graph, plan=self.planned.plan, program=self.planned.program)

    def partition(self, tracker: Tracker | None = None) -> Partitioned:
        """The last stage, on request: each device's part of the plan's program."""
        enter_stage(tracker, PipelineStage.PARTITION, f"{self.cluster.mesh.size} devices")
        return partition(self.planned.program, self.graph)


def plan_inputs(request: PlanRequest, tracker: Tracker | None = None) -> tuple[Graph, Cluster]:
    """The checked inputs of a plan request: the imported model, and annotations that name
    values of the model and fit its cluster. Every bad input raises its one-line
    AutoshardError here (a bad cluster where the face made it), before any search: the
    service calls this to answer 4xx at once. A global batch is checked as its first count
    of micro-batches plans it (each count's shapes are the model's at another batch)."""
    batch = request.global_batch
    if batch is not None:
        if batch.dim in request.dims:
            raise PipelineError(f"--global-batch {batch} sets dim {batch.dim}: drop its --dim")
        size = batch.size // batch.choices(searched=request.pipeline is not None)[0]
        request = dataclasses.replace(
            request, global_batch=None, dims={**request.dims, batch.dim: size}
        )
    _, graph, cluster = _plan_inputs(request, tracker)
    return graph, cluster


GraphCache = MutableMapping[
    tuple[str, tuple[tuple[str, int], ...], Training | None], tuple[Graph, Graph]
]
"""Imported graphs (`load_graphs`) by model path, dims and training step: what a caller that
plans one model many times (`autoshard sweep`, on several meshes and budgets) keeps to import
it once. The graphs are read-only values, so sharing them changes no plan."""


def _plan_inputs(
    request: PlanRequest, tracker: Tracker | None = None, graphs: GraphCache | None = None
) -> tuple[Graph, Graph, Cluster]:
    """`plan_inputs`, the model's forward too (`load_graphs`, or `graphs` where it holds
    them). A named pipeline's search plans a stage's model, built from the forward: where no
    annotation names the whole step's values, the forward stands in for that step."""
    cluster = request.cluster
    if request.training is not None:
        check_precision(request.training.precision, cluster.device)
    key = (str(request.model_path), tuple(sorted(request.dims.items())), request.training)
    if graphs is not None and key in graphs:
        enter_stage(tracker, PipelineStage.IMPORT, Path(request.model_path).name)
        forward, graph = graphs[key]
    else:
        lean = isinstance(request.pipeline, PipelineAsk) and not request.annotations
        forward, graph = load_graphs(request.model_path, request.dims, request.training, tracker,
                                     forward_only=lean)  # fmt: skip
        if graphs is not None and not lean:
            graphs[key] = forward, graph
    shapes = {name: value.shape for name, value in graph.values.items()}
    check_annotations(request.annotations, shapes, cluster.mesh)
    if request.pipeline is not None:
        _check_pipeline(request, _layers(forward), cluster.mesh)
    return forward, graph, cluster


def _layers(forward: Graph) -> int:
    run = layer_run(forward)
    return run.count if run is not None else 0


def _check_pipeline(request: PlanRequest, layers: int, mesh: Mesh) -> None:
    """The asked pipeline checked (its stages against the model's repeated layers, the
    annotations against its axis) before any search."""
    ask = request.pipeline
    assert ask is not None
    if request.training is None:
        raise PipelineError("a pipeline plans a training step: add --mode training")
    if isinstance(ask, PipelineAsk):
        check_pipeline(ask, mesh, layers, request.training.micro_batches)
        stage_annotations(request.annotations, ask.axis, mesh)


@dataclass(frozen=True)
class _Searched:
    """The search's answer to a plan request: the plan (a stage's, where pipelined), the graph
    and cluster it is for, and the pipeline (`staged`) and what else was tried (`choice`)."""

    planned: Planned
    graph: Graph
    forward: Graph
    cluster: Cluster
    staged: StagePlan | None = None
    choice: PipelineChoice | None = None
    recipes: tuple[RecipePrice, ...] | None = None  # priced beside the plan (`_answered`)
    answer: Answer | None = None  # where the recipes' plans were ranked with it (`_answered`)


def _search(
    request: PlanRequest, tracker: Tracker | None, deadline: Deadline,
    graphs: GraphCache | None, explain: bool, kept: SearchCache | None,
) -> _Searched:  # fmt: skip
    """The plan `request` asks the search for (its recomputation decided; no document yet,
    `_documented`): without a pipeline, with the one it names, or the best of either where
    pipelining is allowed (`search.pipesearch`)."""
    options = SolverOptions(objective=request.objective, time_limit=request.time_limit)
    forward, graph, whole = _plan_inputs(request, tracker, graphs)
    deadline.check("importing the model")
    enter_stage(tracker, PipelineStage.SEARCH, "building the problem")
    ask, annotations = request.pipeline, request.annotations
    if ask is None:
        training = request.training
        overlap = training.overlap if training is not None else None
        planned = (
            auto_plan(graph, whole, annotations, options, tracker, deadline, explain, overlap)
            if kept is None else shared_plan(graph, whole, annotations, options, tracker,
                                             deadline, explain, overlap, kept)
        )  # fmt: skip
        return _Searched(planned=planned, graph=graph, forward=forward, cluster=whole)
    assert request.training is not None
    steps = stage_steps(forward, request.training)
    staged: StagePlan | None
    if isinstance(ask, PipelineAsk):
        pinned = stage_annotations(annotations, ask.axis, whole.mesh, ask.stages)
        staged = plan_pipelined(steps.step, whole, ask, steps.layers, options, pinned, tracker,
                                deadline)  # fmt: skip
        choice = None
    else:
        choice = choose_pipeline(graph, steps.step, whole, ask, steps.layers, options,
                                 annotations, tracker, deadline)  # fmt: skip
        staged = choice.staged
    if staged is None:
        assert choice is not None
        return _Searched(planned=choice.planned, graph=graph, forward=forward, cluster=whole,
                         choice=choice)  # fmt: skip
    return _Searched(planned=staged.planned, graph=staged.graph,
                     forward=steps.forward(staged.depth),
                     cluster=staged.cluster, staged=staged, choice=choice)  # fmt: skip


def plan_request(
    request: PlanRequest, tracker: Tracker | None = None, after: AfterStage | None = None,
    deadline: Deadline | None = None, graphs: GraphCache | None = None,
    explain: bool = True, searches: SearchCache | None = None,
) -> RequestedPlan:  # fmt: skip
    """`autoshard plan` from start to end, shared by the CLI and the REST service so that the
    service's plan is, by construction, what `autoshard plan --json` prints (timings aside).
    `after` sees the stages of the chosen plan (the budget policy lowers its candidates too,
    unseen), partition included; `tracker` is told the progress. `deadline`: the wall clock
    `request.time_limit` sets (started here where not given: the CLI starts it with the
    command), shared by the import and every step of the search (`TimeUp` names the phase
    that has no plan to answer with when it passes). `graphs`: the imports kept for the next
    request of the same model (`GraphCache`). `explain` false: no plan fitting raises the
    solve's InfeasibleError, without the least memory a plan needs (`auto_plan`). `searches`:
    the searches kept for the same step under other budgets (`search.shared`: the plan each
    budget gets alone, found with less work)."""
    deadline = deadline or Deadline.start(request.time_limit)
    if request.global_batch is not None:
        return _in_micro_batches(request, tracker, after, deadline, graphs, searches)
    training = request.training
    if training is not None and training.attention is None:
        training = training.for_device(request.cluster.device.flash_attention)
        request = dataclasses.replace(request, training=training)
    if training is not None and training.recompute is Recompute.AUTO:
        return _fastest_recompute(request, training, tracker, after, deadline, graphs, searches)
    found = _search(request, tracker, deadline, graphs, explain, searches)
    found = _answered(request, found, deadline)
    requested = _documented(request, found, tracker, deadline)
    if after is not None:
        build(requested.graph, requested.planned.plan, after, tracker)
    return requested


def _answered(request: PlanRequest, found: _Searched, deadline: Deadline) -> _Searched:
    """`found` with the recipes priced beside its plan and, where the plan is one step's
    (no pipeline's stage) searched for time, the fastest on the step's critical path of it
    and each recipe's plan that fits answering (`search.critical`): the plan the document's
    step time calls fastest is the one answered."""
    if found.staged is not None or request.objective is not Objective.TIME:
        return found  # its recipes priced where documented
    planned, graph, cluster = found.planned, found.graph, found.cluster
    recipes = price_recipes(graph, found.forward, cluster, planned.search, request.objective,
                            deadline, planned.solution.choice)  # fmt: skip
    overlap = request.training.overlap if request.training is not None else None
    answer = fastest_answer(graph, cluster, planned, recipes, overlap, deadline)
    return dataclasses.replace(found, planned=answer.planned, recipes=recipes, answer=answer)


def _documented(
    request: PlanRequest, found: _Searched, tracker: Tracker | None, deadline: Deadline,
    chosen: str | None = None,
) -> RequestedPlan:  # fmt: skip
    """The plan document of `found`, `request`'s search: with the pipeline's block and the
    story's words on it (where pipelined), and why the search chose as it did (where allowed
    to choose: a pipeline; `chosen`, the recomputation's words, where `--recompute auto` chose
    it, `_fastest_recompute`; where a recipe's plan answers, `_answered`'s words). The recipes
    beside it are priced within `deadline`, each started from the plan's choices
    (`search.recipe_prices`)."""
    options = SolverOptions(objective=request.objective, time_limit=request.time_limit)
    planned, graph, cluster, forward = found.planned, found.graph, found.cluster, found.forward
    enter_stage(tracker, PipelineStage.DOCUMENT)
    recipes = found.recipes
    if recipes is None:
        recipes = price_recipes(graph, forward, cluster, planned.search, options.objective,
                                deadline, planned.solution.choice)  # fmt: skip
    document = plan_document(
        graph, cluster, planned.plan, planned.program, planned.cost,
        model_info(request.model_path, graph, request.dims), planned, request.training,
        asked=(options, request.annotations), names=parameter_names(request.model_path),
        recipes=recipes, recompute_chosen=chosen is not None,
    )  # fmt: skip
    why, whole = f"; {found.choice.why()}" if found.choice is not None else "", request.cluster
    if found.staged is not None:
        priced = found.staged.priced
        document = dataclasses.replace(
            document, story=f"{priced}{why}; each stage: {document.story}",
            pipeline={"mesh": str(whole.mesh), "memory_budget_bytes": whole.memory,
                      "stage_model_layers": found.staged.depth, **priced.to_json(),
                      **({"considered": [c.to_json() for c in found.choice.candidates]}
                         if found.choice is not None else {})},
        )  # fmt: skip
    elif why:
        document = dataclasses.replace(document, story=f"No pipeline{why}. {document.story}")
    if chosen:
        document = dataclasses.replace(document, story=f"{document.story} {chosen}")
    if found.answer is not None:
        document = _told(document, found.answer)
    return RequestedPlan(document=document, planned=planned, graph=graph, cluster=cluster)


def _told(document: PlanDocument, answer: Answer) -> PlanDocument:
    """`document` saying why a recipe's plan answers (`search.critical`), in its story and
    its recipes block's line (which compares compute plus communication, where the searched
    plan may cost less), and which recipes the time left unranked."""
    told = [document.story or "", answer.words]
    if answer.unpriced:
        told.append(f"Not ranked on the critical path, out of time: {', '.join(answer.unpriced)}.")
    block = document.recipes
    if answer.recipe is not None and block is not None:
        line = (
            f"the plan is {answer.recipe}'s fastest program, answered for its shorter step on "
            f"the critical path (the story says by how much); this table prices compute plus "
            f"communication, without overlap"
        )
        block = dataclasses.replace(block, difference=line)
    return dataclasses.replace(document, story=" ".join(t for t in told if t), recipes=block)


def _in_micro_batches(
    request: PlanRequest, tracker: Tracker | None, after: AfterStage | None,
    deadline: Deadline, graphs: GraphCache | None, searches: SearchCache | None = None,
) -> RequestedPlan:  # fmt: skip
    """The plan of `request`'s global batch in the fastest of the micro-batch counts it allows
    (`GlobalBatch.choices`) that has a plan that fits; where none has, the largest count's
    error (its micro-batch the smallest)."""
    batch, training = request.global_batch, request.training
    assert batch is not None
    if training is None:
        raise PipelineError(f"--global-batch {batch} is a training step's: add --mode training")
    if batch.dim in request.dims:
        raise PipelineError(f"--global-batch {batch} sets dim {batch.dim}: drop its --dim")
    counts = batch.choices(searched=request.pipeline is not None)

    def asked(m: int) -> PlanRequest:
        return dataclasses.replace(
            request, global_batch=None, dims={**request.dims, batch.dim: batch.size // m},
            training=dataclasses.replace(training, micro_batches=m),
        )  # fmt: skip

    if len(counts) == 1:
        return plan_request(asked(counts[0]), tracker, after, deadline, graphs, searches=searches)
    tried: list[MicroBatchCandidate] = []
    best: tuple[float, int, RequestedPlan] | None = None
    for m in counts:
        try:
            found = plan_request(asked(m), tracker, None, deadline, graphs, False, searches)
        except (InfeasibleError, PipelineError) as error:
            why = "no plan fits" if isinstance(error, InfeasibleError) else str(error)
            tried.append(MicroBatchCandidate(m, None, why))
            deadline.check("trying the micro-batch counts")
            continue
        block = found.document.pipeline
        step = block["step_time_s"] if block else found.planned.cost.objective
        tried.append(MicroBatchCandidate(m, step))
        if best is None or step < best[0]:
            best = (step, m, found)
    if best is None:
        plan_request(asked(counts[-1]), tracker, after, deadline, graphs, searches=searches)
        raise PipelineError(f"no micro-batch count of {batch} has a plan")  # (it raised)
    _, chosen, found = best
    words = chosen_words(batch, chosen, [c for c in tried if c.micro_batches != chosen])
    document = found.document
    block = document.pipeline
    document = dataclasses.replace(
        document, story=f"{words}. {document.story}",
        pipeline=None if block is None else {
            **block, "global_batch": {"dim": batch.dim, "size": batch.size},
            "micro_batches_considered": [c.to_json() for c in tried],
        },
    )  # fmt: skip
    if after is not None:
        build(found.graph, found.planned.plan, after, tracker)
    return dataclasses.replace(found, document=document)


def _fastest_recompute(
    request: PlanRequest, training: Training, tracker: Tracker | None,
    after: AfterStage | None, deadline: Deadline, graphs: GraphCache | None = None,
    searches: SearchCache | None = None,
) -> RequestedPlan:  # fmt: skip
    """The plan of the recomputation whose step is fastest (`search.recompute`), within
    `deadline`; the last one's error (with the least memory its plans need) where none fits.
    The model is imported once, each candidate's graph kept in `graphs`; only the chosen one
    is documented."""
    graphs = {} if graphs is None else graphs
    if request.pipeline is None:
        ladder = Ladder.of(*_step_graphs(request, recompute_ladder(training), tracker, graphs),
                           request.cluster)  # fmt: skip
    else:  # A pipeline plans its stage's model: no whole step built for bounds; each solved.
        ladder = Ladder.unpriced(recompute_ladder(training))
    found: dict[Training, _Searched] = {}

    def solve(step: Training, last: bool) -> tuple[float, bool]:
        asked = dataclasses.replace(request, training=step)
        searched = _search(asked, tracker, deadline, graphs, last, searches)
        found[step] = searched = _answered(asked, searched, deadline)
        staged, planned = searched.staged, searched.planned
        seconds = staged.priced.step_s if staged is not None else planned.cost.step_time_s
        return seconds, planned.solution.memory_binds

    chosen, considered = choose_recompute(ladder.ranked, ladder.bounds, solve, ladder.floors,
                                          request.cluster.memory)  # fmt: skip
    # One candidate (a model without repeated layers) is no choice: the story is silent.
    words = recompute_words(chosen, considered) if len(considered) > 1 else ""
    asked = dataclasses.replace(request, training=chosen.training)
    planned = _documented(asked, found[chosen.training], tracker, deadline, words)
    if after is not None:
        build(planned.graph, planned.planned.plan, after, tracker)
    return planned


def _step_graphs(
    request: PlanRequest, ladder: Sequence[Training], tracker: Tracker | None,
    graphs: GraphCache,
) -> tuple[Graph, Mapping[Training, Graph]]:  # fmt: skip
    """The forward and the training step of each of `ladder`, the model imported once (for
    the first); the others built when first read. Each kept in `graphs` (`_plan_inputs`' key)."""
    keys = {t: (str(request.model_path), tuple(sorted(request.dims.items())), t) for t in ladder}
    if keys[ladder[0]] not in graphs:
        graphs[keys[ladder[0]]] = load_graphs(request.model_path, request.dims, ladder[0], tracker)
    forward = graphs[keys[ladder[0]]][0]

    def step(training: Training) -> Graph:
        if keys[training] not in graphs:
            made = training_graph(forward, training, replays(forward, training))
            graphs[keys[training]] = forward, made
        return graphs[keys[training]][1]

    return forward, Lazy(ladder, step)

"""The plan document: what `autoshard plan --json` and `autoshard propagate --json` print,
`-o plan.json` writes, the REST API's `plan` holds and `autoshard partition --plan`, `report`,
`diff`, `html`, `explain` and `export` read. A `PlanDocument`, read by attribute; its JSON is
versioned by its schema and written and read here only (`to_json`, `from_json`):

    {"schema": "autoshard.plan/1", "model": {...}, "story": "...", "mesh": "4x8",
     "cluster": {...},
     "values": {name: {"sharding", "partial"}},
     "ops": {name: {"type", "sharding_option", "flops", "bytes", "compute_s"[, "phase"]}},
     "unruled": [...], "collectives": [...], "cost": {...}, "breakdown": {...},
     "recipes": {...}, "solver": {...} | null,
     "search": {..., "objective", "time_limit", "annotations"} | null,
     "timing": {"build_s", "solve_s"} | null}

`story` is the strategy in words (`document.story`): one paragraph naming the data, tensor,
sequence and expert parallelism the plan uses, per repeated layer and for the rest, and how its
weights are held; the plan summary and report.md open with it. `breakdown` regroups the cost
(`document.breakdown`): compute and communication per mesh axis of one repeated layer and of
all of them, of the rest, compute by op type, the top collectives by time, and the memory at
the peak by kind per repeated layer and for the rest. `recipes` prices the standard layouts
(data parallel, ZeRO, FSDP, Megatron TP x DP, TP x FSDP) beside the plan (`document.recipes`).
`search` also records what the search
was asked (its objective, time limit and annotations), so that `autoshard explain` can solve
again with one more annotation (`--why-not`). A plan that annotations decided (`autoshard
propagate`) has no search: its `solver`, `search` and `timing` are null. A training step's
plan also has `"mode": "training"`, its `training` options and each trained weight's
`strategy` (`autoshard.training.strategy`: how it is held, used, its optimizer state split,
and the buffers it does not train, counted and the first few named),
with `cost.phases` and `cost.memory_by_kind`.

Everything but `timing` is a function of the request: two runs write the same bytes once the
wall-clock figures, all in `timing`, are dropped.

A saved plan is decided by its `ops` (each op's sharding option) and its `values` (how inputs
and weights are held): the rest follows from the rules (`propagate.plan_from_options`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from autoshard.annotations import Annotation
from autoshard.cost.cluster import Cluster
from autoshard.cost.price import Cost
from autoshard.cost.replay import replay_figures, replay_text
from autoshard.document.blocks import (
    BUFFERS_LISTED,
    Asked,
    ClusterInfo,
    CollectiveEntry,
    CostFigures,
    Decisions,
    DocumentError,
    HeldValue,
    ModelInfo,
    OpEntry,
    RepeatedLayers,
    SearchFigures,
    SolverFigures,
    Strategy,
    Timing,
    WeightStrategy,
)
from autoshard.document.breakdown import breakdown
from autoshard.document.recipes import RecipeRow, Recipes, recipes_block
from autoshard.document.story import batch_axes, strategy_story
from autoshard.errors import AutoshardError
from autoshard.files import sha256_file, write_atomic
from autoshard.ir.graph import Graph
from autoshard.mesh import Mesh
from autoshard.plan import RETURN, Plan, plan_from_options, returned_as
from autoshard.program import Program
from autoshard.rules import rule_for
from autoshard.search.options import Objective, SolverOptions
from autoshard.search.recipe_prices import RecipePrice
from autoshard.sharding import Sharding, ShardingOption
from autoshard.training import Recompute, Training
from autoshard.training.buffers import buffer_names
from autoshard.training.strategy import strategy_counts, weight_strategies

if TYPE_CHECKING:  # only for the figures it reports; reading a plan needs no search
    from autoshard.search.budget import Planned

T = TypeVar("T")

SCHEMA = "autoshard.plan/1"


@dataclass(frozen=True, kw_only=True)
class PlanDocument:
    """A plan document (`autoshard.plan/1`, see the module docstring), read by attribute.
    `from_json` reads what `to_json` writes, byte for byte once dumped as `document_text`
    does; a block the document lacks reads as None (or empty), as a plan written by hand for
    `autoshard report` or `diff` may lack all but its model, mesh and cost."""

    model: ModelInfo
    mesh: Mesh
    story: str | None = None
    mode: str | None = None  # "training" for a training step's plan
    training: Training | None = None
    strategy: Strategy | None = None
    cluster: ClusterInfo | None = None
    values: Mapping[str, HeldValue] = field(default_factory=dict)
    ops: Mapping[str, OpEntry] = field(default_factory=dict)
    unruled: tuple[str, ...] = ()
    collectives: tuple[CollectiveEntry, ...] = ()
    cost: CostFigures | None = None
    breakdown: Mapping[str, Any] | None = None
    """The cost regrouped (`document.breakdown`), kept as its JSON: it is large, and read only
    to be shown (the plan summary, the HTML report)."""
    recipes: Recipes | None = None
    pipeline: Mapping[str, Any] | None = None
    """A pipelined plan's stages, schedule and price (`search.pipelined.PipelinePrice`, its
    JSON with the whole mesh): its `mesh`, `cost` and decisions are one stage's, on the mesh
    without the pipeline axis. Absent where the plan has no pipeline."""
    solver: SolverFigures | None = None
    search: SearchFigures | None = None
    timing: Timing | None = None

    @property
    def decisions(self) -> Decisions:
        """What decides the plan: its `ops`, `values` and training step."""
        return Decisions(self.ops, self.values, self.training)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"schema": SCHEMA, "model": self.model.to_json()}
        if self.story is not None:
            data["story"] = self.story
        if self.mode is not None:
            data["mode"] = self.mode
        if self.training is not None:
            data["training"] = self.training.to_json()
        if self.strategy is not None:
            data["strategy"] = self.strategy.to_json()
        data["mesh"] = str(self.mesh)
        if self.cluster is not None:
            data["cluster"] = self.cluster.to_json()
        data |= {"values": {name: v.to_json() for name, v in self.values.items()},
                 "ops": {name: op.to_json() for name, op in self.ops.items()},
                 "unruled": list(self.unruled),
                 "collectives": [c.to_json() for c in self.collectives]}  # fmt: skip
        if self.cost is not None:
            data["cost"] = self.cost.to_json()
        if self.breakdown is not None:
            data["breakdown"] = self.breakdown
        if self.recipes is not None:
            data["recipes"] = self.recipes.to_json()
        if self.pipeline is not None:
            data["pipeline"] = self.pipeline
        return data | {
            "solver": self.solver.to_json() if self.solver is not None else None,
            "search": self.search.to_json() if self.search is not None else None,
            "timing": self.timing.to_json() if self.timing is not None else None,
        }

    @staticmethod
    def from_json(data: object, source: str = "plan") -> PlanDocument:
        """The document of JSON `data`, checked to be one (its schema) and well formed;
        `source` names it in errors (`plan PATH`)."""
        if not isinstance(data, Mapping) or data.get("schema") != SCHEMA:
            raise DocumentError(f"{source} is not an autoshard plan (schema {SCHEMA})")
        try:
            decisions = Decisions.from_json(data, source)
            mesh = Mesh.parse(str(data.get("mesh")))

            def block(key: str, read: Callable[[Mapping[str, Any]], T]) -> T | None:
                return None if data.get(key) is None else read(data[key])

            return PlanDocument(
                model=ModelInfo.from_json(data.get("model") or {}), mesh=mesh,
                story=data.get("story"), mode=data.get("mode"), training=decisions.training,
                strategy=block("strategy", Strategy.from_json),
                cluster=block("cluster", ClusterInfo.from_json),
                values=decisions.values, ops=decisions.ops,
                unruled=tuple(data.get("unruled") or ()),
                collectives=tuple(map(CollectiveEntry.from_json, data.get("collectives") or ())),
                cost=block("cost", CostFigures.from_json), breakdown=data.get("breakdown"),
                recipes=block("recipes", Recipes.from_json), pipeline=data.get("pipeline"),
                solver=block("solver", SolverFigures.from_json),
                search=block("search", SearchFigures.from_json),
                timing=block("timing", lambda t: Timing(t["build_s"], t["solve_s"])),
            )  # fmt: skip
        except AutoshardError:  # a bad mesh, or training option: its own message
            raise
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise DocumentError(f"{source} is malformed: {error!r}") from None


# ---- writing -----------------------------------------------------------------------------------


def describe(plan: Plan, graph: Graph, cost: Cost | None = None) -> dict[str, Any]:
    """The plan's `values` and `ops` (and `unruled`: the ops computed replicated). A graph input's
    or weight's entry says how it is held and, in `read_as`, how each op reads it (held split
    further than read: gathered before that op); a graph output returned otherwise than
    complete as held (a required annotation for users) says how, in `returned_as`. With `cost`,
    each op's entry adds what one device spends on it: `flops`, `bytes` (read and written) and
    `compute_s`; a training step's op also says its `phase` (forward, backward, gradient_sync,
    optimizer)."""
    read_as: dict[str, dict[str, str]] = {}
    for op in graph.ops:
        for i, name in enumerate(op.inputs):
            if name and graph.producer(name) is None and name not in graph.constants:
                rank = len(graph.values[name].shape)
                read_as.setdefault(name, {}).setdefault(
                    op.name, plan.needs[(op.name, i)].text(rank)
                )
    values: dict[str, dict[str, object]] = {}
    for name, value in graph.values.items():
        sharding = plan.values[name]
        partial = (
            f"{sharding.partial_type}{list(sharding.partial_axes)}"
            if sharding.partial_axes
            else None
        )
        values[name] = {
            "sharding": Sharding(sharding.split_axes).text(len(value.shape)),
            "partial": partial,
        }
        if name in read_as:
            values[name]["read_as"] = read_as[name]
    for i, name in enumerate(graph.outputs):
        returned = plan.needs[(RETURN, i)]
        if returned != returned_as(graph, plan.values, name):
            values[name]["returned_as"] = returned.text(len(graph.values[name].shape))
    ops: dict[str, dict[str, object]] = {}
    for op in graph.ops:
        option = plan.options[op.name]
        ops[op.name] = {
            "type": op.type,
            "sharding_option": str(option) if option is not None else None,
        }
        if cost is not None and op.name in cost.ops:
            ops[op.name] |= cost.ops[op.name].to_json()
        if graph.phases:  # a training step's op says its phase, so its cost can be split by it
            ops[op.name]["phase"] = graph.phase(op.name)
    return {"values": values, "ops": ops, "unruled": list(plan.unruled)}


def plan_document(
    graph: Graph,
    cluster: Cluster,
    plan: Plan,
    program: Program,
    cost: Cost,
    model: ModelInfo,
    planned: Planned | None = None,
    training: Training | None = None,
    *,
    asked: tuple[SolverOptions, Sequence[Annotation]] | None = None,
    names: Mapping[str, str] | None = None,
    recipes: Sequence[RecipePrice] | None = None,
    recompute_chosen: bool = False,
) -> PlanDocument:
    """The plan document; `planned` adds the solver's and the search problem's figures, and
    `asked` what it was asked (its options and annotations); a training step's plan says so
    (`mode`, `training`). `names` are the source model's parameter names, for the story;
    `recipes` the standard layouts' prices (`search.recipe_prices`), beside the plan's;
    `recompute_chosen` whether the search chose the step's recomputation (`--recompute auto`),
    which the story says with its figures
    (`cost.replay`)."""
    solver = search = timing = repeats = usage = None
    if planned is not None:
        s, problem = planned.solution, planned.search.problem
        solver = SolverFigures(str(s.status), s.objective * problem.unit, s.bound * problem.unit,
                               s.gap, s.variables, s.constraints)  # fmt: skip
        repeats, usage = planned.search.repeats, planned.usage
        told = None
        if asked is not None:
            options, annotations = asked
            told = Asked(str(options.objective), options.time_limit,
                         tuple(a.to_json() for a in annotations))  # fmt: skip
        search = SearchFigures(
            len(problem.sizes), problem.variables, len(problem.edges), len(problem.memory),
            RepeatedLayers(repeats.start, repeats.period, repeats.count), told,
        )  # fmt: skip
        timing = Timing(round(planned.build_s, 3), round(planned.solve_s, 3))
    strategy = None
    if training is not None:
        strategies = weight_strategies(graph, plan, batch_axes(graph, plan))
        buffers = buffer_names(graph)
        strategy = Strategy(strategy_counts(strategies),
                            {w: WeightStrategy(**s) for w, s in strategies.items()},
                            len(buffers), tuple(buffers[:BUFFERS_LISTED]))  # fmt: skip
    collectives = program.collectives_json()
    described = describe(plan, graph, cost)
    story = strategy_story(graph, plan, collectives, names, repeats)
    if training is not None and training.recompute is not Recompute.NONE:
        figures = replay_figures(graph, plan, cost)
        story = f"{story} {replay_text(training, figures, recompute_chosen)}"
    return PlanDocument(
        model=model, mesh=cluster.mesh, story=story,
        mode="training" if training is not None else None, training=training, strategy=strategy,
        cluster=ClusterInfo.from_json(cluster.to_json()),
        values={name: HeldValue.from_json(v) for name, v in described["values"].items()},
        ops={name: OpEntry.from_json(op) for name, op in described["ops"].items()},
        unruled=tuple(plan.unruled), collectives=tuple(map(CollectiveEntry.from_json, collectives)),
        cost=CostFigures.from_json(cost.to_json()),
        breakdown=breakdown(graph, program, cost, repeats, usage),
        recipes=_recipes(recipes, cost, cluster, asked), solver=solver, search=search,
        timing=timing,
    )  # fmt: skip


def _recipes(
    prices: Sequence[RecipePrice] | None, cost: Cost, cluster: Cluster,
    asked: tuple[SolverOptions, Sequence[Annotation]] | None,
) -> Recipes | None:  # fmt: skip
    """The `recipes` block beside the plan's cost, ranked by its communication bytes where
    the plan minimized them."""
    if prices is None:
        return None
    by_bytes = asked is not None and asked[0].objective is Objective.BYTES
    plan = RecipeRow("plan", "plan", cost.objective, cost.compute_time_s,
                     cost.memory_bytes_per_device, True, None,
                     cost.comm_bytes_per_device if by_bytes else None)  # fmt: skip
    return recipes_block(prices, plan, cluster.memory)


def model_info(path: str | Path, graph: Graph, dims: Mapping[str, int]) -> ModelInfo:
    """The document's `model`: what identifies the model a plan is for."""
    return ModelInfo(graph.name or Path(path).stem, Path(path).name, sha256_file(path),
                     dict(sorted(dims.items())))  # fmt: skip


def document_text(document: PlanDocument) -> str:
    """A plan document as `autoshard plan -o` writes it."""
    return json.dumps(document.to_json(), indent=2) + "\n"


def write_document(path: str | Path, document: PlanDocument) -> None:
    write_atomic(Path(path), document_text(document).encode())


# ---- reading -----------------------------------------------------------------------------------


def read_document(path: str | Path) -> PlanDocument:
    """A plan document from a file, checked to be one (its schema)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise DocumentError(f"cannot read plan {path}: {error.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DocumentError(f"plan {path} is not JSON: {error}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise DocumentError(f"{path} is not an autoshard plan (schema {SCHEMA})")
    return PlanDocument.from_json(data, f"plan {path}")


def decisions_for(
    document: PlanDocument, path: str | Path, mesh: Mesh, model: str | Path,
    dims: Mapping[str, int],
) -> Decisions:  # fmt: skip
    """What decides plan `document` (read from `path`), checked to be for `model` with `dims`
    on `mesh`: a plan made for another model (its sha256), other dims or another mesh is
    refused, naming what differs."""
    made_for = document.model
    try:
        sha256 = sha256_file(model)
    except OSError as error:
        raise DocumentError(f"cannot read ONNX model '{model}': {error.strerror}") from None
    if made_for.sha256 != sha256:
        raise DocumentError(
            f"plan {path} is for another model: {made_for.file!r} with sha256 "
            f"{made_for.sha256}, not '{model}' with sha256 {sha256}"
        )
    if dict(made_for.dims) != dict(sorted(dims.items())):
        raise DocumentError(
            f"plan {path} is for dims {_dims_text(made_for.dims)}, "
            f"not {_dims_text(dims)}; give the plan's --dim values or plan again"
        )
    if str(document.mesh) != str(mesh):
        raise DocumentError(f"plan {path} is for mesh {document.mesh}, not {mesh}")
    return document.decisions


def read_plan_document(
    path: str | Path, mesh: Mesh, model: str | Path, dims: Mapping[str, int]
) -> Decisions:
    """What decides a plan in a plan file for `model` with `dims` on `mesh` (`decisions_for`)."""
    return decisions_for(read_document(path), path, mesh, model, dims)


def planned_dims(path: str | Path) -> dict[str, int]:
    """The symbolic dims plan file `path` was made for (`--dim` values): what partitioning it
    binds when the user gives none."""
    dims = read_document(path).model.dims
    try:
        return {str(name): int(size) for name, size in dims.items()}
    except (AttributeError, TypeError, ValueError):
        raise DocumentError(f"plan {path} has malformed model dims: {dims!r}") from None


def _dims_text(dims: object) -> str:
    if not isinstance(dims, Mapping) or not dims:
        return "none"
    return " ".join(f"{name}={size}" for name, size in sorted(dims.items()))


def plan_from_document(
    decided: Decisions | PlanDocument, graph: Graph, mesh: Mesh, source: str = "plan"
) -> Plan:
    """The plan of a plan document's `ops` (sharding options) and `values` (how inputs and
    weights are held): the rest follows from the rules."""
    ops, values = decided.ops, decided.values
    options: dict[str, ShardingOption | None] = {}
    try:
        for op in graph.ops:
            entry = ops.get(op.name)
            if entry is None:
                raise DocumentError(f"{source} has no op {op.name!r}: is it for this model?")
            rule = rule_for(op, graph)
            text = entry.sharding_option
            options[op.name] = (
                ShardingOption.parse(text, len(rule.loops)) if rule and text is not None else None
            )
        held = {
            name: v.held_sharding.check(mesh, graph.values[name].shape)
            for name, v in values.items()
            if name in graph.values and graph.producer(name) is None
        }
        returns = {
            name: returned.check(mesh, graph.values[name].shape)
            for name in graph.outputs
            if name in values and (returned := values[name].returned_sharding) is not None
        }
    except (AttributeError, KeyError, TypeError) as error:
        raise DocumentError(f"{source} is malformed: {error!r}") from None
    return plan_from_options(graph, mesh, options, held, returns)

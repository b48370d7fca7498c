"""The standard recipes priced in the plan's own search problem, beside the plan.

A recipe (`recipes`) pins how the batch, the weights and their training state are held; in
the search problem that is, per group, the choices holding (or reading) each pinned value so.
The recipe's program is the problem's optimum over those choices, memory aside (exact
elimination, the solver's first step): the fastest program with the recipe's layout, as
`autoshard plan` with the recipe's annotations finds it whenever it fits the budget. No
program is lowered, and a 32-layer model solves one layer, as its search does:

- its step time is its compute (the search's own costs, each op's roofline) plus its
  communication as materialization makes it (`traffic`: a reshard once per value and
  sharding, not once per reader as the search's objective counts it). The CCL passes after
  materialization may send less still, so the program's time is this or lower;
- its memory is the peak of the search's memory rows. Where its program makes a reshard of
  several collectives whose intermediates the rows do not count yet (`search.budget` counts
  them once a plan makes them), the memory is a lower bound (`memory_at_least`): the recipe
  fits when that bound plus every such intermediate whole (`Traffic.intermediates_bound`)
  does, does not when the bound alone is over, and may fit between the two.

The recipes share the request's wall-clock deadline (`--time-limit`), after the plan. Where
the deadline has passed, or the exact elimination's tables would be too large (a 3-axis mesh's
training step), a recipe is priced by the plan's own choices with the recipe's pins, each
group then moved to its cheapest kept choice beside its neighbours' until none moves
(`_projected`): a program of the recipe's layout, so its time is an upper bound (`at_most`).
A recipe pins a few groups, and its optimum differs from the plan's mostly near them.

When its fastest program does not fit, the recipe is told as not fitting: a slower program
with the same layout may still fit, and `explain --why-not RECIPE` searches for it under the
budget and lowers it. The bytes objective prices the recipe's program lowered (`cost.price`),
as it ranks recipes by the bytes they send.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.annotations import Annotation, bound_readers
from autoshard.cost.cluster import Cluster
from autoshard.cost.price import price
from autoshard.deadline import NEVER, Deadline
from autoshard.ir.graph import Graph, Op
from autoshard.passes.lower import lower_measured
from autoshard.rules import rule_for
from autoshard.search.candidates import option_reads, option_writes
from autoshard.search.coarsen import OpDecision
from autoshard.search.options import Objective
from autoshard.search.problem import Problem, Search
from autoshard.search.recipes import Layout, Recipe, recipe_layouts
from autoshard.search.solver.factors import Factor, minimize
from autoshard.search.solver.outcome import in_whole
from autoshard.search.solver.steps import Steps
from autoshard.sharding import Sharding, ShardingOption


@dataclass(frozen=True)
class RecipePrice:
    """A recipe's fastest program on the plan's cluster: its step time (compute plus
    communication, seconds), its compute, its peak memory per device and whether that fits
    the budget (and, priced for the bytes objective, its communication per device); or why
    the recipe does not apply (`refused`, the rest zero)."""

    recipe: Recipe
    step_time_s: float = 0.0
    compute_time_s: float = 0.0
    memory_bytes_per_device: int = 0
    fits: bool | None = False  # None: unknown, its memory a lower bound under the budget
    refused: str = ""
    comm_bytes_per_device: int | None = None  # priced by the bytes objective only
    memory_at_least: bool = False  # reshards whose intermediates the memory rows leave out
    at_most: bool = False  # a program of its layout, not proven its fastest: an upper bound
    choice: tuple[int, ...] = ()  # per group, its proven fastest program's (`search.critical`)


def price_recipes(
    graph: Graph, forward: Graph, cluster: Cluster, search: Search, objective: Objective,
    deadline: Deadline = NEVER, start: Sequence[int] = (),
) -> tuple[RecipePrice, ...]:  # fmt: skip
    """Every recipe of the plan's mode (`recipes_for`), priced in the plan's `search` within
    `deadline`; `start`: the plan's choice per group (the module docstring)."""
    tables = _Tables.of(search.problem, deadline, tuple(start))
    return tuple(
        price_recipe(graph, cluster, search, layout, objective, tables)
        for layout in recipe_layouts(graph, forward, cluster.mesh)
    )


def price_recipe(
    graph: Graph,
    cluster: Cluster,
    search: Search,
    layout: Layout,
    objective: Objective,
    tables: _Tables | None = None,
) -> RecipePrice:
    """One recipe's price (the module docstring)."""
    recipe = layout.recipe
    if layout.refused:
        return RecipePrice(recipe, refused=layout.refused)
    kept = _kept(graph, search, layout.annotations)
    if isinstance(kept, str):
        return RecipePrice(recipe, refused=kept)
    found = _fastest(tables or _Tables.of(search.problem), kept)
    if found is None:
        return RecipePrice(recipe, refused=OUT_OF_TIME)
    choice, at_most = found
    if objective is Objective.BYTES:
        program, usage = lower_measured(graph, search.plan(graph, cluster, choice))
        cost = price(program, graph, cluster, usage)
        peak = cost.memory_bytes_per_device
        return RecipePrice(recipe, cost.objective, cost.compute_time_s, peak,
                           peak <= cluster.memory, "", cost.comm_bytes_per_device,
                           at_most=at_most, choice=() if at_most else choice)  # fmt: skip
    compute, comm, chains = search.program_cost(choice)
    peak = search.problem.peak(choice)
    uncounted = chains - search.chains  # intermediates the rows do not count
    most = peak
    if uncounted and search.prices is not None:
        most += search.prices.traffic.intermediates_bound(uncounted)
    fits = True if most <= cluster.memory else False if peak > cluster.memory else None
    return RecipePrice(recipe, compute + comm, compute, peak, fits,
                       memory_at_least=bool(uncounted), at_most=at_most,
                       choice=() if at_most else choice)  # fmt: skip


OUT_OF_TIME = "not priced: the time limit ran out before its program was found"


def _kept(graph: Graph, search: Search, pins: Sequence[Annotation]) -> list[list[int]] | str:
    """Per group, the choices holding every pinned value as pinned; or, where a group keeps
    none, which value no choice holds so (the plan's own annotations may forbid it)."""
    allowed = [set(range(n)) for n in search.problem.sizes]
    for pin in pins:
        for group, shardings in _decided(graph, search, pin):
            allowed[group] &= {k for k, s in enumerate(shardings) if s == pin.sharding}
            if allowed[group]:
                continue
            rank = len(graph.values[pin.value].shape)
            return (
                f"no plan the search considers {'reads' if pin.for_users else 'holds'} "
                f"{pin.value} as {pin.sharding.text(rank)} with the recipe's other pins and "
                "the plan's annotations"
            )
    return [sorted(k) for k in allowed]


def _decided(
    graph: Graph, search: Search, pin: Annotation
) -> list[tuple[int, tuple[Sharding, ...]]]:
    """The groups deciding what `pin` pins, each with the sharding it pins under each of the
    group's choices: how the value is held (a weight's or input's own decision, or its
    producer's), or, for users, how each reader reads it. None for a constant or a value
    no op reads: nothing decides it."""
    grouping, name = search.grouping, pin.value
    if pin.for_users:
        found = []
        for op in bound_readers(graph, name):
            d = grouping.ops[op.name]
            for i in (i for i, read in enumerate(op.inputs) if read == name):
                found.append((d.group, tuple(_reads(graph, op, c, i) for c in d.picked)))
        return found
    if name in grouping.values:
        return [(grouping.values[name].group, grouping.values[name].picked)]
    producer = graph.producer(name)
    if producer is None or producer.name not in grouping.ops:
        return []
    decision: OpDecision = grouping.ops[producer.name]
    rule, out = rule_for(producer, graph), producer.outputs.index(name)
    return [(decision.group, tuple(
        option_writes(rule, c, out) if rule is not None and c is not None else Sharding()
        for c in decision.picked
    ))]  # fmt: skip


def _reads(graph: Graph, op: Op, option: ShardingOption | None, i: int) -> Sharding:
    rule = rule_for(op, graph)
    if rule is None or option is None or i >= len(rule.operands):
        return Sharding()
    return option_reads(rule, option, i)


@dataclass(frozen=True, eq=False)
class _Tables:
    """The problem's integer costs as arrays, made once for all the recipes, and the large
    elimination steps their solves share (a recipe pins a few groups: a step far from them is
    the same in every recipe's solve); the deadline they share and the plan's choice they
    start from (none: no start)."""

    node: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int, np.ndarray], ...]
    steps: Steps
    deadline: Deadline = NEVER
    start: tuple[int, ...] = ()

    @staticmethod
    def of(problem: Problem, deadline: Deadline = NEVER, start: tuple[int, ...] = ()) -> _Tables:
        node = tuple(np.asarray(costs, dtype=np.int64) for costs in problem.node_costs)
        edges = tuple((a, b, np.asarray(m, dtype=np.int64)) for a, b, m in problem.edges)
        return _Tables(node, edges, Steps(), deadline, start)


def _fastest(tables: _Tables, kept: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], bool] | None:
    """The optimum over the choices `kept`, memory aside, and whether it is only an upper
    bound: exact elimination of the problem's tables restricted to them (the factors
    `memory_aside` builds, in its order: the same ties); where its tables would be too large
    or the deadline has passed, the plan's choice with the recipe's pins, improved group by
    group (`_projected`: a bound, said so). A recipe prices a row of the document's side
    table: its proof would take a CP-SAT solve as long as the plan's own, once per recipe
    (`explain --why-not RECIPE` searches it). None: no plan to start from, and no time."""
    start = _projected(tables, kept) if tables.start else None
    if not tables.deadline.passed():
        found = minimize([len(k) for k in kept], _factors(tables, kept), steps=tables.steps)
        if found is not None:
            return in_whole(found.choice, kept), False
    return None if start is None else (in_whole(start, kept), True)


def _factors(tables: _Tables, kept: Sequence[Sequence[int]]) -> list[Factor]:
    """The problem's tables restricted to the choices `kept`, as factors."""
    index = [np.asarray(k, dtype=np.int64) for k in kept]
    factors = [
        Factor((g,), costs[i]) for g, (costs, i) in enumerate(zip(tables.node, index, strict=True))
    ]
    for a, b, matrix in tables.edges:
        table = matrix[np.ix_(index[a], index[b])]
        if a == b:  # pragma: no cover - the builder folds these into node costs
            factors.append(Factor((a,), np.diag(table).copy()))
        else:
            factors.append(Factor((a, b), table) if a < b else Factor((b, a), table.T.copy()))
    return factors


def _projected(tables: _Tables, kept: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The plan's choice (`tables.start`) with the recipe's pins, in the numbering of `kept`:
    each group's own where kept, else the first kept; then, sweep after sweep (at most
    `SWEEPS`), each group moved to its kept choice cheapest beside its neighbours' (the lowest
    on ties) until none moves. A program of the recipe's layout, so an upper bound on its
    fastest, and a local optimum of it."""
    at = [k.index(s) if s in k else 0 for s, k in zip(tables.start, kept, strict=True)]
    near: list[list[tuple[int, np.ndarray]]] = [[] for _ in kept]
    for a, b, matrix in tables.edges:
        if a != b:
            near[a].append((b, matrix[np.ix_(kept[a], kept[b])]))
            near[b].append((a, matrix[np.ix_(kept[a], kept[b])].T))
    own = [costs[list(k)] for costs, k in zip(tables.node, kept, strict=True)]
    for _ in range(SWEEPS):
        moved = False
        for g, costs in enumerate(own):
            total = costs + sum((matrix[:, at[h]] for h, matrix in near[g]), np.int64(0))
            best = int(np.argmin(total))
            if total[best] < total[at[g]]:
                at[g], moved = best, True
        if not moved:
            break
    return tuple(at)


SWEEPS = 20
"""The sweeps `_projected` makes at most: each costs a pass over the problem's edges."""

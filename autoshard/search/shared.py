"""One search under several memory budgets (`autoshard sweep`'s points that differ in their
budget alone): what the budget does not change is found once, and two kinds of budget are
answered without a search. Each answer is the one `budget.auto_plan` gives under that budget
alone.

- The problem is built once (`build_search`; the budget is only its memory rows' bound) and
  its memory-aside optimum solved once (it does not read the budget): a search under another
  budget starts from both, as it would have built and found them again.
- A budget that does not bind: where the plan found was the memory-aside optimum at every
  round of its search and the final memory rows count it at P bytes, a search under any
  budget of at least P takes the same steps to the same plan (each round's memory-aside
  optimum is the same and fits: rounds only add rows, so no round counts it at more than P).
  The answer is that plan and its price (`cost.price` reads no budget).
- A budget below a proven floor: where a search proved that no plan needs less than F bytes
  (`NoPlanFits.lowest.bound`), no plan fits a budget below F: refused as `auto_plan` refuses,
  with the lowest budget proven before (no search).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, MutableMapping, Sequence
from dataclasses import dataclass

from autoshard.annotations import Annotation
from autoshard.cost.cluster import Cluster
from autoshard.deadline import Deadline
from autoshard.ir.graph import Graph
from autoshard.limits import check_search_axes
from autoshard.progress import Tracker
from autoshard.search.budget import NoPlanFits, Planned, auto_plan, no_plan_fits
from autoshard.search.options import Objective, SolverOptions
from autoshard.search.problem import Search, build_search
from autoshard.search.solver.eliminate import memory_aside
from autoshard.search.solver.outcome import (
    InfeasibleError,
    Limit,
    LowestBudget,
    OutOfTime,
    Solution,
    SolverStatus,
)
from autoshard.training.options import Overlap


@dataclass
class SharedSearch:
    """What searches of one graph on one cluster (its budget aside) share: the problem as
    built, its memory-aside optimum, the plan where the budget did not bind (and the bytes
    its memory rows count), and the lowest budget proven where none fitted."""

    graph: Graph  # (the key holds its id: kept here so that the id stays this graph's)
    search: Search
    aside: Solution | None = None
    free: Planned | None = None
    free_peak: int = 0
    lowest: LowestBudget | None = None


SearchCache = MutableMapping[Hashable, SharedSearch]
"""Shared searches by `shared_key`: what a caller planning one model under many budgets
keeps (`autoshard sweep`'s workers)."""


def shared_key(
    graph: Graph, cluster: Cluster, annotations: Sequence[Annotation], options: SolverOptions,
    overlap: Overlap | None,
) -> Hashable:  # fmt: skip
    """What a search reads but the budget: the graph (by identity), the cluster's mesh, links
    and device, the annotations and the options (by their exact `repr`: a device holds
    mappings)."""
    links = (cluster.mesh, cluster.device, cluster.bandwidth, cluster.latency)
    return (id(graph), repr((links, tuple(annotations), options, overlap)))


def shared_plan(
    graph: Graph, cluster: Cluster, annotations: Sequence[Annotation], options: SolverOptions,
    tracker: Tracker | None, deadline: Deadline, explain: bool, overlap: Overlap | None,
    kept: SearchCache,
) -> Planned:  # fmt: skip
    """`auto_plan(graph, cluster, ...)`, from what `kept` holds of the same search under
    other budgets, and kept for the next."""
    say = tracker.detail if tracker is not None else (lambda _: None)
    entry = _entry(graph, cluster, annotations, options, overlap, deadline, kept)
    budget = cluster.memory
    if entry.free is not None and entry.free_peak <= budget:
        say("the plan found before under a budget that does not bind")
        return dataclasses.replace(entry.free, search=_under(entry.free.search, budget))
    if entry.lowest is not None and budget < entry.lowest.bound:
        say("below the lowest budget proven before")
        if not explain:
            raise InfeasibleError("no plan fits the memory budget")
        raise no_plan_fits(graph, cluster, _under(entry.search, budget), entry.lowest)
    if entry.aside is None:
        entry.aside = _aside(entry.search, options, tracker, deadline)
    try:
        planned = auto_plan(graph, cluster, annotations, options, tracker, deadline, explain,
                            overlap, reuse=entry.search, aside=entry.aside)  # fmt: skip
    except NoPlanFits as none:
        entry.lowest = none.lowest
        raise
    aside, choice = entry.aside, planned.solution.choice
    counted = planned.search.problem.peak(choice)
    if (aside is not None and aside.status is SolverStatus.OPTIMAL and choice == aside.choice
            and counted <= budget and planned.usage.peak <= counted):  # fmt: skip
        entry.free, entry.free_peak = planned, counted
    return planned


def _entry(
    graph: Graph, cluster: Cluster, annotations: Sequence[Annotation], options: SolverOptions,
    overlap: Overlap | None, deadline: Deadline, kept: SearchCache,
) -> SharedSearch:  # fmt: skip
    key = shared_key(graph, cluster, annotations, options, overlap)
    entry = kept.get(key)
    if entry is None or entry.graph is not graph:
        check_search_axes(cluster.mesh.ndim, f"mesh {cluster.mesh}")
        search = build_search(graph, cluster, annotations, options.objective, deadline=deadline)
        entry = kept[key] = SharedSearch(graph=graph, search=search)
    return entry


def _under(search: Search, budget: int) -> Search:
    return dataclasses.replace(search, problem=dataclasses.replace(search.problem, budget=budget))


def _aside(
    search: Search, options: SolverOptions, tracker: Tracker | None, deadline: Deadline
) -> Solution | None:
    """The memory-aside optimum as the search's first solve finds it (None where the deadline
    passes first: the solve then answers as it does without one)."""
    unit = "B" if options.objective == Objective.BYTES else "s"
    limit = Limit(options.time_limit, options.time_limit, "memory-aside", deadline)
    try:
        return memory_aside(search.problem, limit, tracker, unit)
    except OutOfTime:
        return None

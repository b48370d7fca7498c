"""Searches shared across memory budgets (`search.shared`): under each budget the plan (or
refusal) `auto_plan` gives under that budget alone, and the answers it promises without a
search given without one: a budget that does not bind, a budget below a proven floor."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoshard.cost.cluster import make_cluster
from autoshard.deadline import NEVER
from autoshard.ir.graph import Graph
from autoshard.pipeline import load_graph
from autoshard.progress import Progress, Tracker
from autoshard.search.budget import NoPlanFits, Planned, auto_plan
from autoshard.search.options import SolverOptions
from autoshard.search.shared import SearchCache, SharedSearch, shared_plan

MLP = Path(__file__).parents[2] / "models" / "mlp.onnx"
OPTIONS = SolverOptions()


@pytest.fixture(scope="module")
def graph() -> Graph:
    return load_graph(MLP, {"batch": 8}, None)


def _alone(graph: Graph, memory: str) -> Planned:
    return auto_plan(graph, make_cluster("2x2", memory=memory), options=OPTIONS)


def _shared(graph: Graph, memory: str, kept: SearchCache, said: list[str] | None = None) -> Planned:
    """`shared_plan` under `memory`; what it did told into `said`."""

    def view(progress: Progress) -> None:
        if said is not None and progress.detail:
            said.append(progress.detail)

    cluster = make_cluster("2x2", memory=memory)
    return shared_plan(graph, cluster, (), OPTIONS, Tracker(view), NEVER, True, None, kept)


def _same(found: Planned, alone: Planned) -> None:
    assert found.plan == alone.plan
    assert found.cost == alone.cost
    assert found.usage.peak == alone.usage.peak
    assert found.search.problem.budget == alone.search.problem.budget


def test_each_budget_gets_its_own_plan_and_free_ones_no_search(graph: Graph) -> None:
    kept: SearchCache = {}
    free = _shared(graph, "1GiB", kept)
    _same(free, _alone(graph, "1GiB"))
    (entry,) = kept.values()
    assert isinstance(entry, SharedSearch) and entry.free is free
    # A budget the free plan fits: that plan, no search (the same program object).
    said: list[str] = []
    roomy = _shared(graph, f"{entry.free_peak}B", kept, said)
    _same(roomy, _alone(graph, f"{entry.free_peak}B"))
    assert roomy.program is free.program and roomy.solution is free.solution
    assert said == ["the plan found before under a budget that does not bind"]
    # A budget one byte below what the free plan's rows count binds: searched, another plan.
    tight = f"{entry.free_peak - 1}B"
    binding = _shared(graph, tight, kept)
    _same(binding, _alone(graph, tight))
    assert binding.plan != free.plan
    assert entry.free is free  # (the plan of a budget that binds is no free plan)


def test_a_budget_below_a_proven_floor_is_refused_without_a_search(graph: Graph) -> None:
    kept: SearchCache = {}
    with pytest.raises(NoPlanFits) as first:
        _shared(graph, "1KB", kept)
    with pytest.raises(NoPlanFits) as alone:
        _alone(graph, "1KB")
    assert str(first.value) == str(alone.value)
    (entry,) = kept.values()
    assert entry.lowest is not None and entry.lowest.bound > 2000
    said: list[str] = []
    with pytest.raises(NoPlanFits) as below:
        _shared(graph, "2KB", kept, said)
    assert said == ["below the lowest budget proven before"]
    with pytest.raises(NoPlanFits) as searched:
        _alone(graph, "2KB")
    assert str(below.value) == str(searched.value)

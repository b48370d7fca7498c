"""The recipes beside a plan share the request's wall-clock deadline (`search.recipe_prices`):
where it passes before they are priced, the plan still answers, unchanged, each recipe priced
by the plan's choices with its pins (an upper bound, said so), or, with no plan to start
from, not priced. The deadline is a clock of the test's own, passed as the recipes are
priced, never a wall-clock race."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

import autoshard.pipeline.request as request_module
from autoshard.cost.cluster import make_cluster
from autoshard.deadline import NEVER, Deadline
from autoshard.document.recipes import recipe_cells
from autoshard.pipeline import PlanRequest, load_graphs, plan_request
from autoshard.search.options import Objective
from autoshard.search.problem import build_search
from autoshard.search.recipe_prices import OUT_OF_TIME, _projected, _Tables, price_recipes
from autoshard.search.solver.steps import Steps
from autoshard.training import Training

MLP = Path(__file__).resolve().parents[2] / "models" / "mlp.onnx"
DIMS = {"batch": 8}


class _Clock:
    """A clock the test moves: a reading of it is `now`."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _late(clock: _Clock):
    """`price_recipes` called an hour late on `clock`: the plan is found, the recipes are not
    priced yet."""

    def priced(*args, **kwargs):
        clock.now += 3600.0
        return price_recipes(*args, **kwargs)

    return priced


def _request() -> PlanRequest:
    return PlanRequest(model_path=MLP, cluster=make_cluster("2x2"), dims=DIMS, training=Training(),
                       time_limit=60.0)  # fmt: skip


@pytest.fixture(scope="module")
def in_time():
    return plan_request(_request())


def test_recipes_out_of_time_answer_with_the_plan_and_an_upper_bound(in_time, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(request_module, "price_recipes", _late(clock))
    late = plan_request(_request(), deadline=Deadline.start(60, clock))
    assert clock.now == 3600.0  # the deadline passed after the search, before the recipes
    assert late.planned.plan == in_time.planned.plan
    assert late.document.cost == in_time.document.cost
    assert late.document.recipes is not None and in_time.document.recipes is not None
    exact = {r.name: r for r in in_time.document.recipes.rows}
    priced = [r for r in late.document.recipes.rows if not r.refused]
    assert {r.name for r in priced} == {"dp", "zero", "fsdp", "tp-dp", "tp-fsdp"}
    for row in priced:
        assert row.at_most and row.to_json()["at_most"] is True
        assert not exact[row.name].at_most and "at_most" not in exact[row.name].to_json()
        # the plan's choices with the recipe's pins: a program of its layout, no faster than
        # its fastest
        assert row.step_time_s >= exact[row.name].step_time_s * (1 - 1e-12)
    cells = {c[0]: c for c in recipe_cells(late.document.recipes)}
    assert all(cells[r.name][1].startswith("<= ") for r in priced)


def test_a_recipe_with_no_start_and_no_time_is_not_priced():
    forward, graph = load_graphs(MLP, DIMS, Training())
    cluster = make_cluster("2x2")
    search = build_search(graph, cluster)
    clock = _Clock()
    passed = Deadline.start(1.0, clock)
    clock.now = 2.0
    prices = price_recipes(graph, forward, cluster, search, Objective.TIME, passed)
    assert {p.recipe.value: p.refused for p in prices} == {
        name: OUT_OF_TIME for name in ("dp", "zero", "fsdp", "tp-dp", "tp-fsdp")
    }


@pytest.mark.parametrize("seed", range(10))
def test_the_projected_plan_is_a_local_optimum_of_the_recipes_choices(seed):
    """`_projected` on random tables (5 groups of 4 choices, 7 edges), 2 or 3 choices kept
    per group: a choice per group among those kept, no cheaper by moving any one group (a
    local optimum), and no cheaper than the brute-forced optimum over the kept choices."""
    rng = np.random.default_rng(seed)
    sizes = [4] * 5
    node = tuple(rng.integers(0, 50, 4) for _ in sizes)
    pairs = [(0, 1), (1, 2), (2, 3), (3, 4), (0, 2), (1, 4), (0, 4)]
    edges = tuple((a, b, rng.integers(0, 50, (4, 4))) for a, b in pairs)
    kept = [sorted(rng.choice(4, int(rng.integers(2, 4)), replace=False).tolist()) for _ in sizes]
    start = tuple(int(k) for k in rng.integers(0, 4, 5))
    tables = _Tables(node, edges, Steps(), NEVER, start)

    def cost(at):
        whole = [k[i] for k, i in zip(kept, at, strict=True)]
        return sum(int(c[w]) for c, w in zip(node, whole, strict=True)) + sum(
            int(m[whole[a], whole[b]]) for a, b, m in edges
        )

    at = _projected(tables, kept)
    assert all(0 <= i < len(k) for i, k in zip(at, kept, strict=True))
    for g, k in enumerate(kept):
        for other in range(len(k)):
            assert cost(at) <= cost(at[:g] + (other,) + at[g + 1 :])
    best = min(cost(c) for c in itertools.product(*(range(len(k)) for k in kept)))
    assert cost(at) >= best

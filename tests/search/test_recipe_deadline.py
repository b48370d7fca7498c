"""The recipes beside a plan share the request's wall-clock deadline (`search.recipe_prices`):
where it passes before they are priced, the plan still answers, unchanged, each recipe priced
by the plan's choices with its pins (an upper bound, said so), or, with no plan to start
from, not priced. The deadline is a clock of the test's own, passed on entering the document
stage, never a wall-clock race."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoshard.cost.cluster import make_cluster
from autoshard.deadline import Deadline
from autoshard.document.recipes import recipe_cells
from autoshard.pipeline import PipelineStage, PlanRequest, load_graphs, plan_request
from autoshard.progress import Tracker
from autoshard.search.options import Objective
from autoshard.search.problem import build_search
from autoshard.search.recipe_prices import OUT_OF_TIME, price_recipes
from autoshard.training import Training

MLP = Path(__file__).resolve().parents[2] / "models" / "mlp.onnx"
DIMS = {"batch": 8}


class _Clock:
    """A clock the test moves: a reading of it is `now`."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _PassesAtTheDocument(Tracker):
    """A tracker that moves `clock` an hour on when the document stage begins: the plan is
    found, the recipes are not priced yet."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__(lambda _: None)
        self._clock = clock

    def stage(self, name: str, detail: str = "") -> None:
        if name == PipelineStage.DOCUMENT:
            self._clock.now += 3600.0
        super().stage(name, detail)


def _request() -> PlanRequest:
    return PlanRequest(model_path=MLP, cluster=make_cluster("2x2"), dims=DIMS, training=Training(),
                       time_limit=60.0)  # fmt: skip


@pytest.fixture(scope="module")
def in_time():
    return plan_request(_request())


def test_recipes_out_of_time_answer_with_the_plan_and_an_upper_bound(in_time):
    clock = _Clock()
    late = plan_request(_request(), _PassesAtTheDocument(clock), deadline=Deadline.start(60, clock))
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

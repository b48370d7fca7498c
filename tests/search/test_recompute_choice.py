"""`--recompute auto`'s choice (`search.recompute.choose_recompute`): branch and bound over
the recomputations by their step's bound, worked by hand on tables of step times, and the
bound (`compute_floor`) held to the steps of real plans."""

from __future__ import annotations

import pytest

from autoshard.cost.cluster import make_cluster
from autoshard.cost.replay import compute_floor, recompute_ladder
from autoshard.deadline import TimeUp
from autoshard.pipeline import PlanRequest, _step_graphs
from autoshard.search.budget import auto_plan
from autoshard.search.recipes import Recipe, recipe_layout
from autoshard.search.recompute import Lazy, choose_recompute, recompute_words
from autoshard.search.solver.outcome import InfeasibleError, OutOfTime
from autoshard.training import Attention, Recompute, Training
from tests.training.test_recompute import _small_decoder

DIMS = {"batch": 8, "seq": 32}

NONE, LAYERS4, SELECTIVE_OP, LAYERS = (
    Training(recompute=Recompute.NONE), Training(recompute=Recompute.LAYERS, every=4),
    Training(recompute=Recompute.SELECTIVE_OP), Training(recompute=Recompute.LAYERS),
)  # fmt: skip
TRIED = (NONE, LAYERS4, SELECTIVE_OP, LAYERS)


def _choose(bounds, steps, binds=True):
    """`choose_recompute` over TRIED with `bounds`; `steps[t]`: its plan's step, or an error
    to raise; `binds`: whether the budget binds the searches; returns the choice, what was
    considered and the order solved."""
    solved: list[str] = []

    def solve(training: Training, last: bool) -> tuple[float, bool]:
        solved.append(training.recompute_text + ("!" if last else ""))
        found = steps[training]
        if isinstance(found, Exception):
            raise found
        return found, binds

    bounded = dict(zip(TRIED, bounds, strict=True))
    chosen, considered = choose_recompute(TRIED, bounded, solve)
    return chosen, considered, solved


def test_a_recompute_is_chosen_where_keeping_everything_fits_only_at_much_communication():
    """The module's worked example: none fits at 20 s (its activations sharded, much
    communication); layers:4's bound 11 < 20: solved, 12 s; selective-op's bound 12.5 and
    layers' 13 are no better than 12: not solved. Chosen layers:4, runner-up none."""
    chosen, considered, solved = _choose(
        (10.0, 11.0, 12.5, 13.0), {NONE: 20.0, LAYERS4: 12.0, SELECTIVE_OP: 12.6, LAYERS: 13.1}
    )
    assert chosen.training == LAYERS4 and chosen.step_s == 12.0
    assert solved == ["none", "layers:4"]
    assert [(c.training.recompute_text, c.step_s) for c in considered] == [
        ("none", 20.0), ("layers:4", 12.0), ("selective-op", None), ("layers", None)
    ]  # fmt: skip
    assert recompute_words(chosen, considered) == (
        "Recompute layers:4, the fastest step of those tried (12 s a step); runner-up none: "
        "20 s a step (+66.7 %); selective-op: not solved, no plan of it under 12.5 s; layers: "
        "not solved, no plan of it under 13 s."
    )
    _, considered, _ = _choose((10.0, 11.0, 12.0, 13.0), {NONE: 20.0}, binds=False)
    assert recompute_words(considered[0], considered) == (
        "Recompute none (20 s a step); layers:4, selective-op and layers: not solved, the "
        "budget binds no plan keeping every activation."
    )


def test_none_is_kept_where_no_recompute_can_beat_it():
    chosen, _, solved = _choose((10.0, 11.0, 12.0, 13.0), {NONE: 10.5})
    assert chosen.training == NONE and solved == ["none"]


def test_none_is_kept_without_searching_the_rest_where_the_budget_binds_none_of_its_plans():
    """The search's optimum with memory aside fits: recomputing frees memory it does not
    need, at more compute (even where the step floors are below none's step)."""
    chosen, considered, solved = _choose((10.0, 11.0, 12.0, 13.0), {NONE: 20.0}, binds=False)
    assert chosen.training == NONE and solved == ["none"]
    assert considered[1].why == "not solved, the budget binds no plan keeping every activation"


def test_floors_and_bounds_are_priced_only_where_they_decide():
    """A bound decides only once a plan is found: the first candidate's is never priced, and
    none is where `none`'s plan leaves the budget unbound (`Lazy` prices on first read), nor
    any memory floor then; the last candidate's floor is never read (it answers where none
    fits). Those over the budget are skipped in their place in the order."""
    priced: list[str] = []

    def price(table: dict[Training, float]) -> Lazy[float]:
        def read(training: Training) -> float:
            priced.append(training.recompute_text)
            return table[training]

        return Lazy(TRIED, read)

    def solve(training: Training, last: bool) -> tuple[float, bool]:
        return {NONE: 20.0, LAYERS4: 12.0, SELECTIVE_OP: 11.5}[training], True

    bounds = price({NONE: 10.0, LAYERS4: 11.0, SELECTIVE_OP: 11.8, LAYERS: 13.0})
    floors = {NONE: 9, LAYERS4: 8, SELECTIVE_OP: 7, LAYERS: 6}
    chosen, _ = choose_recompute(TRIED, bounds, lambda t, last: (20.0, False), price(floors), 100)
    assert chosen.training == NONE and priced == ["none"]
    priced.clear()
    floors = price(floors)
    chosen, considered = choose_recompute(TRIED, bounds, solve, floors, 8.5)
    assert chosen.training == SELECTIVE_OP
    assert priced == ["none", "layers:4", "selective-op", "selective-op", "layers"]
    assert [(c.training, c.bound_s, c.step_s) for c in considered] == [
        (NONE, None, None), (LAYERS4, None, 12.0), (SELECTIVE_OP, 11.8, 11.5), (LAYERS, 13.0, None)
    ]  # fmt: skip
    assert considered[0].why == "needs at least 9 B per device"
    with pytest.raises(KeyError):
        bounds[Training(recompute=Recompute.SELECTIVE)]


def test_a_bound_below_the_best_is_solved_even_when_a_later_one_is_not():
    """Solved in TRIED's order; each candidate is pruned by its own bound alone."""
    chosen, _, solved = _choose(
        (10.0, 15.0, 11.0, 16.0), {NONE: 14.0, SELECTIVE_OP: 13.0, LAYERS4: 99.0, LAYERS: 99.0}
    )
    assert chosen.training == SELECTIVE_OP and solved == ["none", "selective-op"]


def test_where_none_fits_the_next_is_solved_and_the_last_chance_explains():
    """No plan of the first three fits: the last is solved as the last chance (its error, with
    the least memory a plan needs, is the answer where it has none either)."""
    no = InfeasibleError("no plan fits the memory budget")
    chosen, considered, solved = _choose(
        (10.0, 11.0, 12.0, 13.0), {NONE: no, LAYERS4: no, SELECTIVE_OP: no, LAYERS: 30.0}
    )
    assert chosen.training == LAYERS and solved == ["none", "layers:4", "selective-op", "layers!"]
    assert [c.why for c in considered[:3]] == ["no plan fits"] * 3
    with pytest.raises(InfeasibleError):
        _choose((10.0, 11.0, 12.0, 13.0), dict.fromkeys(TRIED, no))


@pytest.mark.parametrize(
    "out",
    [TimeUp("the time limit ran out"), OutOfTime("it ran out in the memory-bound solve")],
    ids=["building", "solving"],
)
def test_out_of_time_answers_with_the_fastest_found(out):
    """The time runs out while a candidate's problem is built (`TimeUp`) or while its solve
    has no plan yet (`OutOfTime`): the fastest found answers; with none found, the error."""
    chosen, considered, solved = _choose(
        (10.0, 11.0, 12.0, 13.0), {NONE: 20.0, LAYERS4: out, SELECTIVE_OP: 1.0, LAYERS: 1.0}
    )
    assert chosen.training == NONE and solved == ["none", "layers:4"]
    assert [c.why for c in considered[1:]] == ["out of time"] * 3
    with pytest.raises(type(out)):
        _choose((10.0, 11.0, 12.0, 13.0), dict.fromkeys(TRIED, out))


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return _small_decoder(tmp_path_factory.mktemp("decoder") / "decoder.onnx")


@pytest.mark.parametrize("mesh", ["2", "2x2"])
def test_no_plan_steps_faster_than_the_step_floor(decoder, mesh):
    """Each recomputation's step floor is at most its plan's compute, under its step, and at
    most the compute of another plan, data parallelism's (the batch over every axis)."""
    fused = Training(attention=Attention.FUSED)
    cluster = make_cluster(mesh=mesh)
    request = PlanRequest(model_path=decoder, cluster=cluster, dims=DIMS, training=fused)
    steps = _step_graphs(request, recompute_ladder(fused), None, {})[1]
    for training, graph in steps.items():
        cost = auto_plan(graph, cluster, overlap=training.overlap).cost
        floor = compute_floor(graph, cluster)
        assert floor <= cost.compute_time_s <= cost.step_time_s
        split = recipe_layout(graph, {}, cluster.mesh, Recipe.DP).annotations
        least = auto_plan(graph, cluster, split).cost.compute_time_s
        assert floor <= least

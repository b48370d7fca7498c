"""The memory rows relaxed (`solver.relaxation`): for any multipliers the subproblem's minimum is
a lower bound on every plan that fits, its plan is checked exactly, and the memory-bound solve
built on it is still the brute-force optimum."""

import dataclasses
import itertools

import numpy as np
import pytest

from autoshard.annotations import Annotation
from autoshard.cost.cluster import make_cluster
from autoshard.ir.onnx_import import import_onnx
from autoshard.search.budget import auto_plan
from autoshard.search.memory.rows import Chosen, Indicator, MemoryRow, MemoryRows
from autoshard.search.problem import Problem, build_search
from autoshard.search.solver import relaxation as lagrange
from autoshard.search.solver import tuning
from autoshard.search.solver.dual import Dual, dual, least_peak
from autoshard.search.solver.lowest import lowest_budget
from autoshard.search.solver.marginals import (
    _widened,
    fitting_choices,
    peak_marginals,
    rows_alone,
    still_possible,
    strengthened,
    tightened,
)
from autoshard.search.solver.outcome import InfeasibleError
from autoshard.search.solver.relaxation import Relaxation, peak_relaxation
from autoshard.search.solver.solve import solve
from autoshard.sharding import Sharding
from tests.search.test_ilp import MODELS, brute_force, random_problem
from tests.search.test_plan import write_mlp


def plans(problem):
    return itertools.product(*(range(n) for n in problem.sizes))


def relaxed_minimum(problem, multipliers):
    """min_x cost(x) + sum_r lam_r (bytes_r(x) - budget), by enumeration."""
    return min(
        problem.objective(x) + float(multipliers @ (problem.live(x) - problem.budget))
        for x in plans(problem)
    )


@pytest.mark.parametrize("seed", range(20))
def test_the_subproblem_is_exact_where_its_tables_are(seed):
    """Small indicators are tables of their own: the subproblem's minimum is the relaxed
    function's minimum, and the plan it returns reaches it."""
    problem = random_problem(seed, memory=True)
    rng = np.random.default_rng(seed)
    relaxation = Relaxation(problem)
    multipliers = rng.random(relaxation.rows) * 3
    relaxed = relaxation.solve(multipliers)
    assert relaxed.value == pytest.approx(relaxed_minimum(problem, multipliers))
    assert relaxed.peak == problem.peak(relaxed.choice)
    assert relaxed.objective == problem.objective(relaxed.choice)


@pytest.mark.parametrize("bits", [40, 1])
@pytest.mark.parametrize("seed", range(20))
def test_wide_indicators_summed_in_hubs_are_exact(seed, bits, monkeypatch):
    """With every indicator over more than one combination too wide for a table of its own,
    those the rows count are summed per scope in hubs: the subproblem is exact again (its
    minimum the relaxed function's), and each hub's table is its indicators' weighted sum;
    also where the class codes are numbered again after every indicator (`_BITS` 1)."""
    monkeypatch.setattr(tuning, "BITS", bits)
    problem = random_problem(seed, memory=True)
    rng = np.random.default_rng(seed)
    relaxation = Relaxation(problem, exact_up_to=1, hubs=None)
    multipliers = rng.random(relaxation.rows) * 3
    relaxed = relaxation.solve(multipliers)
    assert relaxed.value == pytest.approx(relaxed_minimum(problem, multipliers))
    for hub in relaxation.hubs:
        weights = rng.random(len(hub.indicators))
        tables = [
            np.broadcast_to(relaxation.table(i, hub.scope), hub.shape) for i in hub.indicators
        ]
        assert np.allclose(
            hub.table(weights), sum(w * t for w, t in zip(weights, tables, strict=True))
        )


def test_hubs_are_made_where_indicators_are_wide():
    """The random problem of seed 0 has indicators the rows count over several groups'
    choices: hubs."""
    problem = random_problem(0, memory=True)
    relaxation = Relaxation(problem, exact_up_to=1, hubs=None)
    relaxation.solve(np.ones(relaxation.rows))
    assert relaxation.hubs
    assert Relaxation(problem, exact_up_to=1).hubs == []  # none unless asked for


@pytest.mark.parametrize("seed", range(20))
def test_strengthened_bounds_the_optimum_and_keeps_the_best_plan(seed, monkeypatch):
    """With every wide indicator bounded (a weak relaxation), `strengthened` takes the hubs
    where 3 steps raise the bound by 5 %: its bound is still at most the optimum and at least
    the weak one's, and its best plan fits and is no worse than the weak one's."""
    monkeypatch.setattr(tuning, "DENSE", 1)
    problem = random_problem(seed, memory=True)
    weak = Relaxation(problem)
    found = dual(problem, relaxation=weak)
    relaxation, stronger = strengthened(problem, weak, found)
    assert stronger.bound >= found.bound - 1e-6
    optimum = brute_force(problem)
    if optimum is not None:
        assert stronger.bound <= optimum + 1e-6
    if stronger.best is not None:
        assert problem.peak(stronger.best.choice) <= problem.budget
        if found.best is not None:
            assert stronger.best.objective <= found.best.objective
    assert (relaxation is weak) == (stronger is found)


@pytest.mark.parametrize("seed", range(20))
def test_wide_indicators_are_bounded_from_below(seed, monkeypatch):
    """With every indicator too wide for one table, each is bounded from below by its parts:
    the subproblem's value never exceeds the relaxed function's minimum."""
    monkeypatch.setattr(tuning, "DENSE", 1)
    problem = random_problem(seed, memory=True)
    rng = np.random.default_rng(seed)
    relaxation = Relaxation(problem)
    multipliers = rng.random(relaxation.rows) * 3
    relaxed = relaxation.solve(multipliers)
    assert relaxed.value <= relaxed_minimum(problem, multipliers) + 1e-6
    assert relaxed.peak == problem.peak(relaxed.choice)


@pytest.mark.parametrize("seed", range(20))
def test_each_option_bounds_its_indicator(seed, monkeypatch):
    """With every indicator too wide for one table, each of its options from below is at most
    it at every plan, each from above at least it: any mix of them is a bound."""
    monkeypatch.setattr(tuning, "DENSE", 1)
    problem = random_problem(seed, memory=True)
    bound = Relaxation(problem).bound(None)
    everywhere = list(plans(problem))
    truth = np.array([problem.indicator_table.values(x) for x in everywhere], np.float64)
    wide = 0
    for i in range(len(problem.indicators)):
        for upper in (False, True):
            options = bound.options(i, upper)
            wide += len(options.alternatives) > 1
            assert options.start.sum() == pytest.approx(1.0)
            values = np.array([options.values(x) for x in everywhere])
            if upper:
                assert (values >= truth[:, [i]] - 1e-9).all()
            else:
                assert (values <= truth[:, [i]] + 1e-9).all()
    assert wide


@pytest.mark.parametrize("seed", range(20))
def test_any_mix_of_the_options_bounds_the_subproblem(seed, monkeypatch):
    """The options of every wide indicator mixed at random: the subproblem's value never
    exceeds the relaxed function's minimum."""
    monkeypatch.setattr(tuning, "DENSE", 1)
    problem = random_problem(seed, memory=True)
    rng = np.random.default_rng(seed)
    relaxation = Relaxation(problem)
    multipliers = rng.random(relaxation.rows) * 3
    _, _, bounded = relaxation.subproblem(multipliers)
    assert any(len(options.start) > 1 for _, _, options in bounded)
    shares = {i: (options, rng.dirichlet(np.ones(len(options.start)))) for i, _, options in bounded}
    relaxed = relaxation.solve(multipliers, shares)
    assert relaxed.value <= relaxed_minimum(problem, multipliers) + 1e-6


def test_the_mix_of_an_ors_options_moves_the_bound_to_its_best():
    """OR(g0 in {0}, g1 in {0}) holds 8 bytes, budget 5, g0 = 1 costs 10 and g1 = 1 costs 4:
    only (1, 1) fits (cost 14). Exact, L(lam) = min(3 lam, 14 - 5 lam) peaks at 5.25. Too
    wide for a table (DENSE 1), the OR is at least each literal, and at least 0; mixed evenly
    it holds 4 bytes at (0, 1), L = min(3 lam, 4 - lam, 14 - 5 lam) peaks at 3 (lam = 1).
    Mixed (3/4, 1/4): min(3 lam, 4 + lam, 10 - 3 lam, 14 - 5 lam) peaks at 5 (lam = 5/3);
    mixed (5/7, 2/7), at lam = 7/4 all four plans are at 5.25 (3 lam; 4 + 5/7 lam; 10 - 19/7
    lam; 14 - 5 lam), the exact bound. The steps move the mix there."""
    either = Indicator(False, (Chosen(0, frozenset({0})), Chosen(1, frozenset({0}))))
    rows = MemoryRows.of((MemoryRow(0, (), ((0, 8),)),))
    problem = Problem((2, 2), ((0, 10), (0, 4)), (), rows, 5, 1.0, (either,))
    assert dual(problem, iterations=200, relaxation=Relaxation(problem)).bound == pytest.approx(
        5.25, abs=1e-3
    )
    weak = Relaxation(problem, exact_up_to=1)
    assert weak.solve(np.array([1.0])).value == pytest.approx(3.0)
    options = weak.bound(None).options(0)
    assert options.start.tolist() == [0.5, 0.5, 0.0]
    mixed = {0: (options, np.array([0.75, 0.25, 0.0]))}
    assert weak.solve(np.array([5 / 3]), mixed).value == pytest.approx(5.0)
    best = {0: (options, np.array([5 / 7, 2 / 7, 0.0]))}
    assert weak.solve(np.array([7 / 4]), best).value == pytest.approx(5.25)
    stepped = dual(problem, iterations=200, relaxation=weak)
    assert 5.2 < stepped.bound <= 5.25 + 1e-6
    assert stepped.best.choice == (1, 1)


@pytest.mark.parametrize("seed", range(30))
def test_the_dual_bound_is_below_the_optimum_and_its_plans_fit(seed):
    problem = random_problem(seed, memory=True)
    expected = brute_force(problem)
    found = dual(problem, iterations=40)
    if expected is None:
        assert found.best is None
        return
    assert found.bound <= expected + 1e-6
    if found.best is not None:
        assert found.best.peak == problem.peak(found.best.choice) <= problem.budget
        assert found.best.objective >= expected


def test_a_duality_gap_by_hand():
    """The docstring's example: one group, cost (0, 10), bytes (8, 2), budget 5. L(lam) =
    min(3 lam, 10 - 3 lam) peaks at 5 (lam = 5/3); the only plan that fits costs 10."""
    rows = MemoryRows.of((MemoryRow(0, ((0, 0, 8), (0, 1, 2)), ()),))
    problem = Problem((2,), ((0, 10),), (), rows, 5, 1.0)
    found = dual(problem, iterations=200)
    assert found.bound == pytest.approx(5.0, abs=1e-3)
    assert (found.best.choice, found.best.objective) == ((1,), 10)
    assert solve(problem).objective == 10


def test_while_nothing_fits_the_steps_aim_ever_higher():
    """Cost (1000, 2000), bytes (8, 2), budget 5: L(lam) = min(1000 + 3 lam, 2000 - 3 lam).
    The minimum at lam = 0 does not fit, so the first steps aim 10 %, then 20 % above the
    bound (`REACH` doubled after each rise): 1000, 1100, 1320; steps of 5 % would give
    1000, 1050, 1102.5."""
    rows = MemoryRows.of((MemoryRow(0, ((0, 0, 8), (0, 1, 2)), ()),))
    problem = Problem((2,), ((1000, 2000),), (), rows, 5, 1.0)
    bounds = [dual(problem, iterations=n).bound for n in (1, 2, 3)]
    assert bounds == pytest.approx([1000, 1100, 1320])
    assert dual(problem, iterations=200).bound == pytest.approx(1500, abs=0.1)


def test_the_steps_go_on_while_the_bound_still_rises(monkeypatch):
    """The duality gap's example: bounds 0, 1, 2, 3, 4.6 (x6), 5 from the first step on. Given
    3 steps more at a time while the last 3 raised the bound: after 4 steps (3 over 0) 3 more,
    after 7 (4.6 over 3) 3 more, after 10 (4.6 over 4.6) none; `longer` caps them."""
    monkeypatch.setattr(tuning, "RISE_STEPS", 3)
    rows = MemoryRows.of((MemoryRow(0, ((0, 0, 8), (0, 1, 2)), ()),))
    problem = Problem((2,), ((0, 10),), (), rows, 5, 1.0)
    assert dual(problem, iterations=4).bound == pytest.approx(3.0)
    longer = dual(problem, iterations=4, longer=40)
    assert (longer.iterations, longer.bound) == (10, pytest.approx(4.6))
    assert dual(problem, iterations=4, longer=3).iterations == 7


def test_nothing_fits_and_the_bound_proves_it():
    """Every plan holds 8 bytes in a row of budget 5: the bound grows past what any plan costs."""
    rows = MemoryRows.of((MemoryRow(8, (), ()),))
    problem = Problem((2,), ((0, 10),), (), rows, 5, 1.0)
    assert dual(problem).infeasible
    with pytest.raises(InfeasibleError):
        solve(problem)


def test_nested_indicators_of_four_groups():
    """AND(g0 in {1}, OR(g1 in {1}, g2 in {1}, g3 in {1})): one table of 2 * 2^3 combinations,
    or (DENSE below that) the mean of AND(g0 in {1}, gj in {1}) over j: a bound, and never
    below 0 (g0 + OR - 1, the bound of an AND's parts, is -1 where g0 = 0)."""
    inner = Indicator(False, (Chosen(1, frozenset({1})), Chosen(2, frozenset({1})),
                              Chosen(3, frozenset({1}))))  # fmt: skip
    outer = Indicator(True, (Chosen(0, frozenset({1})), 0))
    rows = MemoryRows.of((MemoryRow(0, (), ((1, 6),)),))
    problem = Problem((2,) * 4, ((5, 0), (5, 0), (0, 0), (0, 0)), (), rows, 3, 1.0,
                      (inner, outer))  # fmt: skip
    relaxation = Relaxation(problem)
    exact = relaxation.solve(np.array([1.0]))
    assert exact.value == pytest.approx(relaxed_minimum(problem, np.array([1.0])))
    assert exact.value == pytest.approx(2.0)  # g0 = 0 or g1 = 0: cost 5, nothing held, 5 - 3
    narrow = dataclasses.replace(problem)
    lagrange_dense = tuning.DENSE
    try:
        tuning.DENSE = 4
        bounded = Relaxation(narrow).solve(np.array([1.0]))
    finally:
        tuning.DENSE = lagrange_dense
    # g0 = g1 = 1 (cost 0): 6 * (1 + 0 + 0) / 3 = 2 held, value 0 + 2 - 3; g0 = 0: 5 - 3 (g0 +
    # OR - 1 would give 5 + 6 * (0 + 1/3 - 1) - 3 = -2 with g1 = 1): the bound is -1.
    assert bounded.value == pytest.approx(-1.0)
    assert bounded.choice[:2] == (1, 1)


def test_an_and_distributes_over_its_ors_again_and_again(monkeypatch):
    """AND(g0, OR(g1, AND(g4, OR(g2, g3)))) (each "g in {1}") over 2^5 combinations, DENSE 8:
    the mean of AND(g0, g1) and of AND(g0, g4, OR(g2, g3)), the latter the mean of AND(g0, g4,
    g2) and AND(g0, g4, g3): 1/2 [g0 g1] + 1/4 [g0 g4 g2] + 1/4 [g0 g4 g3], at most the AND
    everywhere and never below 0."""
    one = [Chosen(g, frozenset({1})) for g in range(5)]
    indicators = (
        Indicator(False, (one[2], one[3])),  # 0
        Indicator(True, (one[4], 0)),  # 1
        Indicator(False, (one[1], 1)),  # 2
        Indicator(True, (one[0], 2)),  # 3
    )
    rows = MemoryRows.of((MemoryRow(0, (), ((3, 1),)),))
    problem = Problem((2,) * 5, ((0, 0),) * 5, (), rows, 1, 1.0, indicators)
    monkeypatch.setattr(tuning, "DENSE", 8)
    pieces, constant = Relaxation(problem).bound(None).of(3)
    assert constant == 0.0
    assert sorted(scope for scope, _ in pieces) == [(0, 1), (0, 2, 4), (0, 3, 4)]
    for x in itertools.product((0, 1), repeat=5):
        value = sum(float(table[tuple(x[g] for g in scope)]) for scope, table in pieces)
        truth = x[0] and (x[1] or (x[4] and (x[2] or x[3])))
        expected = 0.5 * x[0] * x[1] + 0.25 * x[0] * x[4] * (x[2] + x[3])
        assert value == pytest.approx(expected)
        assert 0 <= value <= truth


def test_an_or_its_and_implies_is_no_condition(monkeypatch):
    """AND(g0 in {1}, g1 in {1}, OR(g1 in {1, 2}, g2 in {1})): g1 in {1} makes the OR hold, so
    the AND is AND(g0 in {1}, g1 in {1}), one exact table even where the three groups are too
    many for one (DENSE 9, groups of 3 choices): exact everywhere, not a bound."""
    indicators = (
        Indicator(False, (Chosen(1, frozenset({1, 2})), Chosen(2, frozenset({1})))),
        Indicator(True, (Chosen(0, frozenset({1})), Chosen(1, frozenset({1})), 0)),
    )
    rows = MemoryRows.of((MemoryRow(0, (), ((1, 1),)),))
    problem = Problem((3,) * 3, ((0, 0, 0),) * 3, (), rows, 1, 1.0, indicators)
    monkeypatch.setattr(tuning, "DENSE", 9)
    pieces, constant = Relaxation(problem).bound(None).of(1)
    assert constant == 0.0 and [scope for scope, _ in pieces] == [(0, 1)]
    for x in itertools.product(range(3), repeat=3):
        value = sum(float(table[tuple(x[g] for g in scope)]) for scope, table in pieces)
        assert value == (x[0] == 1 and x[1] == 1)


@pytest.mark.parametrize("seed", range(30))
def test_the_solve_through_the_relaxation_is_the_optimum(seed):
    """The relaxation's bound and plans, then CP-SAT over the choices a cheaper plan may
    take, give the brute-force optimum, proven."""
    problem = random_problem(seed, memory=True)
    expected = brute_force(problem)
    if expected is None:
        with pytest.raises(InfeasibleError):
            solve(problem)
        return
    solution = solve(problem)
    assert (solution.objective, solution.status) == (expected, "OPTIMAL")
    assert problem.peak(solution.choice) <= problem.budget


@pytest.mark.parametrize("seed", range(30))
def test_the_solve_at_the_least_peak_is_the_optimum(seed):
    """At a budget of exactly the least peak (and a little above it), where rows alone rule
    out choices and the relaxation of those left decides: the brute-force optimum, proven."""
    problem = random_problem(seed, memory=True)
    least = min(problem.peak(x) for x in plans(problem))
    for budget in (least, least + least // 20):
        tight = dataclasses.replace(problem, budget=budget)
        solution = solve(tight)
        assert (solution.objective, solution.status) == (brute_force(tight), "OPTIMAL")
        assert tight.peak(solution.choice) <= budget


def test_the_min_marginals_widened_by_those_of_the_choices_that_fit():
    """Choices 0 and 2 may fit: each takes the greater of the whole problem's (1, 3) and the
    restricted one's (4, 2); choice 1, in no plan that fits, is infinite."""
    widened = _widened([np.array([1.0, 5.0, 3.0])], [np.array([4.0, 2.0])], [[0, 2]])
    np.testing.assert_array_equal(widened[0], [4.0, np.inf, 3.0])
    alone = _widened([np.array([1.0, 5.0, 3.0])], None, [[0, 2]])
    np.testing.assert_array_equal(alone[0], [1.0, np.inf, 3.0])


@pytest.mark.parametrize("seed", range(30))
def test_the_least_peak_through_the_relaxation_is_the_least(seed):
    """The relaxation's bound and plans, then CP-SAT over the choices a plan of a lower peak
    may take, give the least peak, proven."""
    problem = random_problem(seed, memory=True)
    least = min(problem.peak(x) for x in plans(problem))
    found = least_peak(problem, iterations=40)
    assert found.bound <= least + 1e-6
    assert found.best.peak == problem.peak(found.best.choice) >= least
    lowest = lowest_budget(problem)
    assert (lowest.peak, lowest.bound, lowest.status) == (least, least, "OPTIMAL")
    assert problem.peak(lowest.choice) == least


def test_the_fsdp_mlp_is_found_through_the_relaxation(tmp_path):
    """The MLP of `test_plan.test_weights_held_split_further_than_read` under 2 MiB on 2x4 (x
    and y batch-split on axis 0): the relaxation and CP-SAT from it find a plan under 2 MiB
    no dearer than the FSDP hand plan (its objective there), and the least memory any plan
    needs, proven."""
    graph = import_onnx(write_mlp(tmp_path / "mlp.onnx", 256, 256, 1024))
    S = Sharding.parse
    io = [Annotation("x", S("[[0]]")), Annotation("y", S("[[0]]"))]
    planned = auto_plan(graph, make_cluster(mesh="2x4", memory="2MiB"), io)
    assert planned.solution.status == "OPTIMAL"
    assert planned.cost.memory_bytes_per_device <= 2 * 2**20
    free = build_search(graph, make_cluster(mesh="2x4"), io).problem
    assert planned.solution.objective == brute_force(dataclasses.replace(free, budget=2 * 2**20))
    least = lowest_budget(free)
    assert least.status == "OPTIMAL"
    assert least.peak == min(free.peak(x) for x in plans(free))


def test_the_relaxation_is_deterministic():
    """Iteration counts and counted work decide, never the clock: the same problem gives the
    same bound, multipliers and plan."""
    problem = random_problem(4, groups=7, memory=True)
    first, second = dual(problem), dual(problem)
    assert (first.bound, first.iterations) == (second.bound, second.iterations)
    assert first.multipliers.tolist() == second.multipliers.tolist()
    assert (first.best is None) == (second.best is None)
    if first.best is not None:
        assert first.best.choice == second.best.choice


def relaxed_with_fitting(seed):
    """A random problem with memory rows, its relaxation, the dual's multipliers, and every
    plan that fits with its cost, cheapest first."""
    problem = random_problem(seed, memory=True)
    relaxation = Relaxation(problem)
    found = dual(problem, relaxation=relaxation)
    fitting = sorted(
        (problem.objective(choice), choice)
        for choice in plans(problem)
        if problem.peak(choice) <= problem.budget
    )
    return problem, relaxation, found, fitting


@pytest.mark.parametrize("seed", range(30))
def test_the_choices_ruled_out_are_in_no_better_plan(seed):
    """Reduced-cost fixing: at the dual's multipliers, below the cost of a plan that fits (the
    median of those enumerated), every plan that fits and costs less takes only choices
    kept, and that plan's choices are kept; likewise for the least peak's weights and a plan
    of a lower peak."""
    problem, relaxation, found, fitting = relaxed_with_fitting(seed)
    if fitting:
        above, plan = fitting[len(fitting) // 2]
        kept = still_possible(relaxation.min_marginals(found.multipliers), above, plan)
        assert all(k in kept[g] for g, k in enumerate(plan))
        for cost, choice in fitting:
            if cost < above:
                assert all(k in kept[g] for g, k in enumerate(choice)), choice
    peaks = peak_relaxation(problem)
    least = least_peak(problem, relaxation=peaks)
    kept = still_possible(peaks.min_marginals(least.multipliers), least.best.peak)
    for choice in plans(problem):
        if problem.peak(choice) < least.best.peak:
            assert all(k in kept[g] for g, k in enumerate(choice)), choice


@pytest.mark.parametrize("seed", range(30))
def test_a_choice_s_least_peak_bounds_every_plan_taking_it(seed):
    """`peak_marginals` (the best weights' and rows alone, the greatest): every plan's peak
    is at least each of its choices' figure; and the choices `marginals.fitting_choices` rules
    out (a row alone over the budget) are in no plan that fits."""
    problem = random_problem(seed, memory=True)
    peaks = peak_relaxation(problem)
    least = least_peak(problem, relaxation=peaks)
    marginals = peak_marginals(peaks, least)
    for choice in plans(problem):
        figures = [marginals[g][k] for g, k in enumerate(choice)]
        assert problem.peak(choice) >= max(figures) - 1e-6, choice
    try:
        fitting = fitting_choices(problem, dual(problem))
    except InfeasibleError:
        assert all(problem.peak(x) > problem.budget for x in plans(problem))
        return
    fitting = fitting or [range(n) for n in problem.sizes]
    for choice in plans(problem):
        if problem.peak(choice) <= problem.budget:
            assert all(k in fitting[g] for g, k in enumerate(choice)), choice


def test_rows_alone_see_what_a_mix_blurs():
    """One group, bytes (10, 0) in row 0 and (0, 10) in row 1: every plan peaks at 10. Any mix
    of the rows, weights (w, 1 - w), bounds it by min(10 w, 10 - 10 w), at most 5; each row
    alone rules out one choice below 10: the greatest per choice is (10, 10), the bound 10.
    Under a budget of 9 neither choice fits: `fitting_choices` proves it."""
    rows = MemoryRows.of(
        (MemoryRow(0, ((0, 0, 10), (0, 1, 0)), ()), MemoryRow(0, ((0, 0, 0), (0, 1, 10)), ()))
    )
    problem = Problem((2,), ((0, 0),), (), rows, 9, 1.0)
    peaks = peak_relaxation(problem)
    least = least_peak(problem, relaxation=peaks)
    assert least.bound <= 5 + 1e-9
    np.testing.assert_allclose(rows_alone(peaks, np.array([0, 1]))[0], [10, 10])
    np.testing.assert_allclose(peak_marginals(peaks, least)[0], [10, 10])
    lowest = lowest_budget(problem)
    assert (lowest.peak, lowest.bound) == (10, 10)
    found = Dual(5.0, None, np.array([1.0, 1.0]), 1)
    with pytest.raises(InfeasibleError, match="the relaxation proves it"):
        fitting_choices(problem, found)


def test_choices_are_ruled_out_by_hand():
    """One group of three choices: costs (0, 4, 9), bytes (8, 3, 2) in the one row, budget 5.
    At lam = 1: L with k taken = cost + (bytes - 5) = (3, 2, 6). The best plan that fits
    costs 4 (k = 1): k = 2 (6 >= 4) is ruled out; k = 0 (3 < 4) may be in a cheaper plan as
    far as the bound knows (it is not: it does not fit), so it is kept."""
    rows = MemoryRows.of((MemoryRow(0, ((0, 0, 8), (0, 1, 3), (0, 2, 2)), ()),))
    problem = Problem((3,), ((0, 4, 9),), (), rows, 5, 1.0)
    marginals = Relaxation(problem).min_marginals(np.array([1.0]))
    np.testing.assert_allclose(marginals[0], [3, 2, 6])
    assert still_possible(marginals, 4) == [[0, 1]]
    assert still_possible(marginals, 3) == [[1]]  # below 3: only k = 1 (2) may be
    assert still_possible(marginals, 3, (2,)) == [[1, 2]]  # and a plan's choice, kept


@pytest.mark.parametrize("seed", range(30))
def test_a_problem_restricted_to_some_choices_prices_them_as_the_whole(seed):
    """Costs, peaks (indicators renumbered, terms of choices left out dropped) and the optimum
    of the restricted problem are those of the whole over the choices kept."""
    problem = random_problem(seed, memory=True)
    rng = np.random.default_rng(seed)
    kept = [sorted({0} | {k for k in range(n) if rng.random() < 0.6}) for n in problem.sizes]
    narrowed = problem.restricted(kept)
    assert narrowed.sizes == tuple(len(k) for k in kept)
    for choice in plans(narrowed):
        whole = tuple(kept[g][k] for g, k in enumerate(choice))
        assert narrowed.objective(choice) == problem.objective(whole)
        assert narrowed.peak(choice) == problem.peak(whole)


@pytest.mark.parametrize("seed", range(20))
def test_the_choices_tightened_out_are_in_no_better_plan(seed):
    """Below the cost of each of the plans that fit, `tightened` keeps every choice of each
    cheaper plan that fits, and the plan's own, and only choices the min-marginals kept."""
    problem, relaxation, found, fitting = relaxed_with_fitting(seed)
    marginals = relaxation.min_marginals(found.multipliers) if fitting else None
    for above, plan in fitting:
        kept = still_possible(marginals, above, plan)
        fewer = tightened(problem, found.multipliers, kept, above, plan)
        assert all(set(f) <= set(k) and f == sorted(f) for f, k in zip(fewer, kept, strict=True))
        for _, choice in [(above, plan), *(f for f in fitting if f[0] < above)]:
            assert all(k in fewer[g] for g, k in enumerate(choice)), (above, choice)


def test_tightened_by_hand():
    """One group, costs (0, 10), bytes (10, 0) in the one row, budget 0: only choice 1 fits.
    At the multiplier 0, choice 0's least is 0, kept below 10; the steps from there reach the
    bound 10 (10 lam for choice 0, 10 for choice 1, from lam = 1) in the eighth: no plan is
    below 10, and the plan kept, choice 1, is all that is left."""
    rows = MemoryRows.of((MemoryRow(0, ((0, 0, 10), (0, 1, 0)), ()),))
    problem = Problem((2,), ((0, 10),), (), rows, 0, 1.0)
    assert tightened(problem, np.zeros(1), [[0, 1]], 10, (1,)) == [[1]]


def test_tightened_leaves_out_more_and_keeps_the_optimum():
    """The MLP on 4x8 at 30 % of its free plan's peak: below the relaxation's best plan's
    cost, and below the optimum's cost plus one, `tightened` leaves out choices the
    min-marginals kept but none of the optimum's; below the optimum itself, all but the best
    plan's: no plan is cheaper."""
    graph = import_onnx(MODELS / "mlp.onnx", {"batch": 8})
    top = auto_plan(graph, make_cluster(mesh="4x8")).cost.memory_bytes_per_device
    problem = build_search(graph, make_cluster(mesh="4x8", memory=str(int(0.3 * top)))).problem
    relaxation = Relaxation(problem)
    found = dual(problem, relaxation=relaxation)
    optimum = solve(problem)
    marginals = relaxation.min_marginals(found.multipliers)
    plan = found.best.choice
    for below in (found.best.objective, optimum.objective + 1):
        kept = still_possible(marginals, below, plan)
        fewer = tightened(problem, found.multipliers, kept, below, plan)
        assert sum(map(len, fewer)) < sum(map(len, kept))
        assert all(k in fewer[g] for g, k in enumerate(optimum.choice))
    kept = still_possible(marginals, optimum.objective, plan)
    fewer = tightened(problem, found.multipliers, kept, optimum.objective, plan)
    assert fewer == [[k] for k in plan]


def test_where_the_bounds_lose_the_peak_rows_bytes_larger_tables_are_exact():
    """A buffer of 1,000 B live where three groups of 64 choices each take choice 0 (262,144
    combinations: past `DENSE`, within `DENSER`), in a row of 100 B more. Bounded, the AND
    is the exact pair's table plus the third's mask, less 1: where none holds, -1,000 B, a
    row of -900 B for the 100 B the plan holds. At that plan the limit rises and the bound is
    the AND itself; where the bound is exact at the plan (all three hold, or the pair holds
    and the third does not), it stays."""
    every_zero = Indicator(True, tuple(Chosen(g, frozenset({0})) for g in range(3)))
    rows = MemoryRows.of((MemoryRow(100, (), ((0, 1000),)),))
    problem = Problem((64,) * 3, ((0,) * 64,) * 3, (), rows, 500, 1.0, (every_zero,))
    assert [lagrange.table_limit(problem, plan) for plan in ((1, 1, 1), (0, 0, 0), (0, 0, 1))] == [
        tuning.DENSER, tuning.DENSE, tuning.DENSE
    ]  # fmt: skip
    for limit, at_none in ((tuning.DENSE, -900.0), (tuning.DENSER, 100.0)):
        factors, constant = peak_relaxation(problem, limit).at(np.ones(1))
        at = (1, 1, 1)
        assert sum(f.table[tuple(at[g] for g in f.scope)] for f in factors) + constant == at_none

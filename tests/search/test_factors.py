"""Exact min-sum elimination (`solver.factors`) against brute force on small factor graphs, and
against CP-SAT on the memory-aside problems of the bundled models."""

import itertools
import random
import time
from pathlib import Path

import numpy as np
import pytest

from autoshard.cost.cluster import make_cluster
from autoshard.ir.onnx_import import import_onnx
from autoshard.search.memory.rows import MemoryRows
from autoshard.search.problem import Problem, build_search
from autoshard.search.solver import eliminate, factors, tuning
from autoshard.search.solver.factors import (
    Factor,
    elimination_order,
    min_marginals,
    minimize,
    problem_factors,
    undominated,
)
from autoshard.search.solver.outcome import SolverStatus
from autoshard.search.solver.solve import solve
from tests.search.test_ilp import brute_force, random_problem

MODELS = Path(__file__).resolve().parents[2] / "models"


def random_factors(seed: int, dtype: type, groups: int = 6) -> tuple[list[int], list[Factor]]:
    """Unary, pairwise and ternary tables over random scopes (cycles and cliques among them);
    the last group is in none (disconnected: it takes choice 0)."""
    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in rng.integers(1, 5, groups)]
    found = []
    for arity in (1, 2, 3):
        for scope in itertools.combinations(range(groups - 1), arity):
            if rng.random() < 0.35:
                shape = [sizes[g] for g in scope]
                table = (
                    rng.integers(-50, 100, shape) if dtype is np.int64 else rng.normal(size=shape)
                )
                found.append(Factor(scope, np.asarray(table, dtype=dtype)))
    return sizes, found


def exhaustive(sizes, found):
    """The least sum over every choice, and the first choice reaching it."""
    best = None
    for choice in itertools.product(*(range(n) for n in sizes)):
        value = sum(f.table[tuple(choice[g] for g in f.scope)].item() for f in found)
        if best is None or value < best[0]:
            best = (value, choice)
    return best


@pytest.mark.parametrize("small", [True, False], ids=["whole", "running"])
@pytest.mark.parametrize("dtype", [np.int64, np.float64], ids=["int64", "float64"])
@pytest.mark.parametrize("seed", range(25))
def test_minimize_equals_brute_force(seed, dtype, small, monkeypatch):
    """Both ways a step is summed: the whole table at once, or a running minimum over the
    eliminated group's choices."""
    if not small:
        monkeypatch.setattr(tuning, "SMALL", 0)
    sizes, found = random_factors(seed, dtype)
    least, _ = exhaustive(sizes, found)
    found_min = minimize(sizes, found)
    assert found_min is not None
    assert found_min.choice[-1] == 0  # in no factor
    at_choice = sum(f.table[tuple(found_min.choice[g] for g in f.scope)].item() for f in found)
    if dtype is np.int64:
        assert type(found_min.value) is int
        assert found_min.value == at_choice == least
    else:
        assert found_min.value == pytest.approx(least, abs=1e-12)
        assert found_min.value == pytest.approx(at_choice, abs=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_a_summation_equals_the_broadcast_sum(seed):
    """Tables over random subsets of up to five axes (some of one entry), summed an axis at a
    time into partial sums: exactly numpy's broadcast sum."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(n) for n in rng.integers(1, 5, rng.integers(1, 6)))
    tables = []
    for _ in range(rng.integers(1, 8)):
        held = tuple(n if rng.random() < 0.5 else 1 for n in shape)
        tables.append(rng.integers(-9, 9, held))
    out = np.empty(shape, np.int64)
    factors._Summation.of(out, tables).into(out, tables)
    assert np.array_equal(out, sum(np.broadcast_to(t, shape) for t in tables))


def test_a_summation_adds_last_the_axis_fewest_tables_span():
    """BERT's training step's shape of step: five axes, pairs and triples over the last four
    and one table over the first. That table alone is added at the whole shape, to the sum
    of the others over the last four; the rest in partial sums below it."""
    shape = (3, 4, 4, 4, 4)
    spans = [frozenset({0})] + [frozenset(p) for p in itertools.combinations(range(1, 5), 2)]
    spans += [frozenset(t) for t in itertools.combinations(range(1, 5), 3)]
    summation = factors._Summation(shape, spans, np.float64)
    whole = [which for held, which in summation.levels if held is None]
    assert whole == [[0]]
    below = [held.shape for held, _ in summation.levels if held is not None]
    assert below[-1] == (1, 4, 4, 4, 4)


def test_a_cycle_of_pairs_with_a_ternary_chord():
    """A 5-cycle of 3-choice groups plus a table over (0, 2, 4): exact, and the answer has the
    sum at its choice."""
    rng = np.random.default_rng(11)
    sizes = [3] * 5
    found = [Factor((a, b) if a < b else (b, a), rng.integers(0, 40, (3, 3)))
             for a, b in [(0, 1), (1, 2), (2, 3), (3, 4), (4, 0)]]  # fmt: skip
    found.append(Factor((0, 2, 4), rng.integers(0, 40, (3, 3, 3))))
    answer = minimize(sizes, found)
    assert answer is not None and answer.value == exhaustive(sizes, found)[0]


@pytest.mark.parametrize("small", [True, False], ids=["whole", "running"])
def test_factors_of_one_scope_are_summed_and_ties_go_to_the_lowest_choice(small, monkeypatch):
    """Two tables over (0, 1) that cancel but for one cell: that cell, whatever the order;
    all-equal tables: every group takes choice 0 (a running step keeps no argmin: its choice
    is found again at the neighbours' choices, the first of the least too)."""
    if not small:
        monkeypatch.setattr(tuning, "SMALL", 0)
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    b = -a
    b[2, 1] -= 5
    answer = minimize([3, 4, 2], [Factor((0, 1), a), Factor((0, 1), b)])
    assert answer is not None and (answer.choice, answer.value) == ((2, 1, 0), -5)
    flat = minimize([3, 4, 2], [Factor((0, 1, 2), np.zeros((3, 4, 2), dtype=np.int64))])
    assert flat is not None and flat.choice == (0, 0, 0)


def test_the_worked_example_orders_by_the_fewest_entries():
    """The docstring's example: the 32-layer decoder's rest on 2x4x8."""
    sizes = (171, 82, 82, 82, 284, 284, 3)
    edges = [(0, 1), (0, 2), (0, 3), (0, 5), (1, 4), (2, 4), (3, 5), (4, 5), (1, 6), (2, 6),
             (3, 6)]  # fmt: skip
    order, largest = elimination_order(sizes, [(g,) for g in range(7)] + edges)
    assert order == ((1, (0, 4, 6)), (2, (0, 4, 6)), (3, (0, 5, 6)), (4, (0, 5, 6)),
                     (5, (0, 6)), (0, (6,)), (6, ()))  # fmt: skip
    assert largest == 171 * 284 * 3


def test_the_least_fill_orders_where_the_fewest_entries_would_join_large_groups():
    """Group 1 (30 choices) between three groups of 3 (0, 2, 4), and 4 next to 3 (10). By the
    fewest entries: 3 (its minimum over 4: 3 entries, 10 * 3 additions), then 1, whose
    neighbours make 27 entries (30 * 27 = 810), then 0 (3 * 9), 2 (3 * 3), 4 (3): 879. By the
    least fill: 3 (30), then 0 and 2 (each 3 * 30, joining nothing new), 1 (30 * 3), 4 (3):
    303, the order taken."""
    sizes = (3, 30, 3, 10, 3)
    edges = [(0, 1), (1, 2), (1, 4), (3, 4)]
    order, largest = elimination_order(sizes, [(g,) for g in range(5)] + edges)
    assert order == ((3, (4,)), (0, (1,)), (2, (1,)), (1, (4,)), (4, ()))
    assert largest == 30
    rng = np.random.default_rng(2)
    factors = [Factor(edge, rng.integers(0, 99, (sizes[edge[0]], sizes[edge[1]])))
               for edge in edges]  # fmt: skip
    answer = minimize(sizes, factors)
    assert answer is not None and answer.value == exhaustive(sizes, factors)[0]


def test_none_above_the_cap_before_any_table_is_built():
    """A clique of 4 groups of 10 choices needs a table of 10^3 entries; a clique of 12 groups
    of 60 one of 60^11: refused at once (building it would take years)."""
    rng = np.random.default_rng(0)
    clique = [Factor(pair, rng.integers(0, 9, (10, 10))) for pair in
              itertools.combinations(range(4), 2)]  # fmt: skip
    assert minimize([10] * 4, clique, max_entries=999) is None
    answer = minimize([10] * 4, clique, max_entries=1000)
    assert answer is not None and answer.value == exhaustive([10] * 4, clique)[0]
    huge = [Factor(pair, np.zeros((60, 60), dtype=np.int64)) for pair in
            itertools.combinations(range(12), 2)]  # fmt: skip
    started = time.perf_counter()
    assert minimize([60] * 12, huge) is None
    assert time.perf_counter() - started < 0.5


@pytest.mark.parametrize(
    "bad, message",
    [
        (Factor((0, 1), np.zeros((2, 2), dtype=np.int64)), None),
        (Factor((0, 1), np.zeros((2, 3), dtype=np.int64)), r"shape \(2, 3\)"),
        (Factor((0, 5), np.zeros((2, 2), dtype=np.int64)), r"3 groups"),
    ],
    ids=["fits", "wrong-shape", "unknown-group"],
)
def test_a_table_must_fit_its_groups(bad, message):
    if message is None:
        assert minimize([2, 2, 2], [bad]) is not None
    else:
        with pytest.raises(ValueError, match=message):
            minimize([2, 2, 2], [bad])


def test_a_factor_is_checked_when_made():
    with pytest.raises(ValueError, match=r"scope \(1, 0\) is not strictly ascending"):
        Factor((1, 0), np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="int32, not int64 or float64"):
        Factor((0,), np.zeros(2, dtype=np.int32))
    with pytest.raises(ValueError, match="2 axes, not 1"):
        Factor((0,), np.zeros((2, 2), dtype=np.int64))


@pytest.mark.parametrize("seed", range(20))
def test_problem_factors_are_the_ilp_objective(seed):
    """On the ILP's random problems (memory aside): the factors' sum is the objective at any
    choice, and their minimum the exhaustive optimum."""
    problem = random_problem(seed)
    found = problem_factors(problem)
    choice = tuple(n - 1 for n in problem.sizes)
    assert sum(f.table[tuple(choice[g] for g in f.scope)].item() for f in found) == (
        problem.objective(choice)
    )
    answer = minimize(problem.sizes, found)
    assert answer is not None
    assert answer.value == problem.objective(answer.choice) == brute_force(problem)


# The decoder's seq=2048 rest on 2x4x8 is 7 groups of up to 284 choices in cycles, too slow
# for CP-SAT to prove here: its objective, proven OPTIMAL by CP-SAT after elimination (as
# `solve` did before exact elimination), is pinned.
DECODER_2X4X8_CP_SAT = 5505530


@pytest.mark.parametrize(
    "model, mesh, dims, proven",
    [
        ("mlp.onnx", "2x4", {"batch": 8}, None),
        ("gpt2.onnx", "2x4", {"batch": 8, "seq": 128}, None),
        ("decoder_32l_shape_only.onnx", "4x8", {"batch": 8, "seq": 2048}, None),
        ("decoder_32l_shape_only.onnx", "2x4x8", {"batch": 8, "seq": 2048}, DECODER_2X4X8_CP_SAT),
    ],
    ids=["mlp-2x4", "gpt2-2x4", "decoder-4x8", "decoder-2x4x8"],
)
def test_the_memory_aside_optimum_is_cp_sats(model, mesh, dims, proven, monkeypatch):
    """The bundled models, memory no object: the exact elimination's optimum (proven at once)
    is the objective CP-SAT proves optimal on the same problem (after eliminating the groups
    of degree <= 2, which keeps CP-SAT's proof short)."""
    graph = import_onnx(MODELS / model, dims)
    problem = build_search(graph, make_cluster(mesh=mesh)).problem
    exact = solve(problem)
    assert exact.status is SolverStatus.OPTIMAL and exact.bound == exact.objective
    assert exact.variables == 0  # no CP-SAT model was built
    answer = minimize(problem.sizes, problem_factors(problem))
    assert answer is not None and (answer.choice, answer.value) == (exact.choice, exact.objective)
    if proven is None:
        monkeypatch.setattr(eliminate, "minimize", lambda *_, **__: None)  # CP-SAT's way
        by_cp_sat = solve(problem)
        assert by_cp_sat.status is SolverStatus.OPTIMAL
        proven = by_cp_sat.objective
    assert exact.objective == proven


@pytest.mark.parametrize("block", [1, 2**20], ids=["a-choice-a-block", "whole"])
@pytest.mark.parametrize("dtype", [np.int64, np.float64], ids=["int64", "float64"])
@pytest.mark.parametrize("seed", range(25))
def test_min_marginals_equal_brute_force(seed, dtype, block, monkeypatch):
    """Each group's least sum per choice, against every choice enumerated: cycles, cliques,
    a disconnected group, and components of their own (each marginal adds the others'
    minima); the pass down a choice at a time or all at once."""
    monkeypatch.setattr(tuning, "BLOCK", block)
    sizes, found = random_factors(seed, dtype, groups=7)
    found = [f for f in found if 5 not in f.scope or f.scope == (5,)]  # 5: a component
    expected = [np.full(n, np.inf) for n in sizes]
    for choice in itertools.product(*(range(n) for n in sizes)):
        value = sum(f.table[tuple(choice[g] for g in f.scope)].item() for f in found)
        for g, k in enumerate(choice):
            expected[g][k] = min(expected[g][k], value)
    marginals = min_marginals(sizes, found)
    assert marginals is not None
    for got, want in zip(marginals, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)


def test_min_marginals_by_hand():
    """Two groups of two choices: a (0, 5), b (0, 1), and a-b costs 10 where both take 0.
    With a = 0 the least is b = 1: 0 + 1 = 1; a = 1: 5 + 0 = 5. With b = 0: a = 1, 5;
    b = 1: a = 0, 1."""
    found = [
        Factor((0,), np.array([0, 5])),
        Factor((1,), np.array([0, 1])),
        Factor((0, 1), np.array([[10, 0], [0, 0]])),
    ]
    a, b = min_marginals([2, 2], found)
    assert a.tolist() == [1, 5] and b.tolist() == [5, 1]


def test_a_group_of_a_hundred_one_choice_neighbours():
    """A hub of three choices and 100 groups of one choice each joined to it (what a hand
    plan's annotations leave): the groups of one choice are no axes of any table (numpy has
    at most 64), and their tables' values still count. Hub choice k costs k, and each leaf
    1 unless the hub takes 1: k = 0 sums 0 + 100, k = 1 sums 1 + 0, k = 2 sums 2 + 100."""
    sizes = [3] + [1] * 100
    found = [Factor((0,), np.array([0, 1, 2]))]
    found += [Factor((0, leaf), np.array([[1], [0], [1]])) for leaf in range(1, 101)]
    assert minimize(sizes, found) == factors.Minimum((1,) + (0,) * 100, 1)
    marginals = min_marginals(sizes, found)
    assert marginals is not None
    assert marginals[0].tolist() == [100, 1, 102] and marginals[7].tolist() == [1]


@pytest.mark.parametrize("seed", range(30))
def test_choices_no_dead_end_keep_an_optimum(seed):
    """Dead-end elimination against exhaustive search: the choices kept hold a plan of the
    least cost, memory aside."""
    problem = random_problem(seed)
    kept = undominated(problem)
    assert all(kept)
    assert brute_force(problem.restricted(kept)) == brute_force(problem)


def test_a_dead_end_by_hand():
    """Group 0's choices cost 8, 3, 3, 0, and the edge to group 1 (choices costing 0, 1)
    adds rows [0, 0], [0, 4], [0, 4], [9, 0]. Choice 0 against 1: 8 - 3 + min(0, -4) = 1 > 0,
    a dead end. Choice 2 equals 1 (0 both ways): the lower, 1, stays. Choice 1 against 3:
    3 + min(-9, 4) < 0, and 3 against 1: -3 + min(9, -4) < 0: both stay. Group 1: 1 against
    0 is 1 + min(0, 4, 4, -9) < 0, 0 against 1 is -1 + min(0, -4, -4, 9) < 0: both stay."""
    edge = ((0, 0), (0, 4), (0, 4), (9, 0))
    problem = Problem((4, 2), ((8, 3, 3, 0), (0, 1)), ((0, 1, edge),), MemoryRows.of(()), 0, 1.0)
    assert undominated(problem) == [[1, 3], [0, 1]]


def test_min_marginals_answer_none_when_minimize_does():
    sizes = [64] * 5
    clique = [Factor(scope, np.zeros((64, 64))) for scope in itertools.combinations(range(5), 2)]
    assert min_marginals(sizes, clique, max_entries=64**3) is None


@pytest.mark.parametrize("seed", range(40))
def test_a_capped_order_is_the_whole_order_where_it_fits_and_past_the_cap_where_not(
    seed: int,
) -> None:
    rng = random.Random(seed)
    groups = rng.randint(4, 14)
    sizes = [rng.randint(1, 5) for _ in range(groups)]
    scopes = [
        tuple(sorted(rng.sample(range(groups), rng.randint(1, 3)))) for _ in range(groups * 2)
    ]
    whole, largest = elimination_order(sizes, scopes)
    for cap in (1, 4, 16, 64, 256, largest, largest - 1):
        capped, most = elimination_order(sizes, scopes, cap)
        if largest <= cap:
            assert (capped, most) == (whole, largest)
        else:
            assert most > cap

"""Indicators nested once per layer, thousands deep (a 126-layer model's chains): the relaxation,
its bounds and the memory-bound solve walk them without recursion as deep as the nesting, so
none of them meets the interpreter's recursion limit (left as it is), and their answers are
still the brute-force ones."""

import dataclasses
import itertools

import numpy as np
import pytest

from autoshard.search.memory.rows import NO_ROWS, Chosen, Indicator, MemoryRow, MemoryRows
from autoshard.search.problem import Problem
from autoshard.search.solver import eliminate
from autoshard.search.solver.bounds import Call, unnested
from autoshard.search.solver.outcome import Limit
from autoshard.search.solver.relaxation import Relaxation
from autoshard.search.solver.solve import solve
from tests.search.test_ilp import brute_force
from tests.search.test_lagrange import relaxed_minimum

SIZES = (2, 3, 2, 3)
DEEP = 2000  # far past the recursion limit's 1000 frames
BOUNDED = 600  # each bounded level takes several frames; their pieces grow with the depth


def chain(depth: int, alternate: bool = True) -> Problem:
    """Indicator k is the AND (odd k, or every k unless `alternate`) or OR of a condition on
    group k mod 4 and indicator k - 1, over the same four groups: one scope, nested `depth`
    deep; two rows count the deepest ones, adding bytes and taking some off."""
    indicators = [Indicator(True, (Chosen(0, frozenset({0})), Chosen(1, frozenset({1}))))]
    for k in range(1, depth):
        g = k % len(SIZES)
        every = k % 2 == 1 or not alternate
        indicators.append(Indicator(every, (Chosen(g, frozenset({k % SIZES[g]})), k - 1)))
    terms = tuple((g, k, 10 + 7 * g + 3 * k) for g in range(len(SIZES)) for k in range(SIZES[g]))
    counted = ((depth - 1, 40), (depth - 2, -15), (depth // 2, 25))
    rows = (MemoryRow(5, terms, counted), MemoryRow(9, terms[::2], counted[:2]))
    node = ((3, 9), (7, 1, 4), (0, 6), (5, 2, 8))
    edges = ((0, 1, ((0, 5, 9), (4, 0, 2))), (2, 3, ((1, 8, 0), (6, 0, 3))))
    return Problem(SIZES, node, edges, MemoryRows.of(rows), 1 << 40, 1.0, tuple(indicators))


def peaks(problem: Problem) -> list[int]:
    return sorted({problem.peak(c) for c in itertools.product(*map(range, problem.sizes))})


@pytest.mark.parametrize(
    ("depth", "options", "exact"),
    [
        (DEEP, {}, True),
        (DEEP, {"exact_up_to": 1, "hubs": None}, True),
        (BOUNDED, {"exact_up_to": 1}, False),
    ],
    ids=["own-tables", "hubs", "bounded"],
)
def test_a_deep_chain_relaxed_is_the_relaxed_minimum_or_below(depth, options, exact):
    """Exact tables (the indicators' own, or summed in hubs): the subproblem's minimum is the
    relaxed function's, by enumeration; bounded from their parts: at most it."""
    problem = chain(depth)
    multipliers = np.array([1.5, 0.5])
    relaxed = Relaxation(problem, **options).solve(multipliers)
    expected = relaxed_minimum(problem, multipliers)
    if exact:
        assert relaxed.value == pytest.approx(expected)
    else:
        assert relaxed.value <= expected + 1e-9
    assert relaxed.peak == problem.peak(relaxed.choice)


@pytest.mark.parametrize("upper", [False, True], ids=["below", "above"])
def test_a_deep_chain_is_bounded_on_its_side_everywhere(upper):
    """The deepest indicator's bounds from its parts, nested as deep as the chain: each at most
    it at every plan (at least it, from above)."""
    problem = chain(BOUNDED)
    relaxation = Relaxation(problem, exact_up_to=1)
    top = len(problem.indicators) - 1
    options = relaxation.bound(None).options(top, upper)
    for choice in itertools.product(*map(range, SIZES)):
        held = problem.indicator_table.values(choice)[top]
        values = options.values(choice)
        assert (values >= held - 1e-9).all() if upper else (values <= held + 1e-9).all()


def test_a_deep_and_of_ands_opens_into_its_conditions():
    """An AND nested in ANDs thousands deep is opened into one list of its conditions, in
    order (`Bound.parts`)."""
    problem = chain(DEEP, alternate=False)
    top = problem.indicators[-1]
    parts = Relaxation(problem, exact_up_to=1).bound(None).parts(top)
    conditions = [lit for ind in problem.indicators[::-1] for lit in ind.literals]
    assert parts == [lit for lit in conditions if isinstance(lit, Chosen)]


def test_a_deep_chain_at_a_binding_budget_solves_to_the_brute_force_optimum():
    """The memory-aside optimum does not fit: the relaxation, its bounds and CP-SAT all walk the
    chain, and the plan is the optimum."""
    problem = chain(DEEP)
    free = brute_force(problem)
    bound = dataclasses.replace(problem, budget=peaks(problem)[1])
    expected = brute_force(bound)
    assert expected is not None and expected > free
    assert solve(bound).objective == expected


def test_unnested_runs_calls_deeper_than_the_recursion_limit():
    def count(n: int) -> Call[int]:
        return 0 if n == 0 else 1 + (yield count(n - 1))

    assert unnested(count(100_000)) == 100_000


def test_dead_ends_narrowed_round_after_round_are_a_loop(monkeypatch):
    """Each narrowing to the choices no dead end may leave dead ends again (a chain of layers,
    one round each): thousands of rounds, none a call nested in the one before. Here the
    exact elimination never fits and each round drops the one group's costliest choice."""
    monkeypatch.setattr(eliminate, "minimize", lambda *_: None)
    monkeypatch.setattr(
        eliminate, "undominated", lambda p: [list(range(max(n - 1, 1))) for n in p.sizes]
    )
    costs = tuple(range(10, 10 + DEEP))
    problem = Problem((DEEP,), (costs,), (), NO_ROWS, 1 << 40, 1.0, ())
    limit = Limit(10.0, 10.0, "memory-aside")
    found = eliminate.memory_aside(problem, limit, None, "s")
    assert (found.choice, found.objective) == ((0,), 10)

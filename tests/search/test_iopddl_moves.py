"""The cheap steps of the IOPDDL search: a pair move (`iopddl.pairs`) takes the brute-forced
best change of two joined groups within the usage limit; a neighbourhood solved by elimination
(`iopddl.relaxed`) answers its brute-forced optimum where it claims a proof, and otherwise
only solutions that fit and improve."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from autoshard.search.iopddl.format import FORBIDDEN, IopddlError, parse_problem
from autoshard.search.iopddl.greedy import Held, local_view
from autoshard.search.iopddl.lns import Neighbourhood, _State
from autoshard.search.iopddl.pairs import best_pair, pair_sweep
from autoshard.search.iopddl.pose import PENALTY, Posed, pose
from autoshard.search.iopddl.relaxed import eliminated
from tests.search.test_iopddl import random_problem
from tests.search.test_iopddl_lns import fitting

# Two nodes of two strategies, an edge that pays 100 unless both take the same: from (0, 0)
# no single move pays off (5 + 100 or more), the pair (1, 1) costs nothing.
LOCKED = {
    "problem": {
        "name": "locked",
        "nodes": {"intervals": [[0, 10], [5, 15]], "costs": [[5, 0], [5, 0]],
                  "usages": [[10, 10], [10, 10]]},
        "edges": {"nodes": [[0, 1]], "costs": [[0, 100, 100, 0]]},
        "usage_limit": 20,
    }
}  # fmt: skip


def _posed(data: dict) -> Posed:
    try:
        return pose(parse_problem(data))
    except IopddlError as error:  # (a random problem whose forbidden costs leave no strategy)
        pytest.skip(str(error))


def _swept(posed: Posed, start: tuple[int, ...]) -> tuple[int, ...]:
    choice = np.array(start, np.int64)
    live = posed.usage.profile(start)
    pair_sweep(Held.of(posed.usage), local_view(posed), choice, live, posed.usage.limit)
    assert np.array_equal(live, posed.usage.profile(choice.tolist()))
    return tuple(choice.tolist())


@pytest.mark.parametrize("usage_of_1", [10, 11], ids=["fits", "over"])
def test_a_pair_move_changes_both_ends_of_an_edge(usage_of_1: int) -> None:
    data = {"problem": dict(LOCKED["problem"])}
    data["problem"]["nodes"] = dict(LOCKED["problem"]["nodes"])
    data["problem"]["nodes"]["usages"] = [[10, usage_of_1], [10, usage_of_1]]
    posed = pose(parse_problem(data))
    assert posed.problem.sizes == (2, 2)
    expected = (1, 1) if usage_of_1 == 10 else (0, 0)  # 11 + 11 at times 5..9 passes 20
    assert _swept(posed, (0, 0)) == expected


@pytest.mark.parametrize("seed", range(12))
def test_the_pair_move_is_the_brute_forced_best_of_two_joined_groups(seed: int) -> None:
    data = random_problem(seed, nodes=7, forbidden=seed % 2 == 1)
    posed = _posed(data)
    solutions = fitting(data, posed)
    if not solutions:
        pytest.skip("no solution fits")
    problem, usage = posed.problem, posed.usage
    local, held = local_view(posed), Held.of(usage)
    rng = random.Random(seed)
    for _ in range(6):
        _, start = rng.choice(solutions)
        choice = np.array(start, np.int64)
        live = usage.profile(start)
        for g, h, matrix in problem.edges:
            now = problem.objective(start)
            best = (now, None)
            for k, m in itertools.product(range(problem.sizes[g]), range(problem.sizes[h])):
                moved = list(start)
                moved[g], moved[h] = k, m
                cost = problem.objective(moved)
                if cost < best[0] and usage.profile(moved).max() <= usage.budget:
                    best = (cost, (k, m))
            pair = best_pair(held, local, choice, live, usage.limit, g, h, np.array(matrix))
            if best[1] is None:
                assert pair is None
            else:
                assert pair is not None
                moved = list(start)
                moved[g], moved[h] = pair
                assert problem.objective(moved) == best[0] < PENALTY


@pytest.mark.parametrize("seed", range(12))
def test_sweeps_keep_the_limit_and_never_cost_more(seed: int) -> None:
    data = random_problem(seed, nodes=8)
    posed = pose(parse_problem(data))
    solutions = fitting(data, posed)
    if not solutions:
        pytest.skip("no solution fits")
    for _, start in sorted(solutions)[-5:]:
        swept = _swept(posed, start)
        assert posed.problem.objective(swept) <= posed.problem.objective(start)
        assert posed.usage.profile(swept).max() <= posed.usage.budget


@pytest.mark.parametrize("seed", range(16))
def test_elimination_answers_a_neighbourhood_as_brute_force(seed: int) -> None:
    data = random_problem(seed, nodes=8, forbidden=seed % 4 == 3)
    posed = _posed(data)
    solutions = fitting(data, posed)
    if not solutions:
        pytest.skip("no solution fits")
    rng = random.Random(seed)
    _, start = max(solutions)
    state = _State.of(posed, start)
    usage = posed.usage
    for _ in range(10):
        count = rng.randint(1, len(state.movable))
        free = np.array(sorted(rng.sample(state.movable.tolist(), count)))
        sub = Neighbourhood.of_groups(state, free)
        answer = eliminated(sub, usage.limit)
        assert answer is not None  # (tiny tables)
        now = sub.problem.objective(sub.hint)
        best = now
        for choice in itertools.product(*map(range, sub.problem.sizes)):
            if sub.live(choice).max() <= usage.budget:
                best = min(best, sub.problem.objective(choice))
        if answer.choice is not None:
            assert sub.live(answer.choice).max() <= usage.budget
            assert sub.problem.objective(answer.choice) < now
            assert not answer.proven or sub.problem.objective(answer.choice) == best
        elif answer.proven:
            assert best == now
        assert best < FORBIDDEN

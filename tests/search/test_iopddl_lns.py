"""The large-neighbourhood search over an IOPDDL solution (`iopddl.lns`): from the worst
solution that fits, neighbourhoods too small to hold the problem at first, it reaches the
brute-forced optimum; each neighbourhood's problem prices a change exactly as the whole
problem does (cost and every time point's usage)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest

from autoshard.search.iopddl.format import FORBIDDEN, parse_problem
from autoshard.search.iopddl.lns import LnsOptions, Neighbourhood, _State, improved
from autoshard.search.iopddl.pose import Posed, pose
from tests.search.test_iopddl import brute_force, evaluate, random_problem

SMALL = LnsOptions(size=6, smallest=4, largest=10_000, grow=1.5)
"""Neighbourhoods of one or two groups at first: the optimum takes several, and growth."""


def fitting(data: dict, posed: Posed) -> list[tuple[int, tuple[int, ...]]]:
    """Every choice per group that fits and takes no forbidden pair, with its cost."""
    found = []
    for choice in itertools.product(*map(range, posed.problem.sizes)):
        cost, fits, _ = evaluate(data, posed.solution(choice))
        if fits and cost < FORBIDDEN:
            found.append((cost, choice))
    return found


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("forbidden", [False, True], ids=["finite", "forbidden"])
@pytest.mark.parametrize("widest", [0, 2], ids=["all", "narrowed"])
def test_from_the_worst_fitting_start_it_reaches_the_optimum(
    seed: int, forbidden: bool, widest: int
) -> None:
    options = dataclasses.replace(SMALL, widest=widest)
    data = random_problem(seed, nodes=8, forbidden=forbidden)
    best, _ = brute_force(data)
    if best is None:
        pytest.skip("no solution fits")
    posed = pose(parse_problem(data))
    solutions = fitting(data, posed)
    if len(posed.problem.sizes) < 3:
        pytest.skip("too few groups for a neighbourhood to matter")
    worst_cost, worst = max(solutions)
    searched = improved(posed, worst, work=60.0, options=options)
    cost, fits, _ = evaluate(data, posed.solution(searched.choice))
    assert fits and cost == searched.objective == best
    assert searched.optimal and searched.tried > 1 and worst_cost > best


def test_the_search_is_deterministic_given_its_seed() -> None:
    data = random_problem(3, nodes=8)
    posed = pose(parse_problem(data))
    _, worst = max(fitting(data, posed))
    options = LnsOptions(size=6, smallest=4, largest=8, seed=7)  # (never the whole problem)
    first = improved(posed, worst, work=0.02, options=options)
    assert first == improved(posed, worst, work=0.02, options=options)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("widest", [0, 2], ids=["all", "narrowed"])
def test_a_neighbourhood_prices_a_change_as_the_whole_problem(seed: int, widest: int) -> None:
    data = random_problem(seed, nodes=8)
    posed = pose(parse_problem(data))
    solutions = fitting(data, posed)
    if not solutions:
        pytest.skip("no solution fits")
    rng = random.Random(seed)
    _, start = rng.choice(solutions)
    state = _State.of(posed, start)
    usage = posed.usage
    for _ in range(20):
        free = np.array(sorted(rng.sample(state.movable.tolist(),
                                          rng.randint(1, len(state.movable)))))  # fmt: skip
        sub = Neighbourhood.of_groups(state, free, widest)
        choice = [rng.randrange(n) for n in sub.problem.sizes]
        whole = list(start)
        for g, kept, k in zip(free.tolist(), sub.kept, choice, strict=True):
            whole[g] = int(kept[k])
        change = posed.problem.objective(whole) - posed.problem.objective(start)
        if evaluate(data, posed.solution(whole))[0] < FORBIDDEN:  # (else priced apart)
            assert sub.problem.objective(choice) - sub.problem.objective(sub.hint) == change
        live = usage.profile(whole)
        assert sub.live(choice).tolist() == live.tolist()
        rows = list(range(len(live)))
        with_rows = sub.with_rows(rows)
        assert with_rows.live(choice).tolist() == live.tolist()


@pytest.mark.parametrize("seed", range(8))
def test_a_narrowed_group_keeps_its_incumbent_and_the_cheapest_given_its_neighbours(
    seed: int,
) -> None:
    data = random_problem(seed, nodes=8)
    posed = pose(parse_problem(data))
    solutions = fitting(data, posed)
    if not solutions:
        pytest.skip("no solution fits")
    _, start = random.Random(seed).choice(solutions)
    state = _State.of(posed, start)
    sub = Neighbourhood.of_groups(state, state.movable, widest=2)
    narrowed = False
    for g, kept in zip(state.movable.tolist(), sub.kept, strict=True):
        # Every neighbour is free here: the costs given their incumbent choices, by hand.
        costs = list(posed.problem.node_costs[g])
        for a, b, matrix in posed.problem.edges:
            for k in range(len(costs)):
                if a == g:
                    costs[k] += matrix[k][start[b]]
                elif b == g:
                    costs[k] += matrix[start[a]][k]
        others = sorted((c, k) for k, c in enumerate(costs) if k != start[g])
        expected = sorted([start[g]] + [k for _, k in others[:1]])
        assert kept.tolist() == (expected if len(costs) > 2 else list(range(len(costs))))
        narrowed |= len(costs) > 2
    assert sub.narrowed() == narrowed
    assert not Neighbourhood.of_groups(state, state.movable).narrowed()

"""`eliminate`'s order is the scan's: after each removal, the first group (by index) of one
choice or of degree <= 2 goes next. The heap over adjacency sets finds it without rescanning
every edge; an order that differed would change which of equal optima a plan takes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from autoshard.search.memory.rows import NO_ROWS
from autoshard.search.problem import Problem
from autoshard.search.solver.eliminate import _expand, eliminate


def scanned(sizes: tuple[int, ...], pairs: list[tuple[int, int]]) -> list[int]:
    """The order of the scan from the first group after each removal (degrees alone: a
    chain link's removal joins its two neighbours)."""
    near = {g: set() for g in range(len(sizes))}
    for a, b in pairs:
        near[a].add(b)
        near[b].add(a)
    order: list[int] = []
    while True:
        g = next((g for g in sorted(near) if sizes[g] == 1 or len(near[g]) <= 2), None)
        if g is None:
            return order
        around = near.pop(g)
        for h in around:
            near[h].discard(g)
        if sizes[g] > 1 and len(around) == 2:
            h1, h2 = around
            near[h1].add(h2)
            near[h2].add(h1)
        order.append(g)


def random_problem(seed: int, groups: int = 9) -> Problem:
    rng = np.random.default_rng(seed)
    sizes = tuple(int(s) for s in rng.integers(1, 4, groups))
    pairs = sorted(
        {(min(a, b), max(a, b)) for a, b in rng.integers(0, groups, (2 * groups, 2)) if a != b}
    )
    matrices = [rng.integers(0, 40, (sizes[a], sizes[b])) for a, b in pairs]
    edges = tuple(
        (a, b, tuple(tuple(int(c) for c in row) for row in m))
        for (a, b), m in zip(pairs, matrices, strict=True)
    )
    node = tuple(tuple(int(c) for c in rng.integers(0, 40, n)) for n in sizes)
    return Problem(sizes, node, edges, NO_ROWS, 0, 1.0)


@pytest.mark.parametrize("seed", range(20))
def test_elimination_goes_in_the_scans_order_and_stays_exact(seed: int) -> None:
    problem = random_problem(seed)
    reduced, kept, order = eliminate(problem)
    pairs = [(a, b) for a, b, _ in problem.edges]
    assert [step.group for step in order] == scanned(problem.sizes, pairs)
    # The rest's optimum (brute-forced) with the recorded argmins is the whole's optimum.
    rest = min(itertools.product(*map(range, reduced.sizes)), key=reduced.objective)
    choice = _expand(rest, kept, order, len(problem.sizes))
    whole = min(itertools.product(*map(range, problem.sizes)), key=problem.objective)
    assert problem.objective(choice) == problem.objective(whole)

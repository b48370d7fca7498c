"""IOPDDL nodes tied one-to-one by forbidden pairs (`iopddl.ties`): decided as one group, so
that a hub moves with every node tied to it; optima brute-forced (`test_iopddl`'s evaluator)."""

from __future__ import annotations

import itertools
import random

import pytest

from autoshard.search.iopddl.format import FORBIDDEN, IopddlError, parse_problem
from autoshard.search.iopddl.greedy import greedy
from autoshard.search.iopddl.pose import pose
from autoshard.search.iopddl.solve import solve_iopddl
from tests.search.test_iopddl import brute_force, evaluate, random_problem

F = FORBIDDEN


def tie(size: int, shift: int = 0) -> list[int]:
    """An edge's costs allowing strategy k with (k + shift) % size alone (row-major)."""
    return [0 if (k + shift) % size == j else F for k in range(size) for j in range(size)]


def hub(spokes: int, limit: int | None) -> dict:
    """A hub of two strategies tied to `spokes` nodes (the same strategy on both ends). The
    hub's cheaper strategy 0 holds 10 units over the whole interval; each spoke's cheaper
    strategy 1 holds 1 unit in its own time. Optimum: all take 1, cost 10 (all take 0: 5 per
    spoke), the only solution within a limit under 11."""
    nodes = 1 + spokes
    problem: dict = {
        "nodes": {
            "intervals": [[0, 2 * spokes]] + [[2 * s, 2 * s + 2] for s in range(spokes)],
            "costs": [[0, 10]] + [[5, 0]] * spokes,
            "usages": [[10, 1]] + [[1, 1]] * spokes,
        },
        "edges": {"nodes": [[0, n] for n in range(1, nodes)], "costs": [tie(2)] * spokes},
    }
    if limit is not None:
        problem["usage_limit"] = limit
    return {"problem": {"name": "hub", **problem}}


@pytest.mark.parametrize("limit", [None, 5], ids=["free", "binding"])
def test_a_hub_moves_with_every_node_tied_to_it(limit: int | None) -> None:
    # One node at a time, the hub cannot leave strategy 0 while its spokes hold 0 (each edge
    # forbids it), nor a spoke leave 0 while the hub holds it: stuck at 5 per spoke, or, over
    # the limit, the hub moved alone into forbidden pairs. As one group, both choices are
    # priced whole.
    data = hub(6, limit)
    best, _ = brute_force(data)
    assert best == 10
    posed = pose(parse_problem(data))
    assert posed.problem.sizes == (2,) and posed.problem.edges == ()
    quick = greedy(posed)
    assert quick.fits and evaluate(data, posed.solution(quick.choice))[0] == best
    solved = solve_iopddl(parse_problem(data))
    assert solved.solution == (1,) * 7 and solved.cost == solved.bound == best


def test_a_cycle_whose_ties_disagree_leaves_the_choices_out() -> None:
    # a - b - c - a, each tie a permutation of three; composed around the cycle they keep
    # strategy 0 alone (a's 0 -> b's 0 -> c's 0 -> a's 0; a's 1 -> b's 2 -> c's 1 -> a's 2).
    data = {"problem": {"name": "cycle", "nodes": {
        "intervals": [[0, 1]] * 3, "costs": [[9, 0, 0], [9, 0, 0], [9, 0, 0]],
        "usages": [[1, 1, 1]] * 3},
        "edges": {"nodes": [[0, 1], [1, 2], [2, 0]],
                  "costs": [[0, F, F, F, F, 0, F, 0, F]] * 3}}}  # fmt: skip
    posed = pose(parse_problem(data))
    assert posed.problem.sizes == (1,)
    assert solve_iopddl(parse_problem(data)).solution == (0, 0, 0)
    assert brute_force(data)[0] == 27


def test_ties_that_leave_no_choice_name_a_node() -> None:
    data = {"problem": {"name": "none", "nodes": {
        "intervals": [[0, 1]] * 2, "costs": [[0, 0], [0, 0]], "usages": [[1, 1]] * 2},
        "edges": {"nodes": [[0, 1], [1, 0]], "costs": [tie(2), tie(2, 1)]}}}  # fmt: skip
    with pytest.raises(IopddlError, match="node 0"):
        pose(parse_problem(data))


def tied_problem(seed: int) -> dict:
    """`random_problem` with ties added between nodes of as many strategies (a star and a
    chain, some shifted), so that groups of several nodes meet memory rows and edges."""
    data = random_problem(seed, nodes=7)
    rng = random.Random(seed)
    nodes, edges = data["problem"]["nodes"], data["problem"]["edges"]
    sizes = [len(c) for c in nodes["costs"]]
    for a in range(len(sizes)):
        for b in range(a + 1, len(sizes)):
            if sizes[a] == sizes[b] > 1 and rng.random() < 0.5:
                edges["nodes"].append([a, b] if rng.random() < 0.5 else [b, a])
                edges["costs"].append(tie(sizes[a], rng.randrange(2)))
    peaks = []
    for solution in itertools.product(*map(range, sizes)):
        cost, _, peak = evaluate(data, list(solution))
        if cost < F:
            peaks.append(peak)
    if peaks:  # a limit between the least and most peak of the solutions the ties allow
        data["problem"]["usage_limit"] = (min(peaks) + max(peaks)) // 2
    return data


@pytest.mark.parametrize("seed", range(16))
def test_tied_problems_reach_the_brute_forced_optimum(seed: int) -> None:
    data = tied_problem(seed)
    best, _ = brute_force(data)
    if best is None:
        with pytest.raises(IopddlError, match="usage limit|forbidden"):
            solve_iopddl(parse_problem(data))
        return
    solved = solve_iopddl(parse_problem(data))
    cost, fits, peak = evaluate(data, list(solved.solution))
    assert fits and (solved.cost, solved.usage) == (cost, peak)
    assert solved.cost == best == solved.bound and solved.optimal
    posed = pose(parse_problem(data))
    quick = greedy(posed)
    if quick.fits:
        cost, fits, _ = evaluate(data, posed.solution(quick.choice))
        assert fits and best <= cost < F

"""The least-usage start (`iopddl.frugal`): each group's usage per choice summed node by node,
and the start the optimum with memory aside among the least-usage choices (brute-forced)."""

from __future__ import annotations

import itertools

import pytest

from autoshard.deadline import Deadline
from autoshard.search.iopddl.format import IopddlError, parse_problem
from autoshard.search.iopddl.frugal import frugal, least_usage_kept, weighted_usage
from autoshard.search.iopddl.pose import pose
from tests.search.test_iopddl import random_problem


@pytest.mark.parametrize("seed", range(6))
def test_weighted_usage_sums_each_nodes_usage_over_its_rows(seed: int) -> None:
    iop = parse_problem(random_problem(seed, nodes=8))
    posed = pose(iop)
    usage, groups = posed.usage, posed.groups
    found = weighted_usage(usage, posed.problem.sizes)
    for g, (nodes, strategies) in enumerate(zip(groups.nodes, groups.strategies, strict=True)):
        for k in range(posed.problem.sizes[g]):
            expected = 0
            for i, n in enumerate(nodes.tolist()):
                used = [iop.usages[n][s] for s in strategies[i].tolist()]
                rows = max(int(usage.last[n]) - int(usage.first[n]), 0)
                expected += (used[k] - min(used)) * rows
            assert found[g][k] == expected


@pytest.mark.parametrize("seed", range(8))
def test_the_start_is_the_optimum_among_the_least_usage_choices(seed: int) -> None:
    try:
        posed = pose(parse_problem(random_problem(seed, nodes=8, forbidden=seed % 2 == 1)))
    except IopddlError:
        pytest.skip("every strategy of some node is forbidden")
    kept = least_usage_kept(posed)
    start = frugal(posed, 10.0, Deadline.start(60.0))
    if all(len(k) == n for k, n in zip(kept, posed.problem.sizes, strict=True)):
        assert start is None  # (nothing to restrict: the greedy's own starts)
        return
    assert start is not None
    assert all(k in choices for k, choices in zip(start, kept, strict=True))
    objective = posed.problem.objective
    assert objective(start) == min(map(objective, itertools.product(*kept)))


def test_a_single_least_usage_choice_per_group_holds_the_least_usage() -> None:
    """Where each group has one least-usage choice, the start's usage at every row is the
    least any solution holds there: it fits wherever the least usage does."""
    for seed in range(12):
        posed = pose(parse_problem(random_problem(seed, nodes=8)))
        kept = least_usage_kept(posed)
        if any(len(k) > 1 for k in kept):
            continue
        start = frugal(posed, 10.0, Deadline.start(60.0))
        assert start is not None
        every = itertools.product(*map(range, posed.problem.sizes))
        least = min(posed.usage.profile(list(c)).max() for c in every)
        assert posed.usage.profile(list(start)).max() == least

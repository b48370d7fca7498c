"""A start for problems whose usage limit binds hard: per group only the choices of least
usage, and the optimum among them with memory aside (the plans' `memory_aside`: exact
elimination, else CP-SAT on what elimination leaves).

A group's usage under a choice is its nodes' usage past their least (`Usage.extra`), each
times the time points it is live at (the rows it holds). Where the limit leaves little room
above every node's least usage, the greedy's repair moves one group at a time off its
cheapest choice and pays a reshard on each of its edges; a start of the least-usage choices
throughout pays only the reshards their optimum cannot avoid. It fits wherever the least
usage does and each group's least-usage choices are alike in usage at every row (most are a
single choice); the caller checks.

Deterministic where the deadline does not bind: `memory_aside`'s CP-SAT runs in
deterministic time.
"""

from __future__ import annotations

import numpy as np

from autoshard.deadline import Deadline
from autoshard.search.iopddl.pose import Posed, Usage
from autoshard.search.solver.eliminate import memory_aside
from autoshard.search.solver.outcome import Limit, OutOfTime, in_whole


def weighted_usage(usage: Usage, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """Per group, per choice: its nodes' usage past their least times the rows each holds."""
    counts = np.array([len(e) for e in usage.extra], np.int64)
    held = np.maximum(usage.last - usage.first, 0)
    if not len(counts):
        return [np.zeros(n, np.int64) for n in sizes]
    extra = np.concatenate(usage.extra) * np.repeat(held, counts)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    node_at = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot = offsets[np.repeat(usage.group_of, counts)] + np.arange(len(extra))
    slot -= np.repeat(node_at, counts)
    total = np.bincount(slot, extra.astype(np.float64), int(offsets[-1]))
    return np.split(total, offsets[1:-1])


def least_usage_kept(posed: Posed) -> list[list[int]]:
    """Per group, its choices of least weighted usage (`weighted_usage`), ascending."""
    sizes = posed.problem.sizes
    return [np.flatnonzero(w == w.min()).tolist() for w in weighted_usage(posed.usage, sizes)]


def frugal(posed: Posed, seconds: float, deadline: Deadline) -> tuple[int, ...] | None:
    """The optimum with memory aside among each group's least-usage choices (the module's
    docstring), within `seconds` of deterministic time and `deadline`; None where neither
    left time for a solution."""
    kept = least_usage_kept(posed)
    if all(len(k) == n for k, n in zip(kept, posed.problem.sizes, strict=True)):
        return None  # (no choice differs in usage: the greedy's starts are this one's)
    problem = posed.problem.restricted(kept)
    try:
        found = memory_aside(problem, Limit(seconds, seconds, "least-usage", deadline), None, "s")
    except OutOfTime:
        return None
    return in_whole(found.choice, kept)

"""Pair moves: the two groups an edge joins changed together, within the usage limit.

A single group's move (`greedy`'s sweeps) cannot leave a solution where an edge pays a reshard
that only a change at both of its ends removes: each end alone, moved to the other's choice,
pays the reshards of its own other edges. A pair move prices every pair of the two groups'
choices at once, the rest given: their costs given their other neighbours, plus the edge's
cell,

    total[k, l] = (own_g + edges of g but to h)[k] + (own_h + edges of h but to g)[l] + M[k, l]

and takes, of the pairs cheaper than the incumbent's, the cheapest whose usage fits every row
the two groups' nodes hold (the rows' usage with both changed). A pair whose second choice is
the incumbent's is a single move, so a sweep does what `greedy`'s sweeps do, and more: a
solution no sweep improves is optimal among those that change two joined groups.

Deterministic: the edges in order (the lower group first), pairs by cost (ties: the first in
row-major order).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autoshard.deadline import NEVER, Deadline
from autoshard.search.iopddl.greedy import Held, Local

CHECKED_EVERY = 256
"""Edges a sweep tries between looks at its deadline."""

CHECKS = 64
"""Pairs cheaper than the incumbent's checked against the usage limit at most, per edge: the
cheapest first; past them the edge is left as it is."""


def pair_sweep(
    held: Held,
    local: Local,
    choice: np.ndarray,
    live: np.ndarray,
    limit: int | None,
    around: Sequence[int] | None = None,
    deadline: Deadline = NEVER,
) -> list[int]:
    """One sweep of pair moves over the edges (the module's docstring; `choice` and `live`,
    the rows' usage, changed in place; `limit` None: memory aside), or over those with an end
    among the groups `around`: the groups moved (in the order moved, once each). It stops
    where `deadline` passes (checked every `CHECKED_EVERY` edges)."""
    groups = range(len(choice)) if around is None else sorted(set(around))
    edges = sorted({(min(g, h), max(g, h)) for g in groups for h, _ in local.edges[g] if h != g})
    matrices = {(g, h): m for g in {a for a, _ in edges} for h, m in local.edges[g]}
    moved: dict[int, None] = {}
    for at, (g, h) in enumerate(edges):
        if at % CHECKED_EVERY == 0 and deadline.passed():
            break
        pair = best_pair(held, local, choice, live, limit, g, h, matrices[(g, h)])
        if pair is None:
            continue
        for group, to in ((g, pair[0]), (h, pair[1])):
            if to != choice[group]:
                held.move(group, int(choice[group]), to, live)
                choice[group] = to
                moved[group] = None
    return list(moved)


def best_pair(
    held: Held,
    local: Local,
    choice: np.ndarray,
    live: np.ndarray,
    limit: int | None,
    g: int,
    h: int,
    matrix: np.ndarray,
) -> tuple[int, int] | None:
    """The cheapest pair of choices of groups g and h (joined by `matrix`, g's choices its
    rows) that is cheaper than theirs now and fits the limit, the rest given; None where
    none of the `CHECKS` cheapest does."""
    now_g, now_h = int(choice[g]), int(choice[h])
    total = (local.vector(g, choice) - matrix[:, now_h])[:, None]
    total = total + (local.vector(h, choice) - matrix[now_g, :])[None, :] + matrix
    order = np.argsort(total, axis=None, kind="stable")
    cheaper = order[total.ravel()[order] < total[now_g, now_h]][:CHECKS]
    if not len(cheaper):
        return None
    pairs = np.column_stack(np.unravel_index(cheaper, total.shape))
    if limit is None:
        return int(pairs[0, 0]), int(pairs[0, 1])
    lo_g, change_g = held.change(g, now_g)
    lo_h, change_h = held.change(h, now_h)
    lo = min(lo_g, lo_h)
    hi = max(lo_g + change_g.shape[1], lo_h + change_h.shape[1])
    if hi <= lo:
        return int(pairs[0, 0]), int(pairs[0, 1])
    rows = np.zeros((len(pairs), hi - lo), np.int64)
    rows[:, lo_g - lo : lo_g - lo + change_g.shape[1]] += change_g[pairs[:, 0]]
    rows[:, lo_h - lo : lo_h - lo + change_h.shape[1]] += change_h[pairs[:, 1]]
    fits = np.flatnonzero((live[lo:hi] + rows).max(axis=1) <= limit)
    if not len(fits):
        return None
    return int(pairs[fits[0], 0]), int(pairs[fits[0], 1])

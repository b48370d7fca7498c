"""IOPDDL nodes grouped: those that forbidden pairs tie one-to-one decide together.

The contest's problems join hubs to hundreds of nodes by edges that forbid every pair but one
per strategy (the same sharding on both ends): a permutation. Such an edge makes one node's
strategy decide the other's, so a component of them (union-find over those edges) is one
decision: a group over the strategies of its first node, each member's strategy mapped along
the edges (`_contracted`). Where two paths disagree (a cycle whose permutations do not
compose to the identity), or an edge inside the component forbids a pair, the group's choice
is left out. No solution is lost: every solution avoiding the forbidden costs takes, in each
component, the mapped strategies of one choice. And none can take a forbidden pair inside a
group, which no search moving one node at a time could keep to.

Example: hub h (strategies 0, 1) tied to a and b (a's strategy 1 goes with h's 0, a's 0 with
h's 1; b's alike with h's): the group {h, a, b} has choices [h0 a1 b0] and [h1 a0 b1].

Strategies that every strategy of a neighbour forbids are left out first (`_consistent`), and
both steps repeat until neither changes anything (leaving strategies out may make a pair a
permutation).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.search.iopddl.format import FORBIDDEN, IopddlError

Pairs = dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]
"""Per pair of groups (g < h): the finite costs of their edges summed over their choices, and
where any edge forbids."""


@dataclass(frozen=True, eq=False)
class Groups:
    """Group g decides the nodes `nodes[g]`: under its choice k, member i takes strategy
    `strategies[g][i, k]` (the contest's index); `costs[g][k]` is their costs and those of
    the edges among them; `pairs` the edges between groups."""

    costs: list[np.ndarray]
    nodes: list[np.ndarray]
    strategies: list[np.ndarray]
    pairs: Pairs

    def node_of(self, g: int) -> int:
        """The node that names group g in messages: its first."""
        return int(self.nodes[g][0])


def grouped(costs: Sequence[np.ndarray], pairs: Pairs) -> Groups:
    """The nodes grouped (the module's docstring): `costs` the contest's per node (int64,
    `FORBIDDEN` and past it forbidden), `pairs` per pair of nodes (a <= b; a == b: an edge of a
    node to itself, its diagonal counts). `IopddlError` where some node has no strategy left."""
    kept = [np.flatnonzero(c < FORBIDDEN) for c in costs]
    for (a, b), (_, forbidden) in pairs.items():
        if a == b:
            kept[a] = kept[a][~np.diagonal(forbidden)[kept[a]]]
    for node, choices in enumerate(kept):
        if not len(choices):
            raise IopddlError(f"every strategy of node {node} is forbidden (costs {FORBIDDEN})")
    own = [c[k] for c, k in zip(costs, kept, strict=True)]
    between: Pairs = {}
    for (a, b), (finite, forbidden) in pairs.items():
        if a == b:
            own[a] = own[a] + np.diagonal(finite)[kept[a]]
        else:
            between[(a, b)] = _taken(finite, forbidden, kept[a], kept[b])
    nodes = [np.array([n], np.int64) for n in range(len(costs))]
    groups = Groups(own, nodes, [k.reshape(1, -1) for k in kept], between)
    # The pairs where some edge forbids, found once: a pair none forbids never comes to.
    forbidding = [pair for pair, (_, forbidden) in between.items() if forbidden.any()]
    while True:
        groups = _consistent(groups, forbidding)
        ties = [pair for pair in forbidding if _one_to_one(groups.pairs[pair][1])]
        if not ties:
            return groups
        groups, forbidding = _contracted(groups, ties, forbidding)


def _one_to_one(forbidden: np.ndarray) -> bool:
    """Whether a pair's forbidden cells leave one pair per row and per column."""
    n = forbidden.shape[0]
    if n != forbidden.shape[1] or n < 2 or np.count_nonzero(forbidden) != n * (n - 1):
        return False
    allowed = ~forbidden
    return bool((allowed.sum(axis=0) == 1).all() and (allowed.sum(axis=1) == 1).all())


def _consistent(groups: Groups, among: Sequence[tuple[int, int]]) -> Groups:
    """The choices left once each that every choice of a neighbour forbids is left out, until
    none is (a group left none: no solution avoids a forbidden cost); `among` holds every
    pair where some edge forbids. A pair is looked at again only where one of its groups
    lost a choice since (a queue of them, in `among`'s order at first)."""
    kept = [np.arange(len(c)) for c in groups.costs]
    touching: dict[int, list[int]] = {}
    for i, (a, b) in enumerate(among):
        touching.setdefault(a, []).append(i)
        touching.setdefault(b, []).append(i)
    queue, queued = collections.deque(range(len(among))), [True] * len(among)
    fewer: set[int] = set()
    while queue:
        i = queue.popleft()
        queued[i] = False
        a, b = among[i]
        forbidden = groups.pairs[(a, b)][1]
        cells = forbidden[np.ix_(kept[a], kept[b])] if a in fewer or b in fewer else forbidden
        for g, alive, other in ((a, ~cells.all(axis=1), b), (b, ~cells.all(axis=0), a)):
            if not alive.all():
                if not alive.any():
                    raise IopddlError(f"every strategy of node {groups.node_of(g)} takes a "
                                      f"forbidden cost ({FORBIDDEN}) on an edge with node "
                                      f"{groups.node_of(other)}")  # fmt: skip
                kept[g] = kept[g][alive]
                fewer.add(g)
                for j in touching[g]:
                    if not queued[j]:
                        queue.append(j)
                        queued[j] = True
                cells = forbidden[np.ix_(kept[a], kept[b])]
    if not fewer:
        return groups
    pairs = {(a, b): _taken(m, f, kept[a], kept[b]) if a in fewer or b in fewer else (m, f)
             for (a, b), (m, f) in groups.pairs.items()}  # fmt: skip
    return dataclasses.replace(
        groups, costs=[c[k] for c, k in zip(groups.costs, kept, strict=True)],
        strategies=[s[:, k] for s, k in zip(groups.strategies, kept, strict=True)], pairs=pairs,
    )  # fmt: skip


def _taken(
    finite: np.ndarray, forbidden: np.ndarray, rows: np.ndarray, columns: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """A pair's matrices over the choices `rows` and `columns` kept (the same where all are)."""
    if len(rows) == finite.shape[0] and len(columns) == finite.shape[1]:
        return finite, forbidden
    cells = np.ix_(rows, columns)
    return finite[cells], forbidden[cells]


def _components(size: int, ties: Sequence[tuple[int, int]]) -> np.ndarray:
    """Each group's component over the ties: the least group in it (union-find)."""
    parent = list(range(size))

    def root(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    for a, b in ties:
        ra, rb = root(a), root(b)
        parent[max(ra, rb)] = min(ra, rb)
    return np.array([root(g) for g in range(size)], np.int64)


def _mappings(groups: Groups, ties: Sequence[tuple[int, int]], root: np.ndarray) -> list:
    """Per group, its choice under each choice of its component's root, along the ties from
    the root (breadth first, neighbours in order): the root's own are 0, 1, ..."""
    follows: dict[int, list[tuple[int, np.ndarray]]] = {}
    for a, b in ties:  # the partner's choice of each choice
        allowed = ~groups.pairs[(a, b)][1]
        follows.setdefault(a, []).append((b, np.argmax(allowed, axis=1)))
        follows.setdefault(b, []).append((a, np.argmax(allowed, axis=0)))
    mapping: list[np.ndarray | None] = [None] * len(groups.costs)
    for start in np.flatnonzero(root == np.arange(len(root))).tolist():
        mapping[start] = np.arange(len(groups.costs[start]))
        queue = [start]
        while queue:
            g = queue.pop(0)
            for h, partner in sorted(follows.get(g, []), key=lambda f: f[0]):
                if mapping[h] is None:
                    mapping[h] = partner[mapping[g]]
                    queue.append(h)
    return mapping


def _contracted(
    groups: Groups, ties: Sequence[tuple[int, int]], forbidding: Sequence[tuple[int, int]]
) -> tuple[Groups, list[tuple[int, int]]]:
    """A group per component of the ties (ordered by their least group), over the choices of
    its root that no edge inside it forbids; and the pairs of them where some edge may
    forbid (those made of `forbidding`'s)."""
    root = _components(len(groups.costs), ties)
    mapping = _mappings(groups, ties, root)
    roots, numbers = np.unique(root, return_inverse=True)
    number = numbers.tolist()
    costs = [np.zeros(len(groups.costs[r]), np.int64) for r in roots.tolist()]
    alive = [np.ones(len(c), bool) for c in costs]
    tied = {g for pair in ties for g in pair}
    for g, c in enumerate(groups.costs):
        costs[number[g]] += c[mapping[g]] if g in tied else c
    same = [g not in tied or bool((m == np.arange(len(m))).all()) for g, m in enumerate(mapping)]
    outside: dict[tuple[int, int], np.ndarray] = {}
    outside_forbidden: dict[tuple[int, int], np.ndarray] = {}
    for (a, b), (finite, forbidden) in groups.pairs.items():
        ga, gb = number[a], number[b]
        if ga == gb:
            costs[ga] += finite[mapping[a], mapping[b]]
            alive[ga] &= ~forbidden[mapping[a], mapping[b]]
            continue
        m, f = finite, forbidden
        if not same[a] or not same[b]:
            cells = np.ix_(mapping[a], mapping[b])
            m, f = finite[cells], forbidden[cells]
        if ga > gb:
            ga, gb, m, f = gb, ga, m.T, f.T
        if (ga, gb) in outside:
            m, f = outside[(ga, gb)] + m, outside_forbidden[(ga, gb)] | f
        outside[(ga, gb)], outside_forbidden[(ga, gb)] = m, f
    components = sorted({number[g] for g in tied})
    for g in components:
        if not alive[g].any():
            raise IopddlError(f"node {int(roots[g])}'s strategies each take a forbidden cost "
                              f"({FORBIDDEN}) with the nodes tied to it one-to-one")  # fmt: skip
    whole = [True] * len(roots)  # (a group no tie took keeps every choice)
    for g in components:
        whole[g] = bool(alive[g].all())
    nodes, strategies = _merged(groups, numbers, mapping, alive)
    pairs = {}
    for (a, b), m in sorted(outside.items()):
        f = outside_forbidden[(a, b)]
        if whole[a] and whole[b]:
            pairs[(a, b)] = (m, f)
        else:
            pairs[(a, b)] = _taken(m, f, np.flatnonzero(alive[a]), np.flatnonzero(alive[b]))
    ends = [(number[a], number[b]) for a, b in forbidding]
    may = {(min(e), max(e)) for e in ends if e[0] != e[1]}
    costs = [c if keep else c[live] for c, live, keep in zip(costs, alive, whole, strict=True)]
    contracted = Groups(costs, nodes, strategies, pairs)
    return contracted, [pair for pair in pairs if pair in may]


def _merged(
    groups: Groups, numbers: np.ndarray, mapping: list, alive: list[np.ndarray]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per contracted group (`numbers[g]` takes group g) its members' nodes, and their
    strategies under its choices `alive`, each member's mapped along the ties."""
    order = np.argsort(numbers, kind="stable")
    members = np.split(order, np.cumsum(np.bincount(numbers, minlength=len(alive)))[:-1])
    nodes, strategies = [], []
    for ms, live in zip(members, alive, strict=True):
        if len(ms) == 1:  # (no tie took it: as it was)
            nodes.append(groups.nodes[int(ms[0])])
            strategies.append(groups.strategies[int(ms[0])])
            continue
        nodes.append(np.concatenate([groups.nodes[m] for m in ms.tolist()]))
        strategies.append(
            np.concatenate([groups.strategies[m][:, mapping[m][live]] for m in ms.tolist()])
        )
    return nodes, strategies

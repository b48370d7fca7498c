"""Exact minimization of a sum of tables over discrete choices (min-sum bucket elimination).

A problem is groups g with `sizes[g]` choices and factors: tables over a few groups (a node's
costs over its one group, an edge's matrix over two, a Lagrangian term over three). The
minimum of their sum is found by eliminating one group at a time: the factors that mention g
are summed into one table over g and its neighbours, minimized over g (the argmin kept), and
the minimum replaces them as one factor over the neighbours. Once every group is gone, the
argmins, read back in reverse order, give a choice per group reaching the minimum.

The work is the size of the tables, which depends on the order. The order is greedy, by the
fewest entries: at each step the group whose neighbours' sizes have the least product (ties:
the lowest index); or by the least fill (the entries of the tables a step joins anew), where
that is less work (`elimination_order`). It is found from the scopes alone, before any table
is built, so a graph that would need a too-large table is answered `None` at once. Worked
example of the fewest entries (the 32-layer decoder's rest on a 2x4x8 mesh): groups of (171,
82, 82, 82, 284, 284, 3) choices with edges 0-1 0-2 0-3 0-5 1-4 2-4 3-5 4-5 1-6 2-6 3-6.
Group 1's neighbours (0, 4, 6) make 171 * 284 * 3 = 145,692 entries, group 6's (1, 2, 3)
82^3 = 551,368: 1 goes first, leaving a ternary table over (0, 4, 6); then 2 and 3 alike
(into (0, 4, 6) and (0, 5, 6)), 4 (neighbours 0, 5, 6), 5 (0, 6), 0 (6), 6. No table exceeds
145,692 entries, and the work, the sum of each step's table times its group's choices, is
~80 million additions.

Integer tables are summed in int64, exactly (the ILP's costs are <= 1e9 per coefficient, far
from overflowing); float64 tables (a Lagrangian's multipliers) in float64. Ties go to the
lowest choice (np.argmin's first index), so the answer is deterministic.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.search.problem import Problem
from autoshard.search.solver import tuning
from autoshard.search.solver.steps import Steps


@dataclass(frozen=True, eq=False)
class Factor:
    """A table over the groups of `scope` (strictly ascending), one axis per group, indexed
    by their choices; int64 or float64."""

    scope: tuple[int, ...]
    table: np.ndarray

    def __post_init__(self) -> None:
        if any(a >= b for a, b in zip(self.scope, self.scope[1:], strict=False)):
            raise ValueError(f"factor scope {self.scope} is not strictly ascending")
        if self.table.ndim != len(self.scope):
            raise ValueError(
                f"factor over {self.scope} has a table of {self.table.ndim} axes, "
                f"not {len(self.scope)}"
            )
        if self.table.dtype not in (np.int64, np.float64):
            raise ValueError(
                f"factor over {self.scope} is {self.table.dtype}, not int64 or float64"
            )


@dataclass(frozen=True)
class Minimum:
    """A choice per group and the sum of the tables there (an int when they are all int64)."""

    choice: tuple[int, ...]
    value: float | int


def problem_factors(problem: Problem) -> list[Factor]:
    """The ILP's objective as factors, memory aside: each group's node costs, each edge's
    matrix (int64, the ILP's integer costs)."""
    factors = [Factor((g,), np.array(costs, dtype=np.int64))
               for g, costs in enumerate(problem.node_costs)]  # fmt: skip
    for a, b, matrix in problem.edges:
        table = np.array(matrix, dtype=np.int64).reshape(problem.sizes[a], problem.sizes[b])
        if a == b:  # pragma: no cover - the builder folds these into node costs
            factors.append(Factor((a,), np.diag(table).copy()))
        else:
            factors.append(Factor((a, b), table) if a < b else Factor((b, a), table.T.copy()))
    return factors


def undominated(problem: Problem) -> list[list[int]]:
    """The choices of each group that are no dead end, memory aside (Goldstein's dead-end
    elimination): choice a of group g is one where some other choice b costs no more
    whatever the other groups choose, node[a] - node[b] + sum over g's edges of
    min_c (M[a][c] - M[b][c]) >= 0 (b of a lower index where it is 0, so that one of equals
    stays). Some optimum takes none: each choice of it that is one can be swapped for its b
    at no cost, to a choice that is none (a chain of them ends: each step strictly cheaper
    or to a lower index). Few choices stay, and the exact elimination of the rest needs far
    smaller tables."""
    node = [np.asarray(costs, np.int64) for costs in problem.node_costs]
    worst = [costs[:, None] - costs[None, :] for costs in node]  # a's cost less b's
    for a, b, matrix in problem.edges:
        table = np.asarray(matrix, np.int64)
        worst[a] += _least_difference(table)
        worst[b] += _least_difference(table.T)
    kept = []
    for found in worst:
        n = len(found)
        lower = np.arange(n)[None, :] < np.arange(n)[:, None]  # b's index below a's
        np.fill_diagonal(found, -1)
        dead = ((found > 0) | ((found == 0) & lower)).any(axis=1)
        kept.append(np.flatnonzero(~dead).tolist())
    return kept


def _least_difference(matrix: np.ndarray) -> np.ndarray:
    """min_c (matrix[a][c] - matrix[b][c]) for each pair of rows (a, b): over the distinct
    rows and columns only (an edge's matrix has few), a block of rows at a time."""
    rows, row_of = np.unique(matrix, axis=0, return_inverse=True)
    rows = np.unique(rows, axis=1)
    least = np.empty((len(rows), len(rows)), np.int64)
    block = max(1, tuning.DIFFERENCES // max(1, rows.size))
    for first in range(0, len(rows), block):
        part = rows[first : first + block]
        least[first : first + block] = (part[:, None, :] - rows[None, :, :]).min(axis=2)
    row_of = row_of.ravel()
    return least[np.ix_(row_of, row_of)]


def elimination_order(
    sizes: Sequence[int], scopes: Sequence[Sequence[int]], cap: int | None = None
) -> tuple[tuple[tuple[int, tuple[int, ...]], ...], int]:
    """An order over the groups the scopes mention: (group, its neighbours when eliminated)
    per step, and the most entries a step's minimum has (the product of its neighbours'
    sizes). Of two greedy orders, the one of less work (`additions`; ties: the first):
    by the fewest entries, and by the least fill (`_fill`). Kept for the last scopes asked:
    a Lagrangian's subproblems share a few graphs over many multipliers.

    `cap`: the most entries the caller takes (None: any). An order that passes it is left
    unfinished where it does (its largest is past the cap all the same), unless the other
    order fits and only the whole of this one's work says which is chosen: the order a
    caller takes is the one it would take without a cap. A graph far past any table (tens
    of thousands of groups, their neighbourhoods growing into the thousands) passes it early."""
    return _order(tuple(sizes), frozenset(tuple(scope) for scope in scopes), cap)


@functools.lru_cache(maxsize=64)
def _order(
    sizes: tuple[int, ...], scopes: frozenset[tuple[int, ...]], cap: int | None = None
) -> tuple[tuple[tuple[int, tuple[int, ...]], ...], int]:
    near: dict[int, set[int]] = {}
    for scope in scopes:
        for g in scope:
            near.setdefault(g, set()).update(h for h in scope if h != g)
    orders = [_greedy(sizes, near, score, cap) for score in (_entries, _fill)]
    works = [additions(sizes, order) for order, _ in orders]
    most = math.inf if cap is None else cap
    for i, (_, largest) in enumerate(orders):
        if largest > most >= orders[1 - i][1]:
            # the unfinished one's work so far is a floor of its whole: where that does not
            # already lose to the other's (ties: the first), its whole decides
            loses = works[i] > works[1 - i] or (works[i] == works[1 - i] and i == 1)
            if not loses:
                whole = _greedy(sizes, near, (_entries, _fill)[i], None)
                orders[i], works[i] = whole, additions(sizes, whole[0])
    return orders[0] if works[0] <= works[1] else orders[1]


def _entries(sizes: Sequence[int], near: dict[int, set[int]], g: int) -> tuple[int, ...]:
    """The entries of g's minimum: the product of its neighbours' sizes."""
    return (math.prod(sizes[h] for h in near[g]),)


def _fill(sizes: Sequence[int], near: dict[int, set[int]], g: int) -> tuple[int, ...]:
    """The entries of the tables g's elimination joins anew (a pair of its neighbours no table
    held together yet: the product of their sizes, summed), then its minimum's. The fewest
    entries alone can take a small step that joins large groups, which every later step then
    pays for."""
    neighbours = sorted(near[g])
    joined = sum(
        sizes[a] * sizes[b]
        for i, a in enumerate(neighbours)
        for b in neighbours[i + 1 :]
        if b not in near[a]
    )
    return (joined, *_entries(sizes, near, g))


def _greedy(
    sizes: Sequence[int],
    adjacent: dict[int, set[int]],
    score: Callable[[Sequence[int], dict[int, set[int]], int], tuple[int, ...]],
    cap: int | None = None,
) -> tuple[tuple[tuple[int, tuple[int, ...]], ...], int]:
    """The order eliminating at each step the group of the least `score` (ties: the lowest
    index), and its largest minimum. A step changes the scores of its neighbours and of
    theirs (a pair of those may now be joined), only those. Left unfinished where a minimum
    passes `cap`."""
    near = {g: set(others) for g, others in adjacent.items()}
    current = {g: score(sizes, near, g) for g in near}
    heap = [(value, g) for g, value in current.items()]
    heapq.heapify(heap)
    order: list[tuple[int, tuple[int, ...]]] = []
    largest = 1
    while heap:
        value, g = heapq.heappop(heap)
        if current.get(g) != value:  # eliminated, or a stale score
            continue
        del current[g]
        neighbours = tuple(sorted(near.pop(g)))
        largest = max(largest, math.prod(sizes[h] for h in neighbours))
        order.append((g, neighbours))
        if cap is not None and largest > cap:
            break
        for h in neighbours:  # they now neighbour each other, and no longer g
            near[h].discard(g)
            near[h].update(n for n in neighbours if n != h)
        for h in set(neighbours).union(*(near[h] for h in neighbours)):
            if (now := score(sizes, near, h)) != current[h]:
                current[h] = now
                heapq.heappush(heap, (now, h))
    return tuple(order), largest


def additions(sizes: Sequence[int], order: Sequence[tuple[int, tuple[int, ...]]]) -> int:
    """The work of an elimination in `order`: each step's table, its group's choices times
    its neighbours'."""
    return sum(sizes[g] * math.prod(sizes[h] for h in near) for g, near in order)


def minimize(
    sizes: Sequence[int],
    factors: Sequence[Factor],
    max_entries: int = tuning.MAX_ENTRIES,
    steps: Steps | None = None,
) -> Minimum | None:
    """A choice per group minimizing the sum of `factors`, exactly; `None` (before any table
    is built) when the elimination order needs a table of more than `max_entries` entries.
    Groups no factor mentions take choice 0. `steps`: large steps remembered across solves
    of restrictions of one problem (`steps.Steps`), the same answer sooner."""
    forward = _forward(sizes, factors, max_entries, keep=False, remembered=steps)
    if forward is None:
        return None
    passed, _ = forward
    choice = [0] * len(sizes)
    for step in reversed(passed):
        choice[step.group] = step.choose(choice)
    return Minimum(tuple(choice), _value(factors, choice))


def min_marginals(
    sizes: Sequence[int], factors: Sequence[Factor], max_entries: int = tuning.MAX_ENTRIES
) -> list[np.ndarray] | None:
    """For each group g, the least sum of `factors` with g's choice fixed, per choice: entry k
    is the minimum over all choices that take k for g (`None` as `minimize` answers it).

    What a lower bound needs to rule choices out: where the least sum with g = k already
    exceeds what a known plan costs, no better plan takes k. One pass up (the elimination:
    each step's minimum a message over its neighbours, to the step that eliminates the first
    of them) and one pass down: a step's tables plus what lies beyond it (its own neighbours'
    share of the rest), minimized onto the neighbours of each step whose message it got,
    less that message, is what lies beyond that step. About three times the work of
    `minimize`."""
    forward = _forward(sizes, factors, max_entries, keep=True)
    if forward is None:
        return None
    passed, constant = forward
    receiver: dict[tuple[int, ...], int] = {}
    for i, step in enumerate(passed):
        for scope, _ in step.bucket:
            receiver.setdefault(scope, i)
    # Each step's message goes into the bucket of the step that pops its scope; what lies
    # beyond a step (`outside`, over its neighbours) comes down from that step.
    children: list[list[int]] = [[] for _ in passed]
    for c, step in enumerate(passed):
        if step.neighbours:
            children[receiver[step.neighbours]].append(c)
    outside: list[np.ndarray | None] = [None] * len(passed)
    marginal: dict[int, np.ndarray] = {}  # by group
    component: dict[int, float] = {}  # each root's minimum: the least of its component
    root_of = list(range(len(passed)))
    for p in reversed(range(len(passed))):
        step, g = passed[p], passed[p].group
        # The neighbours laid out by size, the largest last, as `_eliminate` does: minima
        # over the small axes are then passes along the large one.
        layout = tuple(sorted(step.neighbours, key=lambda h: (sizes[h], h)))
        above = outside[p]
        if above is None:
            beyond = np.zeros(tuple(sizes[h] for h in layout))
        else:
            beyond = np.transpose(above, [step.neighbours.index(h) for h in layout])
        down = {c: np.empty(tuple(sizes[h] for h in passed[c].neighbours)) for c in children[p]}
        least = np.empty(sizes[g])
        # g's choices a block at a time, each block's table over (g, neighbours) in memory.
        block = max(1, tuning.BLOCK // max(1, beyond.size))
        for first in range(0, sizes[g], block):
            ks = slice(first, min(first + block, sizes[g]))
            here = np.empty((ks.stop - ks.start, *beyond.shape))
            spread = [beyond[None]]
            spread += [_spread(table, scope, g, ks, layout) for scope, table in step.bucket]
            _Summation.of(here, spread).into(here, spread)
            least[ks] = here.reshape(here.shape[0], -1).min(axis=1)
            # A message is constant along the axes its scope leaves out: the minimum over
            # them less the message is the minimum of the table less the message, one
            # minimum per scope, over the block's table only once.
            lowest: dict[tuple[int, ...], np.ndarray] = {}
            for c in children[p]:
                child = passed[c]
                if child.neighbours not in lowest:
                    rest = tuple(1 + i for i, h in enumerate(layout) if h not in child.neighbours)
                    lowest[child.neighbours] = np.min(here, axis=rest) if rest else here
                kept = [g] + [h for h in layout if h in child.neighbours]
                at = (slice(None),) * child.neighbours.index(g) + (ks,)
                order = [kept.index(h) for h in child.neighbours]
                down[c][at] = np.transpose(lowest[child.neighbours], order) - child.least[at]
        for c in children[p]:
            outside[c] = down[c]
            root_of[c] = root_of[p]
        marginal[g] = least
        if not step.neighbours:
            component[p] = float(least.min())
    step_of = {step.group: p for p, step in enumerate(passed)}
    total = sum(component.values()) + constant
    return [
        marginal[g] + (total - component[root_of[step_of[g]]]) if g in step_of
        else np.full(n, float(total))
        for g, n in enumerate(sizes)
    ]  # fmt: skip


@dataclass(frozen=True)
class _Step:
    """Group g eliminated: `least` is the minimum over g's choices of the tables it summed, a
    table over its neighbours (in their order), and `best[k...]` g's choice reaching it for
    the neighbours' choices k (None for a large step: `choose` sums the tables at those
    choices alone). `bucket`: those tables, kept for `min_marginals` and where `best` is
    None."""

    group: int
    neighbours: tuple[int, ...]
    best: np.ndarray | None
    least: np.ndarray
    bucket: tuple[tuple[tuple[int, ...], np.ndarray], ...]

    def choose(self, choice: Sequence[int]) -> int:
        """g's best choice, its neighbours' in `choice` (the first of the least)."""
        if self.best is not None:
            return int(self.best[tuple(choice[h] for h in self.neighbours)])
        total = sum(
            table[tuple(slice(None) if h == self.group else choice[h] for h in scope)]
            for scope, table in self.bucket
        )
        return int(np.argmin(total))


def _forward(
    sizes: Sequence[int],
    factors: Sequence[Factor],
    max_entries: int,
    keep: bool,
    remembered: Steps | None = None,
) -> tuple[list[_Step], float] | None:
    """The elimination in the greedy order, each step's minimum passed on as a table over
    its neighbours, and the sum of the tables over groups of one choice alone; `None`
    (nothing built) when a step's table would pass `max_entries`. Groups of one choice are
    taken out of every table first: they cost an order nothing, and a table over a group and
    a hundred of them (a hand plan's annotations leave many one choice) has too many axes
    for numpy."""
    for f in factors:
        if any(g >= len(sizes) for g in f.scope):
            raise ValueError(f"factor over {f.scope} names a group beyond the {len(sizes)} groups")
        if f.table.shape != (want := tuple(sizes[g] for g in f.scope)):
            raise ValueError(
                f"factor over {f.scope} has a table of shape {f.table.shape}; its groups have "
                f"{want} choices"
            )
    tables: dict[tuple[int, ...], np.ndarray] = {}
    holding: dict[int, set[tuple[int, ...]]] = {}  # the scopes of the tables over each group

    def add(scope: tuple[int, ...], table: np.ndarray) -> None:
        tables[scope] = tables[scope] + table if scope in tables else table
        for g in scope:
            holding.setdefault(g, set()).add(scope)

    constant = 0.0
    for f in factors:  # same scope: one table
        scope = tuple(g for g in f.scope if sizes[g] > 1)
        table = f.table[tuple(slice(None) if sizes[g] > 1 else 0 for g in f.scope)]
        if scope:
            add(scope, table)
        else:
            constant += float(table)
    order, largest = elimination_order(sizes, list(tables), max_entries)
    if largest > max_entries:
        return None
    steps = []
    for g, neighbours in order:
        bucket = [(scope, tables.pop(scope)) for scope in sorted(holding.pop(g))]
        for scope, _ in bucket:
            for h in scope:
                if h != g:
                    holding[h].discard(scope)
        if remembered is None:
            least, best = _eliminate(g, neighbours, bucket, sizes)
        else:
            least, best = remembered.eliminated(g, neighbours, bucket, sizes, _eliminate)
        kept = tuple(bucket) if keep or best is None else ()
        steps.append(_Step(g, neighbours, best, least, kept))
        if neighbours:
            add(neighbours, least)
    return steps, constant


def _spread(
    table: np.ndarray, scope: tuple[int, ...], g: int, ks: slice, onto: tuple[int, ...]
) -> np.ndarray:
    """A table over `scope` at g's choices `ks`, as a table over (g, *onto) to broadcast: g's
    axis first (of one entry when g is not in `scope`), its other axes spread over `onto`."""
    if g in scope:
        table = np.moveaxis(table, scope.index(g), 0)[ks]
        scope = tuple(h for h in scope if h != g)
    else:
        table = table[None]
    axes = sorted(range(len(scope)), key=lambda i: onto.index(scope[i]))
    shape = [table.shape[0]] + [1] * len(onto)
    for i in axes:
        shape[1 + onto.index(scope[i])] = table.shape[1 + i]
    return np.transpose(table, [0] + [1 + i for i in axes]).reshape(shape)


def _eliminate(
    g: int,
    neighbours: tuple[int, ...],
    bucket: Sequence[tuple[tuple[int, ...], np.ndarray]],
    sizes: Sequence[int],
) -> tuple[np.ndarray, np.ndarray | None]:
    """min and argmin over g of the sum of the `bucket`'s tables, as tables over the
    neighbours. A large step keeps a running minimum over g's choices, each a pass over a
    table of the neighbours' size; one large table with g's axis first would be several times
    slower (numpy's argmin along it leaves the cache) and several times the memory. Its argmin
    is not kept (None): only the choice at the neighbours' best choices is ever asked
    (`_Step.choose`), and keeping it takes two more passes a choice of g."""
    # Summed over the neighbours in order of size, the largest last: numpy's inner loops run
    # along it, and a long inner loop is fastest.
    layout = sorted(neighbours, key=lambda h: (sizes[h], h))
    shape = tuple(sizes[h] for h in layout)
    # Each table with g's axis first and its other axes spread over the layout; a table over
    # a part of another's scope is added to it first (a pass over a small table saved on each
    # choice of g).
    parts: list[tuple[tuple[int, ...], np.ndarray]] = []
    for scope, table in sorted(bucket, key=lambda part: -part[1].size):
        axes = [scope.index(h) for h in (g, *layout) if h in scope]
        spread = np.transpose(table, axes).reshape(
            sizes[g], *(sizes[h] if h in scope else 1 for h in layout))  # fmt: skip
        into = next((i for i, (wider, _) in enumerate(parts) if set(scope) <= set(wider)), None)
        if into is None:
            parts.append((scope, spread))
        else:
            parts[into] = (parts[into][0], parts[into][1] + spread)
    tables = [table for _, table in parts]
    dtype = np.result_type(*tables)
    back = [layout.index(h) for h in neighbours]
    if sizes[g] * math.prod(shape) <= tuning.SMALL:
        total = np.zeros((sizes[g], *shape), dtype=dtype)
        for part in tables:
            np.add(total, part, out=total)
        best = np.argmin(total, axis=0).astype(np.min_scalar_type(sizes[g] - 1))
        return total.min(axis=0).transpose(back).copy(), best.transpose(back).copy()
    least, here = np.empty(shape, dtype=dtype), np.empty(shape, dtype=dtype)
    summation = _Summation.of(least, [part[0] for part in tables])
    summation.into(least, [part[0] for part in tables])
    for k in range(1, sizes[g]):
        summation.into(here, [part[k] for part in tables])
        np.minimum(least, here, out=least)
    return least.transpose(back).copy(), None


class _Summation:
    """How to sum tables, each over some axes of `shape` (`spans`; of its rank, 1 along the
    others), into a table of that shape: an axis at a time, each table added to the partial
    sum over the first axes that hold it, the axes in the order that leaves the fewest tables
    to the last (and so on back), since a table added at an axis costs a pass over the axes
    so far. BERT's training step on 4x8: a step over groups of 9 x 9 x 27^4 choices sums
    twelve tables of two or three of them; one spans the 9, so it is added last, to a sum of
    the rest over 27^4. Its partial sums' tables are made once and reused."""

    def __init__(
        self, shape: tuple[int, ...], spans: Sequence[frozenset[int]], dtype: np.dtype
    ) -> None:
        order: list[int] = []  # the axes, last first
        left, tables = set(range(len(shape))), list(range(len(spans)))
        while left:
            axis = min(left, key=lambda a: (sum(a in spans[t] for t in tables), -shape[a], a))
            order.append(axis)
            left.discard(axis)
            tables = [t for t in tables if axis not in spans[t]]
        order.reverse()
        level = [max((order.index(a) for a in span), default=0) for span in spans]
        self.levels: list[tuple[np.ndarray | None, list[int]]] = []
        for depth in sorted(set(level)):
            held = set(order[: depth + 1])
            partial = tuple(n if a in held else 1 for a, n in enumerate(shape))
            into = None if partial == shape else np.empty(partial, dtype)
            self.levels.append((into, [t for t, at in enumerate(level) if at == depth]))

    @staticmethod
    def of(out: np.ndarray, tables: Sequence[np.ndarray]) -> _Summation:
        """The summation of these tables into `out`."""
        spans = [frozenset(a for a, n in enumerate(t.shape) if n > 1) for t in tables]
        return _Summation(out.shape, spans, out.dtype)

    def into(self, out: np.ndarray, tables: Sequence[np.ndarray]) -> None:
        """`out[...]` = the sum of `tables`."""
        partial: np.ndarray | None = None
        for held, which in self.levels:
            into = out if held is None else held
            first, *rest = which
            if partial is None:
                into[...] = tables[first]
            else:
                np.add(partial, tables[first], out=into)
            for t in rest:
                np.add(into, tables[t], out=into)
            partial = into
        if partial is not out:
            out[...] = partial


def _value(factors: Sequence[Factor], choice: Sequence[int]) -> float | int:
    """The sum of the tables at `choice`: exact Python ints for int64 tables."""
    values = [f.table[tuple(choice[g] for g in f.scope)].item() for f in factors]
    if all(isinstance(v, int) for v in values):
        return sum(values)
    return math.fsum(values)

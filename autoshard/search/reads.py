"""The reads of each value priced as the program makes its reshards: once per value and
sharding, however many ops read it so.

Materialization reshards a value for its first reader needing a sharding and lets every later
reader needing the same sharding use that tensor (a training step's backward reshards a weight
or input again: its forward's tensors of it are gone). So the search prices a value's reads
together (`ValueReads`: the reads of one value in one stretch of the program where its
reshards are kept), not each alone:

- readers in one group: under each of its choices, each distinct sharding its members read
  the value in is paid once (a constant per choice, or a matrix on the edge from the value's
  group);
- readers in several groups that may read it alike (q, k and v projections of one normalized
  hidden state, a residual read by a layer norm and an add): a *shared reshard* group of its
  own, whose choices are pairs (H, L): the value is held in H, and resharded to L once for
  every reader needing L. Its edge from the value's group forbids the pairs whose H is not
  what that group holds; the edges to the readers price only what they read otherwise than H
  and L. Worked example: a value held in H by group a is read by groups b and c, both needing
  L under their choices kb, kc. The pair (H, L) costs H->L once; the reads cost nothing more;
  the pair (H, H) costs nothing itself and H->L on both reader edges: the solver takes
  (H, L), and the objective is the program's one reshard.

One shared sharding per value is priced once across groups: where readers of several groups
need two shardings other than the held one each, the second is paid per group (an
over-count the search has, the program not). So is every sharding of a value whose readers
run unlike (a training step's micro-batches against its optimizer): the program pays a reshard
at the runs of its first reader, whichever group's it is. And so is every sharding of a value
whose shared reshard group would have more than `tuning.SHARED_PAIRS` choices.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from autoshard.deadline import NEVER, Deadline
from autoshard.search.solver import tuning
from autoshard.sharding import Sharding

Pricer = Callable[[str, tuple[Sharding, ...], tuple[Sharding, ...]], np.ndarray]
"""The reshard costs of value `name` from each held to each needed sharding (a matrix)."""


@dataclass(frozen=True)
class Reading:
    """A read of a value by a member of group `group` (an op's operand, the return, a training
    step's update): the sharding it needs under each choice of its group, the runs per step of
    the op it serves, and what the read is known by (the same for its copies in repeated
    layers)."""

    group: int
    needs: tuple[Sharding, ...]
    runs: int
    key: Hashable


@dataclass(frozen=True)
class ValueReads:
    """The reads of value `value` (held as group `group`'s choices say) in program order,
    within one stretch of the program where a reshard of it made is kept."""

    value: str
    group: int
    held: tuple[Sharding, ...]
    reads: tuple[Reading, ...]


@dataclass
class PricedReads:
    """The reads' costs: added to each group's choices (`node`), on the edges between two
    groups (`edges`, the `forbidden` cells a plan may not take), with the reshards per choice
    beside them (`node_moves`, `edge_moves`); `sizes` are the groups' sizes, the shared
    reshard groups appended."""

    sizes: list[int]
    node: list[np.ndarray]
    node_moves: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    edge_moves: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    forbidden: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def add_edge(self, a: int, b: int, cost: np.ndarray, moves: np.ndarray) -> None:
        shape = (self.sizes[a], self.sizes[b])
        self.edges.setdefault((a, b), np.zeros(shape))[...] += cost
        self.edge_moves.setdefault((a, b), np.zeros(shape, np.int64))[...] += moves

    def add_group(self, cost: np.ndarray, moves: np.ndarray) -> int:
        self.sizes.append(len(cost))
        self.node.append(cost.astype(float))
        self.node_moves.append(moves.astype(np.int64))
        return len(self.sizes) - 1


def price_reads(
    reads: Sequence[tuple[ValueReads, int]],
    sizes: Sequence[int],
    pricer: Pricer,
    deadline: Deadline = NEVER,
) -> PricedReads:
    """Each value's reads (times the copies it stands for) priced as the module's docstring
    says; `TimeUp` where `deadline` passes first."""
    priced = PricedReads(
        list(sizes),
        [np.zeros(n) for n in sizes],
        [np.zeros(n, np.int64) for n in sizes],
    )
    for done, (value_reads, count) in enumerate(reads):
        deadline.check("building the problem", f"{done} of {len(reads)} reads priced")
        by_group: dict[int, list[Reading]] = {}
        for read in value_reads.reads:
            by_group.setdefault(read.group, []).append(read)
        pairs = _shared_pairs(value_reads, by_group, pricer)
        if 0 < len(pairs) <= tuning.SHARED_PAIRS:
            _price_shared(priced, value_reads, by_group, pairs, count, pricer)
            continue
        a, held = value_reads.group, value_reads.held
        for b, group_reads in by_group.items():
            cost, moves = _distinct(value_reads.value, held, group_reads, pricer, a == b)
            if a == b:
                priced.node[a] += count * np.diagonal(cost)
                priced.node_moves[a] += count * np.diagonal(moves)
            else:
                priced.add_edge(a, b, count * cost, count * moves)
    return priced


def _shared_pairs(
    value_reads: ValueReads, by_group: dict[int, list[Reading]], pricer: Pricer
) -> list[tuple[Sharding, Sharding]]:
    """The choices (H, L) of a value's shared reshard group: held in H, resharded once to L
    (at a cost: a free reshard needs no sharing); none where no sharding may be read by two
    groups, or the reads run unlike (the reshard is paid at the runs of the first reader,
    whichever it is)."""
    if len(by_group) < 2 or len({read.runs for read in value_reads.reads}) > 1:
        return []
    seen: dict[Sharding, set[int]] = {}
    for b, group_reads in by_group.items():
        for read in group_reads:
            for need in read.needs:
                seen.setdefault(need, set()).add(b)
    # A partial sharding is read as made, never made once for several groups.
    shared = tuple(
        need for need, groups in seen.items() if len(groups) > 1 and not need.partial_axes
    )
    held = tuple(dict.fromkeys(value_reads.held))
    costs = pricer(value_reads.value, held, shared) if shared else np.zeros((len(held), 0))
    rows, columns = np.nonzero(costs > 0)  # row-major: by held sharding, then by need
    pairs = [(held[i], shared[j]) for i, j in zip(rows.tolist(), columns.tolist(), strict=True)]
    return [(h, h) for h in held] + pairs if pairs else []


def _firsts(reads: Sequence[Reading]) -> np.ndarray:
    """Under each choice (columns), whether each read (rows) is the first of `reads` to need
    its sharding: in one pass over the reads, however many (a value every layer reads)."""
    ids = np.stack(_ids(*(read.needs for read in reads)))  # reads x choices
    count, choices = ids.shape
    # Row-major, a (sharding, choice) key's first occurrence is its earliest read.
    keys = ids * choices + np.arange(choices)
    first = np.zeros(count * choices, bool)
    first[np.unique(keys.ravel(), return_index=True)[1]] = True
    return first.reshape(count, choices)


def _ids(*lists: Sequence[Sharding]) -> list[np.ndarray]:
    """Integer ids of the shardings of each list, equal where the shardings are."""
    index: dict[Sharding, int] = {}
    return [np.array([index.setdefault(s, len(index)) for s in shardings]) for shardings in lists]


def _distinct(
    value: str,
    held: tuple[Sharding, ...],
    reads: Sequence[Reading],
    pricer: Pricer,
    same: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """The cost and the reshards of one group's reads from each held sharding, under each of
    the group's choices: each distinct sharding read paid once, at its first reader's runs."""
    cost = np.zeros((len(held), len(reads[0].needs)))
    moves = np.zeros(cost.shape, np.int64)
    for read, first in zip(reads, _firsts(reads), strict=True):
        cost += read.runs * _priced(pricer, value, held, read.needs, same) * first
        moves += _differ(held, read.needs) * first
    return cost, moves


def _priced(
    pricer: Pricer,
    value: str,
    held: tuple[Sharding, ...],
    needs: tuple[Sharding, ...],
    same: bool,
) -> np.ndarray:
    """`pricer`'s matrix; where the holder and the reader are one group (`same`), only its
    diagonal is a plan (one choice holds and reads), the rest zero: a choice may hold a value
    whole where another reads it as its own partial sums, which no reshard makes."""
    if not same:
        return pricer(value, held, needs)
    holds: dict[Sharding, int] = {}
    reads: dict[Sharding, int] = {}
    rows = [holds.setdefault(h, len(holds)) for h in held]
    columns = [reads.setdefault(n, len(reads)) for n in needs]
    distinct = pricer(value, tuple(holds), tuple(reads))
    cost = np.zeros((len(held), len(needs)))
    np.fill_diagonal(cost, distinct[rows, columns])
    return cost


def _differ(held: Sequence[Sharding], need: Sequence[Sharding]) -> np.ndarray:
    """1 where `held[i]` differs from `need[j]`."""
    return np.not_equal.outer(*_ids(held, need)).astype(np.int64)


def _price_shared(
    priced: PricedReads,
    value_reads: ValueReads,
    by_group: dict[int, list[Reading]],
    pairs: list[tuple[Sharding, Sharding]],
    count: int,
    pricer: Pricer,
) -> None:
    """A shared reshard group for the value: its pairs (H, L) priced at H->L once, its edge
    from the value's group forbidding the other H, its edges to the readers pricing what they
    read otherwise than L (the module's docstring)."""
    value, a, held = value_reads.value, value_reads.group, value_reads.held
    runs = value_reads.reads[0].runs
    hs, ls = tuple(h for h, _ in pairs), tuple(target for _, target in pairs)
    once = np.diagonal(_priced(pricer, value, hs, ls, True))
    v = priced.add_group(count * runs * once, count * np.not_equal(*_ids(hs, ls)))
    forbidden = np.not_equal.outer(*_ids(held, hs))
    link = np.zeros((len(held), len(pairs)))
    link_moves = np.zeros(link.shape, np.int64)
    for b, group_reads in by_group.items():
        for read, first in zip(group_reads, _firsts(group_reads), strict=True):
            other = np.not_equal.outer(*_ids(read.needs, ls))  # need x pair
            if b == a:  # the value's own group reads it: priced on the edge to the pairs
                paired = _priced(pricer, value, held, read.needs, True)
                rows = count * read.runs * np.diagonal(paired) * first
                link += rows[:, None] * other
                moved = count * np.diagonal(_differ(held, read.needs)) * first
                link_moves += moved[:, None] * other
            else:
                mask = first[None, :] * other.T
                priced.add_edge(
                    v, b, count * read.runs * pricer(value, hs, read.needs) * mask,
                    count * _differ(hs, read.needs) * mask,
                )  # fmt: skip
    priced.add_edge(a, v, link, link_moves)
    priced.forbidden[(a, v)] = priced.forbidden.get((a, v), np.zeros(link.shape, bool)) | forbidden

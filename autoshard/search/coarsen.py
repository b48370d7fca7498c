"""Repeated layers: find the structurally identical blocks of a graph so the search solves one.

Each op gets a structural signature: its type, attributes, the shapes and dtypes of its inputs
and outputs, and for each input where it comes from (a weight, a constant of some value, a
graph input, or an op). Ops of identical layers have identical signatures at the same offsets,
so the layers are a periodic run of the signature sequence:

    signatures   E E | a b c d | a b c d | a b c d | h     period 4, three repeats from op 2

`find_repeats` returns the run covering the most ops (period x repeats, the period a whole
block); the k-th op of every repeat then shares the decision variables of the k-th op of the
first, with its costs added in (the ILP solves one layer, however deep the model).

Sharing only asks that copies have the same candidates (same rule, same shapes); the costs are
still those of each op's own edges, so the signature need not pin the wiring: a causal mask
computed once and read by every layer is fine.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from autoshard.ir.graph import Graph


@dataclass(frozen=True)
class Repeats:
    """Ops `start + j*period + k` for j < count are copies of op `start + k`."""

    start: int
    period: int
    count: int

    def first(self, index: int) -> int:
        """The op of the first repeat that op `index` copies (itself outside the run)."""
        offset = index - self.start
        if offset < 0 or offset >= self.period * self.count:
            return index
        return self.start + offset % self.period

    @property
    def ops(self) -> int:
        return self.period * self.count


NONE = Repeats(0, 1, 1)


def signatures(graph: Graph) -> list[int]:
    produced = {out for op in graph.ops for out in op.outputs if out}
    table: dict[tuple, int] = {}
    result = []
    for op in graph.ops:
        key = (
            op.type,
            op.domain,
            hash(op.attrs),
            tuple(_origin(graph, name, produced) for name in op.inputs),
            tuple(_type(graph, name) for name in op.outputs),
        )
        result.append(table.setdefault(key, len(table)))
    return result


def _type(graph: Graph, name: str) -> tuple:
    if not name:
        return ()
    value = graph.values[name]
    return (value.shape, value.dtype)


def _origin(graph: Graph, name: str, produced: set[str]) -> tuple:
    if not name:
        return ("absent",)
    if name in produced:
        return ("op", _type(graph, name))
    if name in graph.constants:
        array = np.ascontiguousarray(graph.constants[name])
        return ("constant", array.dtype.str, array.shape, hashlib.sha1(array.tobytes()).digest())
    kind = "weight" if name in graph.weights else "input"
    return (kind, _type(graph, name))


def find_repeats(graph: Graph, min_period: int = 2) -> Repeats:
    """The periodic run of op signatures covering the most ops (ties: the shortest period,
    then the earliest start); `NONE` when nothing repeats."""
    seq = np.array(signatures(graph), dtype=np.int64)
    n = len(seq)
    best, covered = NONE, 0
    for period in range(min_period, n // 2 + 1):
        same = seq[:-period] == seq[period:]
        # Runs of `same`: a run of length r starting at s makes ops s .. s+r+period-1 periodic.
        edges = np.flatnonzero(np.diff(np.concatenate(([0], same.astype(np.int8), [0]))))
        for s, e in zip(edges[::2], edges[1::2], strict=True):
            count = (e - s + period) // period
            if count >= 2 and count * period > covered:
                best, covered = Repeats(int(s), period, int(count)), count * period
    return best


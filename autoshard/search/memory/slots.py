"""Where the memory model's program steps sit: one slot per step of the program a plan lowers
to, laid out once for every plan.

`materialize` emits, for each op p in graph order, the reshard of each operand i (a few
collectives, one step each) and then the op; at the end, the reshards of the graph outputs.
So op p's slots are PRE(p, i, k) for step k of operand i's reshard (as many k as the longest
reshard counted there), then AT(p), its compute step; the outputs' are END(i, k), the last of
them the step where everything returned is live.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.ir.graph import Graph
from autoshard.sharding import Sharding

Read = tuple[int, int, int | None, tuple[Sharding, ...]]
"""A read: the program position of the reading op (`len(graph.ops)` for the graph outputs),
the operand it is (the output, at the end), the reader's deciding group, and the sharding it
reads in under each of the group's choices."""

Ref = tuple[int, int]
"""Slot `first[positions[u]] + offset` as (u, offset), `positions` the reading positions of the
value a mark is made for and `first[p]` the first slot of position p (PRE(p, 0))."""


@dataclass(frozen=True, eq=False)
class SlotLayout:
    """The slots of every position p (an op, or `ops` for the graph outputs):
    PRE(p, i, k) = `first[p] + starts[p][i] + k`, AT(p) = `first[p] + widths[p]` (an op's),
    and `slots` in all. `first_array` is `first` as an array, for placing marks in bulk."""

    ops: int
    starts: tuple[tuple[int, ...], ...]
    widths: tuple[int, ...]
    first: tuple[int, ...]
    first_array: np.ndarray

    @property
    def slots(self) -> int:
        return self.first[-1]

    def at_offset(self, position: int) -> int:
        """The offset of AT(p) in its position's slots (at the end: the last END slot, where
        everything returned is live)."""
        return self.widths[position] - (position == self.ops)

    def at(self, position: int) -> int:
        return self.first[position] + self.at_offset(position)


def slot_layout(
    graph: Graph,
    reads: Callable[[str], Sequence[Read]],
    longest: Callable[[str, tuple[Sharding, ...]], int],
) -> SlotLayout:
    """The slots of the program of every plan: each operand's reshard as many steps as the
    longest reshard of a value to the shardings its reader may need (`longest`), at least one;
    each op one more, its compute step."""
    steps: dict[tuple[int, int], int] = {}
    for name in graph.values:
        for p, i, _, needs in reads(name):
            steps[(p, i)] = max(steps.get((p, i), 1), longest(name, needs))
    widths, starts = [], []
    for p, count in enumerate([len(op.inputs) for op in graph.ops] + [len(graph.outputs)]):
        lengths = [steps.get((p, i), 1) for i in range(max(1, count))]
        starts.append((0, *np.cumsum(lengths).tolist()))
        widths.append(sum(lengths))
    spans = [w + 1 for w in widths[:-1]] + widths[-1:]
    first_array = np.concatenate([[0], np.cumsum(spans)]).astype(np.int64)
    return SlotLayout(
        len(graph.ops), tuple(starts), tuple(widths), tuple(first_array.tolist()), first_array
    )

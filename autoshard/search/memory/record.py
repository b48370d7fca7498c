"""Recording a value's live terms once and replaying them for its copies.

A value's marks (bytes live from one slot to another when a literal holds) are recorded
relative to its reading positions (`Recorder`), so that the copies of a repeated layer, which
read alike at their own positions, replay one recording (`Terms.replay`) instead of working
out the same conditions again. `Terms` gathers every term at its slots, for the row assembly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autoshard.search.memory.rows import Chosen, Literal
from autoshard.search.memory.slots import Read, Ref, SlotLayout

Mark = tuple[Ref, Ref, Literal | bool, int]
"""Bytes live from one slot to another (both as `Ref`s) when a literal holds."""


class Recorder:
    """The marks of one value, its slots named relative to anchors (`Ref`): the first slot of
    each of its reading positions (program positions, ascending), and, for each of its reads
    among the graph outputs, the first slot of that output's reshard. The copies of a repeated
    layer return their values at outputs of their own: named from the output's own slots,
    their marks coincide, as those of the layers' ops do."""

    def __init__(self, layout: SlotLayout, readings: Sequence[Read]) -> None:
        self.layout = layout
        self.positions = sorted({r[0] for r in readings})
        self.rank = {p: u for u, p in enumerate(self.positions)}
        ends = sorted({i for p, i, *_ in readings if p == layout.ops})
        self.output = {i: len(self.positions) + k for k, i in enumerate(ends)}
        end = layout.first[layout.ops]
        self.anchors = [layout.first[p] for p in self.positions]
        self.anchors += [end + layout.starts[layout.ops][i] for i in ends]
        self.marks: list[Mark] = []

    def mark(self, first: Ref, last: Ref, literal: Literal | bool, amount: int) -> None:
        """`amount` bytes at slots first..last when `literal` holds."""
        if literal is not False and amount:
            self.marks.append((first, last, literal, amount))

    def slot(self, ref: Ref) -> int:
        """The slot a reference names, at the value's anchors."""
        u, offset = ref
        return self.anchors[u] + offset

    def outputs_shape(self) -> tuple:
        """How the value's reads among the graph outputs sit against each other and the last
        slot (AT of the end): where two copies agree, their marks are named alike. Each read's
        reshard spans its output's steps, the marks compare their slots with the last slot and
        with the slot before another output's: farther than that is alike."""
        layout = self.layout
        starts, last = layout.starts[layout.ops], layout.at(layout.ops)
        widths = {i: starts[i + 1] - starts[i] for i in self.output}
        return tuple(
            (
                widths[i],
                min(last - self.anchors[u], widths[i] + 2),
                tuple(min(self.anchors[v] - self.anchors[u], widths[i] + 2)
                      for v in self.output.values() if v > u),
            )
            for i, u in self.output.items()
        )  # fmt: skip

    def pre_ref(self, read: Read, step: int = 0) -> Ref:
        """PRE(p, i, step) of a read: where `materialize` reshards the operand."""
        p, i, layout = read[0], read[1], self.layout
        if p != layout.ops:
            return (self.rank[p], layout.starts[p][i] + step)
        # The last output's last step is the end's AT: one slot, named one way (refs key
        # the events of a slot).
        offset = layout.starts[p][i] + step
        return (self.rank[p], offset) if offset == layout.at_offset(p) else (self.output[i], step)

    def at_ref(self, read: Read, over: bool = False) -> Ref:
        """Where a read as held reads the home tensor: the reader's compute step; but an update
        writing over the value (`over`, the last reader) frees it before its results, so its
        last reshard step."""
        p = read[0]
        if over and p == self.positions[-1]:
            return (self.rank[p], self.layout.widths[p] - 1)  # its last reshard step
        return (self.rank[p], self.layout.at_offset(p))

    def last_home_read(self, readings: Sequence[Read], over: bool) -> Ref:
        """The last slot where some plan reads the home tensor."""
        return max((self.at_ref(r, over) for r in readings), key=self.slot)


class Terms:
    """The rows' terms at their slots: fixed bytes as a difference array over the slots;
    group terms as spans of slots (firsts, lasts, columns of choices, bytes), a held shard's
    one span, a mark's one per copy; indicator terms as spans (firsts, lasts, indicator,
    bytes). A group's choices are columns `offsets[g]` on."""

    def __init__(self, layout: SlotLayout, sizes: Sequence[int]) -> None:
        self.layout = layout
        self.offsets = np.cumsum([0, *sizes])
        self.fixed = np.zeros(layout.slots + 1, dtype=np.int64)
        self.held_spans: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        self.chosen_marks: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = []
        self.indicated: list[tuple[np.ndarray, np.ndarray, int, int]] = []
        self.columns: dict[Chosen, np.ndarray] = {}

    def add_fixed(self, first: int, last: int, amount: int) -> None:
        self.fixed[first] += amount
        self.fixed[last + 1] -= amount

    def add_held(self, group: int, first: int, last: int, amounts: np.ndarray) -> None:
        """Group `group`'s choice k holds `amounts[k]` bytes over slots first..last."""
        start = int(self.offsets[group])
        self.held_spans.append((first, last, np.arange(start, start + len(amounts)), amounts))

    def replay(self, marks: Sequence[Mark], anchors: np.ndarray) -> None:
        """A value's marks at the anchors of each of its copies (`anchors`: a row of slots per
        copy, `Recorder.anchors`), all copies at once."""
        refs = np.array([(*first, *last) for first, last, _, _ in marks], np.int64)
        starts = anchors[:, refs[:, 0]] + refs[:, 1]  # copies x marks
        stops = anchors[:, refs[:, 2]] + refs[:, 3]
        for j, (_, _, literal, amount) in enumerate(marks):
            live = starts[:, j] <= stops[:, j]
            first, last = starts[live, j], stops[live, j]
            if not len(first):
                continue
            if literal is True:
                np.add.at(self.fixed, first, amount)
                np.add.at(self.fixed, last + 1, -amount)
            elif isinstance(literal, Chosen):  # plain terms of its group, added in bulk later
                columns = self.columns.get(literal)
                if columns is None:
                    start = int(self.offsets[literal.group])
                    columns = self.columns[literal] = np.array(sorted(literal.choices)) + start
                self.chosen_marks.append((first, last, columns, amount))
            else:
                self.indicated.append((first, last, literal, amount))

"""The search's memory model: the bytes each device holds at every step of the program a plan
lowers to, as a linear function of the choices, so that the ILP's memory is the program's.

Materialization (`passes/materialize.py`) emits, for each op in graph order, the reshards of
its operands one by one, each a few collectives, and then the op; then the reshards of the
graph outputs. The model has a slot per program step: PRE(p, i, k) for step k of the reshard
of op p's operand i (as many k as the longest reshard counted there), AT(p) for its compute
step, END(i, k) for the outputs' reshards; and a row per distinct slot. What is live there:

- resident tensors (graph inputs, weights, constants): at their held sharding, in every slot;
  but in a training step a weight or optimizer state its update writes over is live until
  that update (where its next value takes its place), and a gradient accumulated over
  micro-batches is live from the first slot;
- a value's home tensor (as held): from where it is made to its last read, less savings where
  no later read reads it (`add_home`): a read of s at (p, i) reads the home at AT(p) when s is
  the held sharding, at PRE(p, i, 0) when no buffer of s is live there (its first read, and
  not made on the way of another reshard), else not at all;
- reshard buffers: a value read in a sharding s other than the one it is held in is resharded
  once, at the first read of s (made by the reshard's last step), and the buffer lives until
  the last read of s. With P(t) "made at or before t" and Q(t) "read at or after t", it is
  live at t exactly when held != s and P(t) and Q(t);
- a weight (an input, a constant) is resharded again for a training step's backward, not kept
  from its forward (FSDP gathers a weight before each use): its buffers are counted apart;
- the tensors a reshard of several collectives makes on its way: live at the step making one
  and the next (reading it); those `materialize` keeps (a reader needs that sharding, or a
  later reshard passes the same way) as buffers, to their last use. For the reshards counted
  (`chains`): most pairs of candidates on a 3-axis mesh take several steps, a plan uses few,
  and counting them all makes the model many times larger (gpt2 on 2x4: 1,110 indicators
  become 18,457); `search.budget` adds those a plan makes, each counted from every held
  sharding to its target (a plan gathering a weight held [[0], [1]] to [[]] is followed by
  one holding it [[1], [0]]: BART's dynamo export on 2x4 at its lowest budget, three solves,
  30 s; two, 19 s).

"Group g chose a choice in K" is a sum of g's one-hot variables (`Chosen`); live conditions are
ANDs and ORs of those (`Indicator`). Where they add bytes to rows bounded from above, the ILP
needs only their lower bounds (an AND is at least the sum of its literals minus their number
plus one, an OR at least each literal); where they take bytes off (savings), only their upper
bounds: either way a solver keeping rows under a budget sets each to its true value or makes
its own life harder (`ilp._memory_rows`). Repeated layers ask for the same conditions and share
them, and their rows coincide (rows are kept once).

Exact for the materialized program (random plans on 1-, 2- and 3-axis meshes, bert on 4x8 at
60 %: rows == program) but for what the model leaves conservative (more than the program
holds): a reshard whose first steps were taken already for another reader (it starts from
their tensor, `materialize`'s reuse) is counted as reading the home.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.cost.model import shard_bytes
from autoshard.errors import ShardingError
from autoshard.ir import dtypes
from autoshard.ir.graph import FORWARD, Graph
from autoshard.mesh import Mesh
from autoshard.reshard import plan_reshard
from autoshard.rules.gradient import accumulated_gradients
from autoshard.search.memory_rows import (
    _NONE,
    Chosen,
    Indicator,
    Literal,
    MemoryRows,
    RunTable,
    _concatenate,
)
from autoshard.sharding import Sharding

# ---- building ---------------------------------------------------------------------------------

Held = tuple[int | None, tuple[Sharding, ...]]
"""How a value is held: its deciding group and its sharding under each of the group's choices
(a constant: no group, one sharding)."""

Chain = tuple[tuple[int, ...], str, Sharding, Sharding]
"""A reshard of a tensor of some shape and dtype from one sharding to another."""

Ref = tuple[int, int]
"""Slot `first[positions[u]] + offset` as (u, offset), `positions` the reading positions of the
value a mark is made for and `first[p]` the first slot of position p (PRE(p, 0))."""

Mark = tuple[Ref, Ref, Literal | bool, int]
"""Bytes live from one slot to another (both as `Ref`s) when a literal holds."""

Read = tuple[int, int, int | None, tuple[Sharding, ...]]
"""A read: the program position of the reading op (`len(graph.ops)` for the graph outputs),
the operand it is (the output, at the end), the reader's deciding group, and the sharding it
reads in under each of the group's choices."""


@dataclass(frozen=True)
class Buffer:
    """When a reshard buffer of a value is live: at each slot of `slots` (ascending, where it
    is made or read) when `at[j]`, and after it to the next when `after[j]`."""

    slots: tuple[int, ...]
    at: tuple[Literal | bool, ...]
    after: tuple[Literal | bool, ...]

    def at_slot(self, slot: int) -> Literal | bool:
        j = bisect.bisect_right(self.slots, slot) - 1
        if j < 0:
            return False
        return self.at[j] if self.slots[j] == slot else self.after[j]


@dataclass(frozen=True)
class MemoryModel:
    """Bytes live at each program step: `base` (one row: live at every step) plus one of
    `rows`."""

    base: MemoryRows
    rows: MemoryRows
    indicators: tuple[Indicator, ...]


def memory_model(
    graph: Graph,
    mesh: Mesh,
    sizes: Sequence[int],
    held: Callable[[str], Held],
    reads: Callable[[str], Sequence[Read]],
    chains: Collection[Chain] = frozenset(),
) -> MemoryModel:
    """The rows of the program of every plan: `held(value)` and `reads(value)` say how each
    value is held and read under the choices. The intermediate tensors of a reshard of
    several collectives are counted for the targets of the `chains` given (from any held
    sharding): on a 3-axis mesh most pairs of
    candidate shardings reshard in several steps, but a plan uses few of them, and the
    search adds those it finds (`search.budget`)."""
    return _Builder(graph, mesh, sizes, held, reads, frozenset(chains)).build()


class _Builder:
    def __init__(
        self,
        graph: Graph,
        mesh: Mesh,
        sizes: Sequence[int],
        held: Callable[[str], Held],
        reads: Callable[[str], Sequence[Read]],
        chains: frozenset[Chain],
    ) -> None:
        self.graph, self.mesh, self.sizes = graph, mesh, list(sizes)
        self.held, self.reads = held, reads
        self.targets = {(shape, dtype, dst) for shape, dtype, _, dst in chains}
        self.indicators: list[Indicator] = []
        self.index: dict[tuple[bool, frozenset[Literal]], int] = {}
        self.offsets = np.cumsum([0, *sizes])
        self.ops = len(graph.ops)
        self.steps_cache: dict[
            tuple[tuple[int, ...], str, Sharding, Sharding], tuple[Sharding, ...]
        ] = {}
        self.choice_sets: dict[int, dict[Sharding, frozenset[int]]] = {}
        self.kept: list[tuple[Sharding, ...]] = []
        self.longest_cache: dict[tuple, int] = {}
        # PRE(p, i, k) for each operand i of op p and each step k of its reshard, then AT(p);
        # at the end END(i, k) for each graph output i.
        self.steps: dict[tuple[int, int], int] = {}
        for name in graph.values:
            for p, i, _, needs in reads(name):
                self.steps[(p, i)] = max(self.steps.get((p, i), 1), self.longest(name, needs))
        widths, self.starts = [], []
        for p, count in enumerate([len(op.inputs) for op in graph.ops] + [len(graph.outputs)]):
            lengths = [self.steps.get((p, i), 1) for i in range(max(1, count))]
            self.starts.append([0, *np.cumsum(lengths).tolist()])
            widths.append(sum(lengths))
        self.widths = widths
        spans = [w + 1 for w in widths[:-1]] + widths[-1:]
        self.first_array = np.concatenate([[0], np.cumsum(spans)]).astype(np.int64)
        self.first = self.first_array.tolist()
        self.slots = slots = int(self.first[-1])
        # Group terms as spans of slots (first, last, columns of choices, bytes), fixed terms
        # as a difference array over slots, indicator terms as spans (first, last, indicator,
        # bytes).
        self.held_spans: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        self.fixed = np.zeros(slots + 1, dtype=np.int64)
        # Indicator terms as spans (firsts, lasts, indicator, bytes): a mark's, in every copy.
        self.indicated: list[tuple[np.ndarray, np.ndarray, int, int]] = []
        self.bytes_cache: dict[tuple[tuple[int, ...], str, Sharding], int] = {}
        self.vectors: dict[tuple[int, tuple[int, ...], str], np.ndarray] = {}
        self.steps_to_cache: dict[tuple, dict[int, Literal | bool]] = {}
        self.passing_cache: dict[tuple, dict[Sharding, list[tuple[Sharding, Sharding]]]] = {}
        self.recording: list[Mark] = []
        self.rank: dict[int, int] = {}  # the reading positions of the value being marked
        self.positions: list[int] = []
        self.columns: dict[Chosen, np.ndarray] = {}
        # Terms of one group's choices as spans (firsts, lasts, columns, bytes), as indicated.
        self.chosen_marks: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = []

    # -- slots: PRE(p, i, k) = first[p] + starts[p][i] + k, AT(p) = first[p] + widths[p] --

    def at_offset(self, position: int) -> int:
        """The offset of AT(p) in its position's slots (at the end: the last END slot, where
        everything returned is live)."""
        return self.widths[position] - (position == self.ops)

    def at(self, position: int) -> int:
        return self.first[position] + self.at_offset(position)

    # -- literals --

    def chosen(
        self, group: int | None, choices: tuple[Sharding, ...], sharding: Sharding, equal: bool
    ) -> Literal | bool:
        """Group `group` takes a choice whose sharding is (`equal`) or is not `sharding`."""
        if group is None:
            return (choices[0] == sharding) == equal
        ks = self.choices_of(choices).get(sharding, frozenset())
        if not equal:
            ks = frozenset(range(self.sizes[group])) - ks
        if not ks:
            return False
        if len(ks) == self.sizes[group]:
            return True
        return Chosen(group, ks)

    def choices_of(self, choices: tuple[Sharding, ...]) -> dict[Sharding, frozenset[int]]:
        """The choices giving each sharding. The tuples of a value's copies in repeated layers
        are one object, so this is worked out once for them."""
        found = self.choice_sets.get(id(choices))
        if found is None:
            table: dict[Sharding, set[int]] = {}
            for k, s in enumerate(choices):
                table.setdefault(s, set()).add(k)
            found = {s: frozenset(ks) for s, ks in table.items()}
            self.choice_sets[id(choices)] = found
            self.kept.append(choices)  # alive, so that its id stays its own
        return found

    def combine(self, every: bool, literals: Sequence[Literal | bool]) -> Literal | bool:
        """AND (`every`) or OR of literals, simplified: constants folded, literals on one group
        merged (intersection or union of its choices), repeated conditions shared."""
        merged: dict[int, frozenset[int]] = {}
        rest: set[int] = set()
        for lit in literals:
            if isinstance(lit, bool):
                if lit != every:  # False in an AND, True in an OR decides it
                    return lit
                continue
            if isinstance(lit, Chosen):
                have = merged.get(lit.group)
                if have is None:
                    merged[lit.group] = lit.choices
                else:
                    merged[lit.group] = have & lit.choices if every else have | lit.choices
            else:
                rest.add(lit)
        found: set[Literal] = set(rest)
        for group, ks in merged.items():
            if not ks:
                if every:
                    return False
                continue
            if len(ks) == self.sizes[group]:
                if not every:
                    return True
                continue
            found.add(Chosen(group, ks))
        if not found:
            return every
        if len(found) == 1:
            return next(iter(found))
        signature = (every, frozenset(found))
        if signature not in self.index:
            ordered = sorted(found, key=_order)
            self.index[signature] = len(self.indicators)
            self.indicators.append(Indicator(every, tuple(ordered)))
        return self.index[signature]

    # -- terms --

    def nbytes(self, value: str, sharding: Sharding) -> int:
        info = self.graph.values[value]
        cache_key = (info.shape, info.dtype, sharding)
        if cache_key not in self.bytes_cache:
            self.bytes_cache[cache_key] = shard_bytes(info.shape, info.dtype, sharding, self.mesh)
        return self.bytes_cache[cache_key]

    def add_held(self, value: str, first: int, last: int) -> None:
        """The held shard of `value` over slots first..last."""
        group, shardings = self.held(value)
        if last < first:
            return
        if group is None:
            amount = self.nbytes(value, shardings[0])
            self.fixed[first] += amount
            self.fixed[last + 1] -= amount
            return
        start = int(self.offsets[group])
        info = self.graph.values[value]
        cache_key = (id(shardings), info.shape, info.dtype)  # alike in repeated layers
        vector = self.vectors.get(cache_key)
        if vector is None:
            vector = np.array([self.nbytes(value, s) for s in shardings], dtype=np.int64)
            self.vectors[cache_key] = vector
            self.kept.append(shardings)  # alive, so that its id stays its own
        self.held_spans.append((first, last, np.arange(start, start + len(vector)), vector))

    def mark(self, first: Ref, last: Ref, literal: Literal | bool, amount: int) -> None:
        """`amount` bytes at slots first..last when `literal` holds (recorded relative to the
        value's reading positions, to be replayed for its copies in other layers)."""
        if literal is not False and amount:
            self.recording.append((first, last, literal, amount))

    def replay(self, marks: Sequence[Mark], positions: np.ndarray) -> None:
        """A value's marks at the reading positions of each of its copies (`positions`: a row
        per copy), all copies at once: a repeated layer's are made once, replayed here."""
        refs = np.array([(*first, *last) for first, last, _, _ in marks], np.int64)
        starts = self.first_array[positions[:, refs[:, 0]]] + refs[:, 1]  # copies x marks
        stops = self.first_array[positions[:, refs[:, 2]]] + refs[:, 3]
        for j, (_, _, literal, amount) in enumerate(marks):
            live = starts[:, j] <= stops[:, j]
            first, last = starts[live, j], stops[live, j]
            if not len(first):
                continue
            if literal is True:
                np.add.at(self.fixed, first, amount)
                np.add.at(self.fixed, last + 1, -amount)
            elif isinstance(literal, Chosen):  # plain terms of its group, added in bulk by `rows`
                columns = self.columns.get(literal)
                if columns is None:
                    start = int(self.offsets[literal.group])
                    columns = self.columns[literal] = np.array(sorted(literal.choices)) + start
                self.chosen_marks.append((first, last, columns, amount))
            else:
                self.indicated.append((first, last, literal, amount))

    # -- the model --

    def build(self) -> MemoryModel:
        graph = self.graph
        produced_at = {o: p for p, op in enumerate(graph.ops) for o in op.outputs if o}
        accumulated = accumulated_gradients(graph)
        replays: dict[tuple, list[Mark]] = {}
        copies: dict[tuple, list[list[int]]] = {}  # the reading positions of each copy
        for name in graph.values:
            readings = sorted(self.reads(name), key=lambda r: (r[0], r[1]))
            positions = sorted({r[0] for r in readings})
            # The home tensor (the value as held): from where it is made (a resident one,
            # or a gradient accumulated over micro-batches: from the start) to its last read,
            # `add_home`'s; a resident one that nothing writes over: always.
            over = name in graph.replaced and bool(positions) and positions[-1] < self.ops
            home: int | None = None
            if name in produced_at:
                home = 0 if name in accumulated else self.at(produced_at[name])
                if not positions:
                    self.add_held(name, home, home)
            elif over:
                home = 0
            elif readings or self.is_resident(name):
                self.add_held(name, 0, self.slots - 1)
            if not positions:
                continue
            # The marks of a value's copy in another layer are its own, at its own reading
            # positions: made once. (A forward layer's activation and its backward are at
            # other distances in each layer.)
            self.rank = {p: u for u, p in enumerate(positions)}
            self.positions = positions
            group, shardings = self.held(name)
            signature = (
                name in produced_at, over, group, id(shardings),
                self.graph.values[name].shape, self.graph.values[name].dtype,
                tuple((self.rank[p], i, g, id(needs)) for p, i, g, needs in readings),
                tuple((self.widths[p], p == self.ops, self.in_forward(p)) for p in positions),
            )  # fmt: skip
            marks = replays.get(signature)
            if marks is None:
                self.recording = []
                # Each buffer's live conditions, by phase (None: one for the whole step).
                buffers: dict[bool | None, dict[Sharding, Buffer]] = {}
                if name in produced_at:
                    buffers[None] = self.add_buffers(name, readings)
                else:  # a weight is gathered for the forward, and again for the backward
                    for forward in (True, False):
                        buffers[forward] = self.add_buffers(
                            name, [r for r in readings if self.in_forward(r[0]) == forward]
                        )
                if home is not None:
                    self.add_home(name, readings, over, buffers)
                marks = replays[signature] = self.recording
            if home is not None:
                self.add_held(name, home, self.slot(self.last_home_read(readings, over)))
            if marks:
                copies.setdefault(signature, []).append(positions)
        for signature, positions_of in copies.items():
            self.replay(replays[signature], np.array(positions_of, np.int64))
        return self.rows()

    def in_forward(self, position: int) -> bool:
        return position < self.ops and self.graph.phase(self.graph.ops[position].name) == FORWARD

    def is_resident(self, name: str) -> bool:
        graph = self.graph
        return name in graph.inputs or name in graph.weights or name in graph.constants

    def slot(self, ref: Ref) -> int:
        """The slot a reference names, at the reading positions of the value being marked."""
        u, offset = ref
        return self.first[self.positions[u]] + offset

    def pre_ref(self, read: Read, step: int = 0) -> Ref:
        """PRE(p, i, step) of a read: where `materialize` reshards the operand."""
        return (self.rank[read[0]], self.starts[read[0]][read[1]] + step)

    def longest(self, name: str, needs: tuple[Sharding, ...]) -> int:
        """The most collectives a reshard of `name` to one of `needs` takes, from any of the
        shardings it may be held in."""
        _, shardings = self.held(name)
        info = self.graph.values[name]
        cache_key = (id(shardings), id(needs), info.shape, info.dtype)
        if cache_key not in self.longest_cache:
            self.kept += [shardings, needs]  # alive, so that their ids stay their own
            self.longest_cache[cache_key] = (
                max(
                    len(self.intermediates(name, h, t)) + 1
                    for t in self.choices_of(needs)
                    if (info.shape, info.dtype, t) in self.targets
                    for h in self.choices_of(shardings)
                )
                if any((info.shape, info.dtype, t) in self.targets for t in needs)
                else 1
            )
        return self.longest_cache[cache_key]

    def at_ref(self, read: Read, over: bool = False) -> Ref:
        """Where a read as held reads the home tensor: the reader's compute step; but an update
        writing over the value (`over`, the last reader) frees it before its results, so its
        last reshard step."""
        p = read[0]
        if over and p == self.positions[-1]:
            return (self.rank[p], self.widths[p] - 1)  # its last reshard step
        return (self.rank[p], self.at_offset(p))

    def last_home_read(self, readings: Sequence[Read], over: bool) -> Ref:
        """The last slot where some plan reads the home tensor."""
        return max((self.at_ref(r, over) for r in readings), key=self.slot)

    def add_home(
        self,
        name: str,
        readings: Sequence[Read],
        over: bool,
        buffers: Mapping[bool | None, Mapping[Sharding, Buffer]],
    ) -> None:
        """The home tensor after its first read: `build` counts it up to its last possible
        read; here, as savings (negative terms), the slots after which no read of it follows.

        A read (p, i) in sharding s reads the home at AT(p) when s is the held sharding, at
        PRE(p, i) when no buffer of s is live there (the reshard is made there; later reads
        of s read its buffer). With the slots where some plan reads the home u_1 < ... < u_n,
        the home is dead after u_{j-1} exactly when no read at u_j or later reads it:

            dead(u_n) = [nothing at u_n reads the home]
            dead(u_j) = dead(u_{j+1}) AND [nothing at u_j reads the home]

        a chain of ANDs of two literals, one per slot, where each slot's own condition would
        be one wide AND of every later reader's choices (bert's embeddings: after the query
        MatMul's reshard, key and value read it as held and the residual Add reads the query's
        buffer). The saving of the home held in b bytes is [held in b bytes] AND dead(u_j)
        (shardings of one size share it). Savings are bounded from above in the ILP
        (`ilp._memory_rows`; those of one value at one slot exclude each other, and together
        never exceed dead(u_j)), so the solver sets each to its true value or counts more
        than the plan holds."""
        group, shardings = self.held(name)
        events: dict[int, list[tuple[Ref, Read, bool]]] = {}  # slot -> (ref, read, at AT)
        for r in readings:
            for ref, at in ((self.pre_ref(r), False), (self.at_ref(r, over), True)):
                events.setdefault(self.slot(ref), []).append((ref, r, at))
        slots = sorted(events)
        # The home's bytes under each held choice: one saving per size, not per sharding.
        sizes: dict[int, list[Literal | bool]] = {}
        for h in self.choices_of(shardings):
            sizes.setdefault(self.nbytes(name, h), []).append(
                self.chosen(group, shardings, h, True)
            )
        by_size = {size: self.combine(False, held) for size, held in sizes.items()}
        dead: Literal | bool = True
        for before, until in reversed(list(zip(slots, slots[1:], strict=False))):
            parts = [dead]
            for _, read, at in events[until]:
                _, _, g, needs = read
                # Read as held at AT: in another sharding than held. Made at PRE: in a
                # sharding whose buffer is live just before (the home is read at AT else).
                ways = [
                    self.combine(
                        True,
                        [
                            self.chosen(g, needs, s, True),
                            self.chosen(group, shardings, s, False)
                            if at
                            else self.buffer_before(read, s, buffers),
                        ],
                    )
                    for s in self.choices_of(needs)
                ]
                parts.append(self.combine(False, ways))
            dead = self.combine(True, parts)
            if dead is False:
                break
            first = events[before][0][0]
            for size, held in by_size.items():
                saving = self.combine(True, [held, dead])
                self.mark((first[0], first[1] + 1), events[until][0][0], saving, -size)

    def buffer_before(
        self, read: Read, s: Sharding, buffers: Mapping[bool | None, Mapping[Sharding, Buffer]]
    ) -> Literal | bool:
        """A buffer of `s` is live just before the read's reshard (made by an earlier read, or
        on the way of an earlier reshard; a weight's in the read's phase): said with the
        buffer's own live condition, the ILP's relaxation saves the home's bytes only where
        it counts the buffer's."""
        phase = None if None in buffers else self.in_forward(read[0])
        live = buffers[phase].get(s)
        return False if live is None else live.at_slot(self.slot(self.pre_ref(read)) - 1)

    def add_buffers(self, name: str, readings: Sequence[Read]) -> dict[Sharding, Buffer]:
        """The buffers of the reshards of a value: one per sharding read other than the held
        one, made at the first read of it (its reshard's last step) and live to the last
        (AT); the tensors on the way of a reshard of several collectives, live from the step
        making one to the step reading it; and those `materialize` keeps, for a reader of
        that sharding or a later reshard passing the same way, live to their last use. Each
        buffer's live conditions, for `add_home`."""
        if not readings:
            return {}
        group, shardings = self.held(name)
        needed = dict.fromkeys(s for *_, needs in readings for s in self.choices_of(needs))
        passing = self.passing_through(name, needed)
        live_of: dict[Sharding, Buffer] = {}
        for s in [*needed, *(m for m in passing if m not in needed)]:
            differs = self.chosen(group, shardings, s, False)
            if differs is False:
                continue
            # (slot, the buffer is made there, it is read there)
            found: list[tuple[Ref, Literal | bool, Literal | bool]] = []
            for k, read in enumerate(readings):
                _, _, g, needs = read
                reads_s = self.chosen(g, needs, s, True)
                # Made by the last step of the reshard from each held sharding.
                by_steps = self.steps_to(name, s)
                for steps, held_so in by_steps.items():
                    made = reads_s if len(by_steps) == 1 else self.combine(True, [reads_s, held_so])
                    found.append((self.pre_ref(read, steps - 1), made, False))
                found.append((self.at_ref(read), False, reads_s))
                # Made on the way of a reshard to t, read by its next step.
                # (A reshard to t is made at the first read of t only.)
                for h, t in passing.get(s, ()):
                    step = self.intermediates(name, h, t).index(s)
                    first = [self.chosen(r[2], r[3], t, False) for r in readings[:k]]
                    way = self.combine(
                        True,
                        [
                            self.chosen(group, shardings, h, True),
                            self.chosen(g, needs, t, True),
                            *first,
                        ],
                    )
                    found.append((self.pre_ref(read, step), way, way))
                    found.append((self.pre_ref(read, step + 1), False, way))
            events: dict[Ref, tuple[list[Literal | bool], list[Literal | bool]]] = {}
            for ref, made, used in found:
                made_at, used_at = events.setdefault(ref, ([], []))
                made_at.append(made)
                used_at.append(used)
            slots = sorted(events, key=self.slot)
            made_by = [self.combine(False, events[r][0]) for r in slots]
            used_by = [self.combine(False, events[r][1]) for r in slots]
            # The OR of each prefix and suffix, worked out again only where the literal it
            # adds is not False (an OR that cannot change): a value of many reads has many.
            prefix: list[Literal | bool] = []
            for j, lit in enumerate(made_by):
                again = not prefix or lit is not False
                prefix.append(self.combine(False, made_by[: j + 1]) if again else prefix[-1])
            suffix: list[Literal | bool] = []
            for j in reversed(range(len(slots))):
                again = not suffix or used_by[j] is not False
                suffix.append(self.combine(False, used_by[j:]) if again else suffix[-1])
            suffix.reverse()
            size = self.nbytes(name, s)
            at: list[Literal | bool] = []
            between: list[Literal | bool] = []
            for j, ref in enumerate(slots):
                at.append(self.combine(True, [differs, prefix[j], suffix[j]]))
                self.mark(ref, ref, at[-1], size)
                between.append(False)
                if j + 1 < len(slots):
                    between[-1] = self.combine(True, [differs, prefix[j], suffix[j + 1]])
                    after, until = (ref[0], ref[1] + 1), slots[j + 1]
                    self.mark(after, (until[0], until[1] - 1), between[-1], size)
            live_of[s] = Buffer(tuple(self.slot(r) for r in slots), tuple(at), tuple(between))
        self.add_on_the_way(name, readings, needed, passing)
        return live_of

    def steps_to(self, name: str, s: Sharding) -> dict[int, Literal | bool]:
        """How many steps a reshard of `name` to `s` takes, and when (its held choices)."""
        group, shardings = self.held(name)
        info = self.graph.values[name]
        cache_key = (id(shardings), info.shape, info.dtype, s)
        if (info.shape, info.dtype, s) not in self.targets:
            return {1: True}
        if cache_key not in self.steps_to_cache:
            by_steps: dict[int, list[Literal | bool]] = {}
            for h in self.choices_of(shardings):
                if h != s:
                    steps = len(self.intermediates(name, h, s)) + 1
                    by_steps.setdefault(steps, []).append(self.chosen(group, shardings, h, True))
            self.steps_to_cache[cache_key] = {
                steps: self.combine(False, held_so) for steps, held_so in by_steps.items()
            }
        return self.steps_to_cache[cache_key]

    def passing_through(
        self, name: str, needed: Collection[Sharding]
    ) -> dict[Sharding, list[tuple[Sharding, Sharding]]]:
        """For each sharding that a reshard of several collectives (held h to needed t) makes
        on its way and a reader needs or another such reshard makes too, those (h, t): the
        tensors `materialize` may keep."""
        info = self.graph.values[name]
        _, shardings = self.held(name)
        cache_key = (id(shardings), info.shape, info.dtype, tuple(needed))
        if cache_key not in self.passing_cache:
            found: dict[Sharding, list[tuple[Sharding, Sharding]]] = {}
            for t in needed:
                if (info.shape, info.dtype, t) not in self.targets:
                    continue
                for h in self.choices_of(shardings):
                    for m in self.intermediates(name, h, t):
                        found.setdefault(m, []).append((h, t))
            self.passing_cache[cache_key] = {
                m: ways for m, ways in found.items() if m in needed or len(ways) > 1
            }
        return self.passing_cache[cache_key]

    def intermediates(self, name: str, src: Sharding, dst: Sharding) -> tuple[Sharding, ...]:
        """The shardings a reshard from `src` to `dst` makes on its way (its steps' results
        but the last), where reshards to `dst` are counted (`targets`)."""
        info = self.graph.values[name]
        cache_key = (info.shape, info.dtype, src, dst)
        if (info.shape, info.dtype, dst) not in self.targets:
            return ()
        if cache_key not in self.steps_cache:
            itemsize = dtypes.nbytes(info.dtype, 1)
            try:
                steps = plan_reshard(src, dst, info.shape, self.mesh, itemsize)
            except ShardingError:  # no plan holds and reads it so (the search prices it)
                steps = ()
            self.steps_cache[cache_key] = tuple(c.dst for c in steps[:-1])
        return self.steps_cache[cache_key]

    def add_on_the_way(
        self,
        name: str,
        readings: Sequence[Read],
        needed: Collection[Sharding],
        passing: Mapping[Sharding, Sequence[tuple[Sharding, Sharding]]],
    ) -> None:
        """The tensors a reshard of several collectives makes on its way and nothing keeps:
        each live at the step making it and the next, reading it. Counted at every read of
        the sharding made, less (a saving) at a read after an earlier one (the reshard is
        made once)."""
        group, shardings = self.held(name)
        info = self.graph.values[name]
        for t in needed:
            if (info.shape, info.dtype, t) not in self.targets:
                continue
            for h in self.choices_of(shardings):
                way = self.intermediates(name, h, t)
                if not way:
                    continue
                is_h = self.chosen(group, shardings, h, True)
                for k, read in enumerate(readings):
                    _, _, g, needs = read
                    making = self.combine(True, [is_h, self.chosen(g, needs, t, True)])
                    if making is False:
                        continue
                    earlier = [self.chosen(r[2], r[3], t, True) for r in readings[:k]]
                    again = self.combine(True, [making, self.combine(False, earlier)])
                    for step, m in enumerate(way):
                        if m in passing:
                            continue
                        size = self.nbytes(name, m)
                        first, last = self.pre_ref(read, step), self.pre_ref(read, step + 1)
                        self.mark(first, last, making, size)
                        self.mark(first, last, again, -size)

    def rows(self) -> MemoryModel:
        """The distinct rows, in the order of the first slot holding each, swept slot by slot
        over the group terms' events (+bytes at a span's first slot, -bytes after its last):
        one vector of the choices' bytes, never a matrix of slots x choices, and at each slot
        only the runs of the groups whose bytes changed are looked up again."""
        slots, groups = self.slots, len(self.sizes)
        at, columns, amounts = self.events()
        bounds = np.searchsorted(at, np.arange(slots + 1))
        fixed = np.cumsum(self.fixed[:-1])
        # What every row holds (the resident shards, mostly) is stated once, as `base`: rows
        # of a few terms each instead of every weight's in each (CP-SAT's LP is far lighter).
        common = np.zeros(int(self.offsets[-1]), np.int64)
        for slot, vector, _ in self.sweep(slots, bounds, columns, amounts):
            if slot:
                np.minimum(common, vector, out=common)
            else:
                np.copyto(common, vector)
        table = RunTable()

        def run(group: int, vector: np.ndarray) -> int:
            start = int(self.offsets[group])
            (nonzero,) = np.nonzero(vector[start : int(self.offsets[group + 1])])
            return table.add(group, nonzero, vector[start + nonzero]) if len(nonzero) else -1

        base_runs = [u for g in range(groups) if (u := run(g, common)) >= 0]
        base_fixed = int(fixed.min())
        # Indicator terms as events too, over a vector of the indicators' bytes.
        marked = self.marked()
        marked_bounds = np.searchsorted(marked[0], np.arange(slots + 1))
        live = np.zeros(len(self.indicators), np.int64)
        marks = (_NONE, _NONE)
        runs = np.full(groups, -1, np.int64)  # each group's run at this slot (-1: none)
        group_of = np.repeat(np.arange(groups), self.sizes)
        found: dict[tuple, tuple[int, list[int], tuple[np.ndarray, np.ndarray]]] = {}
        changed = set(np.flatnonzero(self.fixed[:slots] | np.diff(marked_bounds)).tolist())
        for slot, vector, moved in self.sweep(slots, bounds, columns, amounts, changed):
            first, last = marked_bounds[slot], marked_bounds[slot + 1]
            if first < last:
                np.add.at(live, marked[1][first:last], marked[2][first:last])
                (held,) = np.nonzero(live)
                marks = (held, live[held])
            rest = vector - common
            for g in range(groups) if slot == 0 else np.unique(group_of[moved]).tolist():
                runs[g] = run(g, rest)
            key = (int(fixed[slot]), runs.tobytes(), marks[0].tobytes(), marks[1].tobytes())
            if key not in found:
                found[key] = (key[0] - base_fixed, runs[runs >= 0].tolist(), marks)
        rows = list(found.values())
        return MemoryModel(
            table.rows([base_fixed], [base_runs], [(_NONE, _NONE)]),
            table.rows([f for f, _, _ in rows], [r for _, r, _ in rows], [m for *_, m in rows]),
            tuple(self.indicators),
        )

    def events(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The group terms' events, by slot: (slot, column of a choice, bytes added)."""
        held, chosen = self.held_spans, self.chosen_marks
        lengths = [len(c) for _, _, c, _ in held]
        spans = np.array([(f, t) for f, t, _, _ in held], np.int64).reshape(-1, 2)
        # A mark's spans (one per copy) times its columns.
        return _events(
            _concatenate([np.repeat(spans[:, 0], lengths)]
                         + [np.repeat(f, len(c)) for f, _, c, _ in chosen]),
            _concatenate([np.repeat(spans[:, 1], lengths)]
                         + [np.repeat(t, len(c)) for _, t, c, _ in chosen]),
            _concatenate([c for _, _, c, _ in held]
                         + [np.tile(c, len(f)) for f, _, c, _ in chosen]),
            _concatenate([a for *_, a in held]
                         + [np.full(len(f) * len(c), a, np.int64) for f, _, c, a in chosen]),
        )  # fmt: skip

    def marked(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The indicator terms' events, by slot: (slot, indicator, bytes added)."""
        marks = self.indicated
        return _events(
            _concatenate([f for f, _, _, _ in marks]),
            _concatenate([t for _, t, _, _ in marks]),
            _concatenate([np.full(len(f), i, np.int64) for f, _, i, _ in marks]),
            _concatenate([np.full(len(f), a, np.int64) for f, _, _, a in marks]),
        )

    def sweep(
        self,
        slots: int,
        bounds: np.ndarray,
        columns: np.ndarray,
        amounts: np.ndarray,
        changes: Collection[int] = (),
    ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Each slot, its vector of group-term bytes and the columns changed there, for the
        first slot and those where the vector changes or `changes` names (the vector is one
        array, updated in place)."""
        vector = np.zeros(int(self.offsets[-1]), np.int64)
        for slot in range(slots):
            first, last = bounds[slot], bounds[slot + 1]
            if first < last:
                np.add.at(vector, columns[first:last], amounts[first:last])
            if first < last or slot == 0 or slot in changes:
                yield slot, vector, columns[first:last]


def _events(
    firsts: np.ndarray, lasts: np.ndarray, columns: np.ndarray, amounts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Terms live over spans of slots (first..last, a column, bytes) as events sorted by slot:
    (slot, column, bytes added), +bytes at a span's first slot and -bytes after its last."""
    at = np.concatenate([firsts, lasts + 1]).astype(np.int64)
    order = np.argsort(at, kind="stable")
    return (
        at[order],
        np.concatenate([columns, columns]).astype(np.int64)[order],
        np.concatenate([amounts, -amounts]).astype(np.int64)[order],
    )


def _order(literal: Literal) -> tuple:
    if isinstance(literal, Chosen):
        return (0, literal.group, sorted(literal.choices))
    return (1, literal)

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
  not made on the way of another reshard) nor one of its reshard's first step (`materialize`
  starts the reshard from that tensor), else not at all;
- reshard buffers: a value read in a sharding s other than the one it is held in is resharded
  once, at the first read of s (made by the reshard's last step), and the buffer lives until
  the last read of s. With P(t) "made at or before t" and Q(t) "read at or after t", it is
  live at t exactly when held != s and P(t) and Q(t);
- a weight (an input, a constant, a recomputed layer's input: `materialize.reshards_again`)
  is resharded again for a training step's backward, not kept from its forward (FSDP gathers
  a weight before each use): its buffers are counted apart;
- the tensors a reshard of several collectives makes on its way: live at the step making one
  and the next (reading it); those `materialize` keeps (a reader needs that sharding, or a
  later reshard passes the same way) as buffers, to their last use. For the reshards counted
  (`chains`) only: most pairs of candidates on a 3-axis mesh take several steps, a plan uses
  few, and counting them all makes the model many times larger; `search.budget` adds those a
  plan makes, each counted from every held sharding to its target, since the next plan may
  hold the weight otherwise and reshard it to the same target.

"Group g chose a choice in K" is a sum of g's one-hot variables (`Chosen`); live conditions are
ANDs and ORs of those (`Indicator`). Where they add bytes to rows bounded from above, the ILP
needs only their lower bounds (an AND is at least the sum of its literals minus their number
plus one, an OR at least each literal); where they take bytes off (savings), only their upper
bounds: either way a solver keeping rows under a budget sets each to its true value or makes
its own life harder (`search.solver`). Repeated layers ask for the same conditions and share
them, and their rows coincide (rows are kept once).

Exact for the materialized program (`tests/search/test_memory_exact.py`), the reshards of
several collectives it makes counted (`chains`).

The parts: the slots (`memory_slots`), the literals (`memory_literals`), the tensors a value
makes (`memory_tensors`), the marks recorded once and replayed per copy (`memory_record`), and
the distinct rows swept out of them (`memory_assembly`); here, the live terms of each value.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.deadline import NEVER, Deadline
from autoshard.ir.graph import FORWARD, Graph
from autoshard.mesh import Mesh
from autoshard.passes.materialize import reshards_again
from autoshard.rules.gradient import accumulated_gradients
from autoshard.search.memory.assembly import assemble_rows
from autoshard.search.memory.literals import Literals
from autoshard.search.memory.record import Mark, Recorder, Terms
from autoshard.search.memory.rows import Literal, MemoryModel
from autoshard.search.memory.slots import Read, Ref, SlotLayout, slot_layout
from autoshard.search.memory.tensors import Held, Tensors
from autoshard.sharding import Sharding

Chain = tuple[tuple[int, ...], str, Sharding, Sharding]
"""A reshard of a tensor of some shape and dtype from one sharding to another."""


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


def memory_model(
    graph: Graph,
    mesh: Mesh,
    sizes: Sequence[int],
    held: Callable[[str], Held],
    reads: Callable[[str], Sequence[Read]],
    chains: Collection[Chain] = frozenset(),
    deadline: Deadline = NEVER,
) -> MemoryModel:
    """The rows of the program of every plan: `held(value)` and `reads(value)` say how each
    value is held and read under the choices. The intermediate tensors of a reshard of
    several collectives are counted for the targets of the `chains` given (from any held
    sharding): on a 3-axis mesh most pairs of candidate shardings reshard in several steps,
    but a plan uses few of them, and the search adds those it finds (`search.budget`).
    `TimeUp` once `deadline` has passed (looked at after each value)."""
    literals = Literals(sizes)
    targets = {(shape, dtype, dst) for shape, dtype, _, dst in frozenset(chains)}
    tensors = Tensors(graph, mesh, held, targets, literals)
    layout = slot_layout(graph, reads, tensors.longest)
    terms = _Liveness(graph, reads, literals, tensors, layout).terms(deadline)
    return assemble_rows(terms, literals.sizes, literals.indicators)


class _Liveness:
    """The terms of every value: its held shard, its home tensor and its reshard buffers, each
    value's marks recorded once per kind of copy and replayed at each copy's positions."""

    def __init__(
        self,
        graph: Graph,
        reads: Callable[[str], Sequence[Read]],
        literals: Literals,
        tensors: Tensors,
        layout: SlotLayout,
    ) -> None:
        self.graph, self.reads, self.held = graph, reads, tensors.held
        self.literals, self.tensors, self.layout = literals, tensors, layout
        self.ops = layout.ops
        self.again = reshards_again(graph)

    def terms(self, deadline: Deadline) -> Terms:
        """Every value's terms at their slots, in graph order (the indicators are numbered in
        the order the values ask for them); `TimeUp` once `deadline` has passed."""
        graph, layout = self.graph, self.layout
        terms = Terms(layout, self.literals.sizes)
        produced_at = {o: p for p, op in enumerate(graph.ops) for o in op.outputs if o}
        accumulated = accumulated_gradients(graph)
        replays: dict[tuple, list[Mark]] = {}
        copies: dict[tuple, list[list[int]]] = {}  # the reading positions of each copy
        for done, name in enumerate(graph.values):
            deadline.check("building the problem", f"memory: {done} of {len(graph.values)} values")
            readings = sorted(self.reads(name), key=lambda r: (r[0], r[1]))
            positions = sorted({r[0] for r in readings})
            # The home tensor (the value as held): from where it is made (a resident one,
            # or a gradient accumulated over micro-batches: from the start) to its last read,
            # `add_home`'s; a resident one that nothing writes over: always.
            over = name in graph.replaced and bool(positions) and positions[-1] < self.ops
            home: int | None = None
            if name in produced_at:
                home = 0 if name in accumulated else layout.at(produced_at[name])
                if not positions:
                    self.add_held(terms, name, home, home)
            elif over:
                home = 0
            elif readings or self.is_resident(name):
                self.add_held(terms, name, 0, layout.slots - 1)
            if not positions:
                continue
            # The marks of a value's copy in another layer are its own, at its own reading
            # positions: made once. (A forward layer's activation and its backward are at
            # other distances in each layer.)
            recorder = Recorder(layout, readings)
            kept = name not in self.again  # its reshards kept from the forward to the backward
            signature = self.signature(name, readings, recorder, kept, over)
            marks = replays.get(signature)
            if marks is None:
                self.record(recorder, name, readings, kept, over, home is not None)
                marks = replays[signature] = recorder.marks
            if home is not None:
                last = recorder.slot(recorder.last_home_read(readings, over))
                self.add_held(terms, name, home, last)
            if marks:
                copies.setdefault(signature, []).append(recorder.anchors)
        for signature, anchors in copies.items():
            terms.replay(replays[signature], np.array(anchors, np.int64))
        return terms

    def signature(
        self, name: str, readings: Sequence[Read], recorder: Recorder, kept: bool, over: bool
    ) -> tuple:
        """What a value's marks depend on, relative to its reading positions: alike for its
        copies in repeated layers."""
        group, shardings = self.held(name)
        info = self.graph.values[name]
        widths = self.layout.widths
        return (
            kept, over, group, id(shardings), info.shape, info.dtype,
            tuple((recorder.pre_ref(r)[0], r[1] if r[0] < self.ops else -1, r[2], id(r[3]))
                  for r in readings),
            tuple((widths[p], p == self.ops, self.in_forward(p)) for p in recorder.positions),
            recorder.outputs_shape(),
        )  # fmt: skip

    def record(
        self,
        recorder: Recorder,
        name: str,
        readings: Sequence[Read],
        kept: bool,
        over: bool,
        home: bool,
    ) -> None:
        """A value's marks: its buffers' and, where it has a home tensor, its savings."""
        # Each buffer's live conditions, by phase (None: one for the whole step).
        buffers: dict[bool | None, dict[Sharding, Buffer]] = {}
        if kept:
            buffers[None] = self.add_buffers(recorder, name, readings)
        else:  # a weight is gathered for the forward, and again for the backward
            for forward in (True, False):
                buffers[forward] = self.add_buffers(
                    recorder, name, [r for r in readings if self.in_forward(r[0]) == forward]
                )
        if home:
            self.add_home(recorder, name, readings, over, buffers)

    def add_held(self, terms: Terms, value: str, first: int, last: int) -> None:
        """The held shard of `value` over slots first..last."""
        group, shardings = self.held(value)
        if last < first:
            return
        if group is None:
            terms.add_fixed(first, last, self.tensors.nbytes(value, shardings[0]))
        else:
            terms.add_held(group, first, last, self.tensors.held_bytes(value))

    def in_forward(self, position: int) -> bool:
        return position < self.ops and self.graph.phase(self.graph.ops[position].name) == FORWARD

    def is_resident(self, name: str) -> bool:
        graph = self.graph
        return name in graph.inputs or name in graph.weights or name in graph.constants

    def add_home(
        self,
        recorder: Recorder,
        name: str,
        readings: Sequence[Read],
        over: bool,
        buffers: Mapping[bool | None, Mapping[Sharding, Buffer]],
    ) -> None:
        """The home tensor after its first read: `terms` counts it up to its last possible
        read; here, as savings (negative terms), the slots after which no read of it follows.

        A read (p, i) in sharding s reads the home at AT(p) when s is the held sharding, at
        PRE(p, i) when no buffer of s nor of its reshard's first step is live there (the
        reshard is made there from the home; later reads of s read its buffer). With the
        slots where some plan reads the home u_1 < ... < u_n, the home is dead after u_{j-1}
        exactly when no read at u_j or later reads it:

            dead(u_n) = [nothing at u_n reads the home]
            dead(u_j) = dead(u_{j+1}) AND [nothing at u_j reads the home]

        a chain of ANDs of two literals, one per slot, where each slot's own condition would
        be one wide AND of every later reader's choices (bert's embeddings: after the query
        MatMul's reshard, key and value read it as held and the residual Add reads the query's
        buffer). The saving of the home held in b bytes is [held in b bytes] AND dead(u_j)
        (shardings of one size share it). Savings are bounded from above in the ILP
        (`search.solver`; those of one value at one slot exclude each other, and together
        never exceed dead(u_j)), so the solver sets each to its true value or counts more
        than the plan holds."""
        chosen, combine = self.literals.chosen, self.literals.combine
        group, shardings = self.held(name)
        events: dict[int, list[tuple[Ref, Read, bool]]] = {}  # slot -> (ref, read, at AT)
        for r in readings:
            for ref, at in ((recorder.pre_ref(r), False), (recorder.at_ref(r, over), True)):
                events.setdefault(recorder.slot(ref), []).append((ref, r, at))
        slots = sorted(events)
        # The home's bytes under each held choice: one saving per size, not per sharding.
        sizes: dict[int, list[Literal | bool]] = {}
        for h in self.literals.choices_of(shardings):
            sizes.setdefault(self.tensors.nbytes(name, h), []).append(
                chosen(group, shardings, h, True)
            )
        by_size = {size: combine(False, held) for size, held in sizes.items()}
        dead: Literal | bool = True
        for before, until in reversed(list(zip(slots, slots[1:], strict=False))):
            parts = [dead]
            for _, read, at in events[until]:
                _, _, g, needs = read
                # Read as held at AT: in another sharding than held. Made at PRE: in a
                # sharding whose buffer is live just before (the home is read at AT else).
                ways = [
                    combine(
                        True,
                        [
                            chosen(g, needs, s, True),
                            chosen(group, shardings, s, False)
                            if at
                            else self.made_before(recorder, name, read, s, buffers),
                        ],
                    )
                    for s in self.literals.choices_of(needs)
                ]
                parts.append(combine(False, ways))
            dead = combine(True, parts)
            if dead is False:
                break
            first = events[before][0][0]
            for size, held in by_size.items():
                saving = combine(True, [held, dead])
                recorder.mark((first[0], first[1] + 1), events[until][0][0], saving, -size)

    def made_before(
        self,
        recorder: Recorder,
        name: str,
        read: Read,
        s: Sharding,
        buffers: Mapping[bool | None, Mapping[Sharding, Buffer]],
    ) -> Literal | bool:
        """The read's reshard to `s` reads no home tensor: a buffer of `s` is live just before
        it, or a buffer of what the first step of the reshard from the held sharding makes
        (`materialize` starts the reshard from that tensor, not from the home)."""
        chosen, combine = self.literals.chosen, self.literals.combine
        group, shardings = self.held(name)
        ways = [self.buffer_before(recorder, read, s, buffers)]
        for h in self.literals.choices_of(shardings):
            way = self.tensors.intermediates(name, h, s)
            if way:
                first = self.buffer_before(recorder, read, way[0], buffers)
                ways.append(combine(True, [chosen(group, shardings, h, True), first]))
        return combine(False, ways)

    def buffer_before(
        self,
        recorder: Recorder,
        read: Read,
        s: Sharding,
        buffers: Mapping[bool | None, Mapping[Sharding, Buffer]],
    ) -> Literal | bool:
        """A buffer of `s` is live just before the read's reshard (made by an earlier read, or
        on the way of an earlier reshard; a weight's in the read's phase): said with the
        buffer's own live condition, the ILP's relaxation saves the home's bytes only where
        it counts the buffer's."""
        phase = None if None in buffers else self.in_forward(read[0])
        live = buffers[phase].get(s)
        return False if live is None else live.at_slot(recorder.slot(recorder.pre_ref(read)) - 1)

    def add_buffers(
        self, recorder: Recorder, name: str, readings: Sequence[Read]
    ) -> dict[Sharding, Buffer]:
        """The buffers of the reshards of a value: one per sharding read other than the held
        one, made at the first read of it (its reshard's last step) and live to the last
        (AT); the tensors on the way of a reshard of several collectives, live from the step
        making one to the step reading it; and those `materialize` keeps, for a reader of
        that sharding or a later reshard passing the same way, live to their last use. Each
        buffer's live conditions, for `add_home`."""
        if not readings:
            return {}
        group, shardings = self.held(name)
        choices_of = self.literals.choices_of
        needed = dict.fromkeys(s for *_, needs in readings for s in choices_of(needs))
        passing = self.tensors.passing_through(name, needed)
        live_of: dict[Sharding, Buffer] = {}
        for s in [*needed, *(m for m in passing if m not in needed)]:
            differs = self.literals.chosen(group, shardings, s, False)
            if differs is False:
                continue
            events = self.buffer_events(recorder, name, readings, s, passing)
            size = self.tensors.nbytes(name, s)
            live_of[s] = self.add_buffer(recorder, events, differs, size)
        self.add_on_the_way(recorder, name, readings, needed, passing)
        return live_of

    def buffer_events(
        self,
        recorder: Recorder,
        name: str,
        readings: Sequence[Read],
        s: Sharding,
        passing: Mapping[Sharding, Sequence[tuple[Sharding, Sharding]]],
    ) -> dict[Ref, tuple[list[Literal | bool], list[Literal | bool]]]:
        """Where a buffer of `s` may be made and read: for each slot, the literals under which
        it is made there and those under which it is read there."""
        chosen, combine = self.literals.chosen, self.literals.combine
        group, shardings = self.held(name)
        # (slot, the buffer is made there, it is read there)
        found: list[tuple[Ref, Literal | bool, Literal | bool]] = []
        for k, read in enumerate(readings):
            _, _, g, needs = read
            reads_s = chosen(g, needs, s, True)
            # Made by the last step of the reshard from each held sharding.
            by_steps = self.tensors.steps_to(name, s)
            for steps, held_so in by_steps.items():
                made = reads_s if len(by_steps) == 1 else combine(True, [reads_s, held_so])
                found.append((recorder.pre_ref(read, steps - 1), made, False))
            found.append((recorder.at_ref(read), False, reads_s))
            # Made on the way of a reshard to t, read by its next step.
            # (A reshard to t is made at the first read of t only.)
            for h, t in passing.get(s, ()):
                step = self.tensors.intermediates(name, h, t).index(s)
                first = [chosen(r[2], r[3], t, False) for r in readings[:k]]
                way = combine(
                    True, [chosen(group, shardings, h, True), chosen(g, needs, t, True), *first]
                )
                found.append((recorder.pre_ref(read, step), way, way))
                found.append((recorder.pre_ref(read, step + 1), False, way))
        events: dict[Ref, tuple[list[Literal | bool], list[Literal | bool]]] = {}
        for ref, made, used in found:
            made_at, used_at = events.setdefault(ref, ([], []))
            made_at.append(made)
            used_at.append(used)
        return events

    def add_buffer(
        self,
        recorder: Recorder,
        events: Mapping[Ref, tuple[Sequence[Literal | bool], Sequence[Literal | bool]]],
        differs: Literal | bool,
        size: int,
    ) -> Buffer:
        """A buffer of `size` bytes, made and read at the slots of `events`: live at a slot
        when the value is held otherwise (`differs`), made there or before, and read there or
        after."""
        combine = self.literals.combine
        slots = sorted(events, key=recorder.slot)
        made_by = [combine(False, events[r][0]) for r in slots]
        used_by = [combine(False, events[r][1]) for r in slots]
        # The OR of each prefix and suffix (a value of many reads has many).
        prefix = self.literals.running(False, made_by)
        suffix = self.literals.running(False, used_by[::-1])[::-1]
        at: list[Literal | bool] = []
        between: list[Literal | bool] = []
        for j, ref in enumerate(slots):
            at.append(combine(True, [differs, prefix[j], suffix[j]]))
            recorder.mark(ref, ref, at[-1], size)
            between.append(False)
            if j + 1 < len(slots):
                between[-1] = combine(True, [differs, prefix[j], suffix[j + 1]])
                after, until = (ref[0], ref[1] + 1), slots[j + 1]
                recorder.mark(after, (until[0], until[1] - 1), between[-1], size)
        return Buffer(tuple(recorder.slot(r) for r in slots), tuple(at), tuple(between))

    def add_on_the_way(
        self,
        recorder: Recorder,
        name: str,
        readings: Sequence[Read],
        needed: Collection[Sharding],
        passing: Mapping[Sharding, Sequence[tuple[Sharding, Sharding]]],
    ) -> None:
        """The tensors a reshard of several collectives makes on its way and nothing keeps:
        each live at the step making it and the next, reading it. Counted at every read of
        the sharding made, less (a saving) at a read after an earlier one (the reshard is
        made once)."""
        chosen, combine = self.literals.chosen, self.literals.combine
        group, shardings = self.held(name)
        info = self.graph.values[name]
        for t in needed:
            if (info.shape, info.dtype, t) not in self.tensors.targets:
                continue
            for h in self.literals.choices_of(shardings):
                way = self.tensors.intermediates(name, h, t)
                if not way:
                    continue
                is_h = chosen(group, shardings, h, True)
                for k, read in enumerate(readings):
                    _, _, g, needs = read
                    making = combine(True, [is_h, chosen(g, needs, t, True)])
                    if making is False:
                        continue
                    earlier = [chosen(r[2], r[3], t, True) for r in readings[:k]]
                    again = combine(True, [making, combine(False, earlier)])
                    for step, m in enumerate(way):
                        if m in passing:
                            continue
                        size = self.tensors.nbytes(name, m)
                        first, last = recorder.pre_ref(read, step), recorder.pre_ref(read, step + 1)
                        recorder.mark(first, last, making, size)
                        recorder.mark(first, last, again, -size)

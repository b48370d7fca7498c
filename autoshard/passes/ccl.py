"""The collective-communication (CCL) passes (docs/design/lowering.md), as rewrites of a
sharded `Program`.

Run in this order by `optimize_collectives` (twice: without and with the all_reduce split of
step 3, keeping the program that sends fewer bytes, then has fewer collectives):

1. `fuse_reshards` — a chain of collectives on one value whose intermediate tensors nobody else
   reads is replanned from its first sharding to its last by `plan_reshard`. This one rule is
   the all-reduce folding (all_reduce [0] then all_reduce [1] is all_reduce [0, 1]) and
   its all_reduce + all_slice -> reduce_scatter, and any other shortcut the planner knows, since
   the planner returns the cheapest exact sequence and a chain of basis moves is one candidate.
2. `reassociate` — `add(all_reduce(x), all_reduce(y))` becomes `all_reduce(add(x, y))`, and the
   same for reduce_scatter: an elementwise op whose data operands all arrive through the same
   collective, and that commutes with its reduction (sum: Add, Sub, Sum, Neg; max: Max; min: Min),
   computes on the partial values and one collective follows it.
3. `move_all_gathers_down` — an all_gather whose only reader is an elementwise op moves below it,
   when the op's other operands reach the finer sharding by free local slices: the op computes a
   shard of the data for the same bytes sent. An all_reduce whose only reader is such an op is
   first split into reduce_scatter + all_gather (the same ring bytes: (n-1)/n·T twice), when the
   all_gather then moves; this is "all-reduce decompose & all-gather move down":

       h = all_reduce(dot1) [0]      ->   h' = reduce_scatter(dot1) [0] onto dim 2
       r = max(h, zero)                    r' = max(h', all_slice(zero))
                                           r  = all_gather(r') [0] on dim 2
4. `fuse_reshards` again: the moved all_gather may now meet the next reshard of its value.

Every rewrite keeps the program's meaning (the tests execute programs before and after on all
devices) and never adds bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from autoshard.collectives import Collective, CollectiveKind
from autoshard.ir import dtypes
from autoshard.ir.graph import Graph
from autoshard.program import Communicate, Compute, Program, Step, Tensor
from autoshard.reshard import plan_reshard
from autoshard.rules import IteratorType, OpRule, rule_for
from autoshard.rules.elementwise import COMMUTES_WITH, ELEMENTWISE
from autoshard.sharding import ReductionKind, Sharding, ShardingOption

Position = tuple[int, int]
"""Where a step is during a pass: (slot, offset), slot k holding the steps that replaced the
program's k-th step, in order. Positions compare in program order."""


class _Rewrite:
    """A mutable copy of a program's steps and tensors, for one pass.

    The producer and the readers of every tensor are kept up to date as steps are spliced in
    and out (`splice`), so the passes, which ask far more than they change, never rebuild them.
    Positions are kept up to date too, without renumbering: the program's k-th step starts in
    slot k, and a splice changes one slot's few steps (every rewrite replaces a step by a few,
    or removes one), so a step's position is its slot and its place among them. (Numbering the
    steps again after every rewrite would make lowering grow with collectives x steps.)
    """

    def __init__(self, program: Program, graph: Graph) -> None:
        self.program, self.graph = program, graph
        self._slots: list[list[Step]] = [[step] for step in program.steps]
        self._slot: dict[int, int] = {}  # id(step) -> its slot
        self.tensors: dict[str, Tensor] = dict(program.tensors)
        self.counter = itertools.count(1)
        self._producer: dict[str, Step] = {}
        self._readers: dict[str, list[Step | None]] = {}  # None: the tensor is a graph output
        for name in program.outputs:
            self._readers.setdefault(name, []).append(None)
        for k, step in enumerate(program.steps):
            self._add(step, k)

    @property
    def steps(self) -> list[Step]:
        """The steps, in order; changed through `splice` only."""
        return [step for slot in self._slots for step in slot]

    def walk(self) -> list[tuple[Position, Step]]:
        """Every step with its position, in order."""
        return [((slot, k), step) for slot, steps in enumerate(self._slots)
                for k, step in enumerate(steps)]  # fmt: skip

    def at(self, position: Position) -> tuple[Position, Step] | None:
        """The first step at or after `position`, with its position; None past the last."""
        slot, offset = position
        while slot < len(self._slots) and offset >= len(self._slots[slot]):
            slot, offset = slot + 1, 0
        return ((slot, offset), self._slots[slot][offset]) if slot < len(self._slots) else None

    def step(self, position: Position) -> Step:
        slot, offset = position
        return self._slots[slot][offset]

    @staticmethod
    def after(position: Position) -> Position:
        """The position just after `position` (normalized by `at`)."""
        return position[0], position[1] + 1

    def splice(self, position: Position, removed: int, new: Sequence[Step]) -> None:
        """Replace the `removed` steps (0 or 1) at `position` by `new`."""
        slot, offset = position
        steps = self._slots[slot]
        for step in steps[offset : offset + removed]:
            del self._slot[id(step)]
            for name in step.outputs:
                if self._producer.get(name) is step:
                    del self._producer[name]
            for name in set(step.inputs) - {""}:
                self._readers[name] = [r for r in self._readers[name] if r is not step]
        for step in new:
            self._add(step, slot)
        steps[offset : offset + removed] = new

    def _add(self, step: Step, slot: int) -> None:
        """Index a step placed in `slot`."""
        self._slot[id(step)] = slot
        for name in step.outputs:
            self._producer.setdefault(name, step)
        for name in step.inputs:
            if name:
                self._readers.setdefault(name, []).append(step)

    def position(self, step: Step) -> Position:
        slot = self._slot[id(step)]
        return slot, next(k for k, s in enumerate(self._slots[slot]) if s is step)

    def result(self) -> Program:
        steps = self.steps
        return dataclasses.replace(self.program, steps=tuple(steps), tensors=self.live(steps))

    def live(self, steps: Sequence[Step]) -> dict[str, Tensor]:
        used = set(self.program.inputs) | set(self.program.constants) | set(self.program.outputs)
        used |= {name for step in steps for name in (*step.inputs, *step.outputs)}
        return {name: t for name, t in self.tensors.items() if name in used}

    def rename(self, old: str, new: str) -> None:
        """Every read of tensor `old` reads `new` instead."""

        def swap(names: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(new if n == old else n for n in names)

        readers = {id(r): r for r in self._readers.get(old, []) if r is not None}
        for step in readers.values():
            at = self.position(step)
            if isinstance(step, Compute):
                op = dataclasses.replace(step.op, inputs=swap(step.op.inputs))
                self.splice(at, 1, [dataclasses.replace(step, op=op)])
            else:
                self.splice(at, 1, [dataclasses.replace(step, source=new)])
        outputs = self._readers.pop(old, [])
        self._readers.setdefault(new, []).extend(outputs)  # the graph outputs left (None)
        self.program = dataclasses.replace(self.program, outputs=swap(self.program.outputs))

    def producer(self, tensor: str) -> Position | None:
        step = self._producer.get(tensor)
        return self.position(step) if step is not None else None

    def producers(self, tensors: Iterable[str]) -> list[Position]:
        """Positions of the collectives defining `tensors` (those defined by a collective)."""
        steps = (self._producer.get(name) for name in tensors)
        return [self.position(s) for s in steps if isinstance(s, Communicate)]

    def read(self, tensor: str) -> bool:
        """Whether a step or the graph's outputs read `tensor`."""
        return bool(self._readers.get(tensor))

    def sole_reader(self, tensor: str) -> Position | None:
        """The position of the one step reading `tensor` (maybe twice), if it is not an
        output."""
        readers = self._readers.get(tensor, [])
        if not readers or any(r is None or r is not readers[0] for r in readers):
            return None
        step = readers[0]
        assert step is not None
        return self.position(step)

    def fresh(self, like: str, sharding: Sharding) -> str:
        old = self.tensors[like]
        while (name := f"{old.value}~c{next(self.counter)}") in self.tensors:
            pass
        self.tensors[name] = dataclasses.replace(old, name=name, sharding=sharding)
        return name

    def plan(self, source: str | Tensor, sharding: Sharding) -> tuple[Collective, ...]:
        """The collectives taking `source` (a tensor, or its name) to `sharding`."""
        tensor = self.tensors[source] if isinstance(source, str) else source
        size = dtypes.nbytes(tensor.dtype, 1)
        return plan_reshard(tensor.sharding, sharding, tensor.shape, self.program.mesh, size)

    def chain(
        self, source: str, sharding: Sharding, target: str | None = None
    ) -> list[Communicate]:
        """Communicate steps from `source` to `sharding`, the last one defining `target`."""
        return self.name_chain(source, self.plan(source, sharding), target)

    def name_chain(
        self, source: str, collectives: Sequence[Collective], target: str | None = None
    ) -> list[Communicate]:
        """Communicate steps running `collectives` from `source`, the last one defining
        `target` (a fresh tensor when None), the others fresh tensors."""
        steps: list[Communicate] = []
        current = source
        for k, collective in enumerate(collectives):
            last = k == len(collectives) - 1
            name = target if last and target else self.fresh(source, collective.dst)
            steps.append(Communicate(current, name, collective))
            current = name
        return steps

    def rule(self, step: Compute) -> OpRule | None:
        op = self.graph.op_by_name.get(step.op.name)
        return rule_for(op, self.graph) if op is not None else None


def _elementwise(step: Step, rw: _Rewrite) -> OpRule | None:
    """The rule of a single-result elementwise Compute step, else None."""
    if not isinstance(step, Compute) or step.op.type not in ELEMENTWISE:
        return None
    if len([o for o in step.outputs if o]) != 1:
        return None
    rule = rw.rule(step)
    if rule is None or any(loop.kind is not IteratorType.PARALLEL for loop in rule.loops):
        return None
    return rule


def _option(sharding: Sharding, rank: int) -> ShardingOption:
    """The option of an elementwise op computing a result of `rank` dims in `sharding`."""
    split = tuple(sharding.split_axes) + ((),) * (rank - len(sharding.split_axes))
    return ShardingOption(split)


# ---- 1. fuse_reshards ------------------------------------------------------------------------


def fuse_reshards(program: Program, graph: Graph) -> Program:
    """Replan every chain of collectives whose intermediate tensors have no other reader; drop
    collectives nobody reads (a value held as required but read only in another sharding)."""
    rw = _Rewrite(program, graph)
    while dead := [at for at, s in rw.walk() if isinstance(s, Communicate)
                   and not rw.read(s.target)]:  # fmt: skip
        for at in reversed(dead):
            rw.splice(at, 1, ())
    i: Position = (0, 0)
    while (found := rw.at(i)) is not None:
        i, first = found
        if not isinstance(first, Communicate):
            i = rw.after(i)
            continue
        members = [i]
        while (nxt := rw.sole_reader(rw.step(members[-1]).outputs[0])) is not None and isinstance(
            rw.step(nxt), Communicate
        ):
            members.append(nxt)
        if len(members) > 1:
            target = rw.step(members[-1]).outputs[0]
            replanned = rw.chain(first.source, rw.tensors[target].sharding, target)
            old = [step.collective for k in members if isinstance(step := rw.step(k), Communicate)]
            if _cheaper([s.collective for s in replanned], old):
                for k in reversed(members):  # a chain runs forward: members ascend
                    rw.splice(k, 1, ())
                rw.splice(members[0], 0, replanned)
                if not replanned:  # the chain comes back to where it started
                    rw.rename(target, first.source)
                continue  # the replanned chain may fuse further
        i = rw.after(i)
    return rw.result()


def _cost(collectives: Sequence[Collective]) -> tuple[int, int]:
    return sum(c.bytes_per_device for c in collectives), len(collectives)


def _cheaper(new: Sequence[Collective], old: Sequence[Collective]) -> bool:
    """Whether a replanned chain beats the old one: fewer bytes; or as many in fewer
    collectives, each sending over mesh axes an old one spans. A group over more axes runs
    at its slowest axis's link (`cost.cluster.Cluster.link`): one all_gather over [0, 1]
    sends the bytes of a gather over [1] and one over [0], all at axis 0's speed, which the
    search (pricing the materialized chain) did not count."""
    (sent, count), (was_sent, was_count) = _cost(new), _cost(old)
    if sent != was_sent:
        return sent < was_sent
    spans = {frozenset(c.mesh_axes) for c in old}
    kept = all(frozenset(c.mesh_axes) in spans for c in new if c.bytes_per_device)
    return count < was_count and kept


# ---- 2. reassociate --------------------------------------------------------------------------


def reassociate(program: Program, graph: Graph) -> Program:
    """`f(c(x), c(y))` -> `c(f(x, y))` for an all_reduce or reduce_scatter c that f commutes
    with.

    One forward walk. A rewrite changes the readers of the collectives' sources only, and an
    op before the rewritten one cannot read those collectives (they fed the rewritten op
    alone), so no earlier op can become rewritable: the walk goes on from the moved op, which
    may now read collectives itself, as a walk restarted from the first step would.
    """
    rw = _Rewrite(program, graph)
    i: Position = (0, 0)
    while (found := rw.at(i)) is not None:
        i, step = found
        rule = _elementwise(step, rw)
        moved = _reassociate_at(i, rule, rw) if rule is not None else None
        i = rw.after(i) if moved is None else moved
    return rw.result()


def _reassociate_at(index: Position, rule: OpRule, rw: _Rewrite) -> Position | None:
    """Rewrite the op at `index` if it can be; the position of the moved op, else None."""
    step = rw.step(index)
    assert isinstance(step, Compute)
    data = [i for i, m in enumerate(rule.operands) if m is not None and step.inputs[i]]
    comms: list[Communicate] = []
    for i in data:
        at = rw.producer(step.inputs[i])
        found = rw.step(at) if at is not None else None
        if not isinstance(found, Communicate) or rw.sole_reader(found.target) != index:
            return None
        comms.append(found)
    if not comms:
        return None
    first = comms[0].collective
    if first.kind not in (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER):
        return None
    if step.op.type not in COMMUTES_WITH.get(first.reduction or ReductionKind.SUM, ()):
        return None
    output = step.outputs[0]
    for c in comms:
        same = (c.collective.kind, c.collective.mesh_axes, c.collective.src, c.collective.dst)
        if same != (first.kind, first.mesh_axes, first.src, first.dst):
            return None
        if rw.tensors[c.source].shape != rw.tensors[output].shape:
            return None  # a broadcast operand would be reduced once per copy
    partial = rw.fresh(output, first.src)
    inputs = list(step.inputs)
    for i, c in zip(data, comms, strict=True):
        inputs[i] = c.source
    rank = len(rw.tensors[output].shape)
    moved = Compute(
        dataclasses.replace(step.op, inputs=tuple(inputs), outputs=(partial,)),
        _option(first.src, rank),
    )
    rw.splice(index, 1, [moved, *rw.chain(partial, first.dst, output)])
    for c in comms:
        rw.splice(rw.position(c), 1, ())
    return rw.position(moved)


# ---- 3. move_all_gathers_down ----------------------------------------------------------------


def move_all_gathers_down(program: Program, graph: Graph, split: bool = True) -> Program:
    """Move all_gathers below the elementwise ops reading them; with `split`, split
    all_reduces into reduce_scatter + all_gather where that lets the all_gather move.

    One forward walk that rewrites the first collective it can, as a walk restarted from the
    first step after every rewrite would (the order decides the program), without the
    restarts. A rewrite changes the readers of the moved op's operands only, so the only
    earlier collectives that may move now are those defining the operands: the walk steps
    back to the first of them. Worked example, relu(all_gather(all_reduce(p))): the all_reduce
    cannot split first (its reader is the all_gather, not an elementwise op); once the
    all_gather moves below relu, relu reads the all_reduce, which splits into reduce_scatter
    + all_gather, and that all_gather moves below relu too.
    """
    rw = _Rewrite(program, graph)
    i: Position = (0, 0)
    while (found := rw.at(i)) is not None:
        i, step = found
        rerouted: list[str] | None = None
        if isinstance(step, Communicate) and step.collective.kind is CollectiveKind.ALL_GATHER:
            rerouted = _move_down(i, rw)
        elif (
            split
            and isinstance(step, Communicate)
            and step.collective.kind is CollectiveKind.ALL_REDUCE
        ):
            rerouted = _decompose(i, rw)
        i = rw.after(i) if rerouted is None else min([i, *rw.producers(rerouted)])
    return rw.result()


@dataclass(frozen=True)
class _Move:
    """How an elementwise op computes below an all_gather of one of its operands: the op at
    `reader` computes its result in `fine` (the all_gather's source sharding) with `option`;
    `inputs[i]` is None for the gathered operand, else the operand and the all_slices taking
    it to `fine` (none for an absent or shape operand, or one already there); `after` gathers
    the result back."""

    reader: Position
    fine: Sharding
    option: ShardingOption
    inputs: tuple[tuple[str, tuple[Collective, ...]] | None, ...]
    after: tuple[Collective, ...]


def _plan_move(gathered: str, gather: Collective, rw: _Rewrite) -> _Move | None:
    """How the only reader of `gathered`, the result of `gather`, computes below it: when that
    is an elementwise op whose other operands reach the finer sharding for free and whose
    result is no bigger. Plans only: nothing is named or changed."""
    reader = rw.sole_reader(gathered)
    if reader is None:
        return None
    step = rw.step(reader)
    rule = _elementwise(step, rw)
    if rule is None or not isinstance(step, Compute):
        return None
    fine, coarse = gather.src, gather.dst
    out = rw.tensors[step.outputs[0]]
    if fine.partial_axes or out.shape != rw.tensors[gathered].shape or out.sharding != coarse:
        return None
    option = _option(fine, len(out.shape))
    inputs: list[tuple[str, tuple[Collective, ...]] | None] = []
    for i, name in enumerate(step.inputs):
        if not name or rule.operands[i] is None:
            inputs.append((name, ()))
        elif name == gathered:
            inputs.append(None)
        else:
            slices = rw.plan(name, rule.operand_sharding(option, i))
            if any(c.kind is not CollectiveKind.ALL_SLICE for c in slices):
                return None
            inputs.append((name, slices))
    after = rw.plan(dataclasses.replace(out, sharding=fine), coarse)
    if _cost(after) > _cost([gather]):
        return None
    return _Move(reader, fine, option, tuple(inputs), after)


def _commit_move(move: _Move, source: str, rw: _Rewrite) -> list[str]:
    """Replace the reader by the slices of its operands, itself computing on shards (reading
    the gather's `source`), and the gather of its result; the operands it re-routes."""
    step = rw.step(move.reader)
    assert isinstance(step, Compute)
    inputs, slices = [], []
    for planned in move.inputs:
        if planned is None:
            inputs.append(source)
            continue
        name, collectives = planned
        chain = rw.name_chain(name, collectives)
        slices += chain
        inputs.append(chain[-1].target if chain else name)
    output = step.outputs[0]
    computed = rw.fresh(output, move.fine)
    after = rw.name_chain(computed, move.after, output)
    op = dataclasses.replace(step.op, inputs=tuple(inputs), outputs=(computed,))
    rw.splice(move.reader, 1, [*slices, Compute(op, move.option), *after])
    return [source, *step.inputs]


def _move_down(index: Position, rw: _Rewrite) -> list[str] | None:
    """Move the all_gather at `index` below its only reader when `_plan_move` finds how; the
    operands re-routed, else None."""
    gather = rw.step(index)
    assert isinstance(gather, Communicate)
    move = _plan_move(gather.target, gather.collective, rw)
    if move is None:
        return None
    rerouted = _commit_move(move, gather.source, rw)
    rw.splice(index, 1, ())  # the reader came after the gather: its position holds
    return rerouted


def _decompose(index: Position, rw: _Rewrite) -> list[str] | None:
    """Replace the all_reduce at `index` by reduce_scatter + all_gather when the all_gather then
    moves down; the operands re-routed, else None. The scatter dim: one the value is already
    split on (its shards stay contiguous pieces of the same rows), else the largest; the first
    that works."""
    reduce = rw.step(index)
    assert isinstance(reduce, Communicate)
    reader = rw.sole_reader(reduce.target)
    if reader is None or _elementwise(rw.step(reader), rw) is None:
        return None
    dst = reduce.collective.dst
    whole = rw.tensors[reduce.target]
    shape, axes = whole.shape, reduce.collective.mesh_axes
    order = sorted(range(len(shape)), key=lambda d: (not dst.axes_of(d), -shape[d], d))
    for dim in order:
        split = list(dst.split_axes) + [()] * (len(shape) - len(dst.split_axes))
        split[dim] = tuple(split[dim]) + tuple(axes)
        scattered = dataclasses.replace(dst, split_axes=tuple(split))
        down = rw.plan(reduce.source, scattered)
        up = rw.plan(dataclasses.replace(whole, sharding=scattered), dst)
        if not _single(down, CollectiveKind.REDUCE_SCATTER) or not _single(
            up, CollectiveKind.ALL_GATHER
        ):
            continue
        # The all_gather would make reduce.target again: its reader is the all_reduce's.
        move = _plan_move(reduce.target, up[0], rw)
        if move is None:
            continue
        middle = rw.fresh(reduce.target, scattered)
        rerouted = _commit_move(move, middle, rw)
        rw.splice(index, 1, [Communicate(reduce.source, middle, down[0])])
        return rerouted
    return None


def _single(collectives: Sequence[Collective], kind: CollectiveKind) -> bool:
    return len(collectives) == 1 and collectives[0].kind is kind


# ---- the pipeline ----------------------------------------------------------------------------


def passes(split: bool) -> tuple[Callable[[Program, Graph], Program], ...]:
    """The CCL passes in order; `split`: may all_reduces split to let all_gathers move."""
    return (
        fuse_reshards,
        reassociate,
        functools.partial(move_all_gathers_down, split=split),
        fuse_reshards,
    )


def optimize_collectives(program: Program, graph: Graph) -> Program:
    """The CCL passes, in order, without and then with splitting all_reduces. A split
    pays only when the moved all_gather then fuses with a later reshard; otherwise it sends the
    same bytes in two collectives where upstream MLIR and XLA send one all_reduce. So the two
    programs are compared by bytes sent, then collectives (free all_slices not counted), and
    the unsplit one wins a tie."""
    candidates = []
    for split in (False, True):
        if split and not any(
            c.collective.kind is CollectiveKind.ALL_REDUCE for c in program.communications
        ):
            break  # nothing to split: the same program again
        optimized = program
        for run in passes(split):
            optimized = run(optimized, graph)
        candidates.append(optimized)
    return min(candidates, key=_traffic)


def _traffic(program: Program) -> tuple[int, int]:
    """Bytes a device sends, then the collectives that send them."""
    sent = [c.collective for c in program.communications if c.collective.bytes_per_device]
    return sum(c.bytes_per_device for c in sent), len(sent)

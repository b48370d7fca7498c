"""The collective-communication (CCL) passes of seed 001, as rewrites of a sharded `Program`.

Run in this order by `optimize_collectives`:

1. `fuse_reshards` — a chain of collectives on one value whose intermediate tensors nobody else
   reads is replanned from its first sharding to its last by `plan_reshard`. This one rule is
   seed 001's all-reduce folding (all_reduce [0] then all_reduce [1] is all_reduce [0, 1]) and
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
   all_gather then moves; this is seed 004's "all-reduce decompose & all-gather move down":

       h = all_reduce(dot1) [0]      ->   h' = reduce_scatter(dot1) [0] onto dim 2
       r = max(h, zero)                    r' = max(h', all_slice(zero))
                                           r  = all_gather(r') [0] on dim 2
4. `fuse_reshards` again: the moved all_gather may now meet the next reshard of its value.

Every rewrite keeps the program's meaning (the tests execute programs before and after on all
devices) and never adds bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

from autoshard.ir import dtypes
from autoshard.ir.graph import Graph
from autoshard.plan import ShardingOption
from autoshard.program import Communicate, Compute, Program, Step, Tensor, step_index
from autoshard.reshard import Collective, CollectiveKind, plan_reshard
from autoshard.rules import IteratorType, OpRule, rule_for
from autoshard.rules.elementwise import ELEMENTWISE
from autoshard.sharding import ReductionKind, Sharding

COMMUTES_WITH = {
    ReductionKind.SUM: frozenset({"Add", "Sub", "Sum", "Neg", "Identity"}),
    ReductionKind.MAX: frozenset({"Max", "Identity"}),
    ReductionKind.MIN: frozenset({"Min", "Identity"}),
}
"""Elementwise ops f with f(reduce(x_i), reduce(y_i)) = reduce(f(x_i, y_i)) for the reduction."""


class _Steps(list[Step]):
    """The steps being rewritten; every change bumps `version`, so the producer and reader
    index is rebuilt only when the steps changed (the passes ask far more than they change)."""

    version = 0

    def _changed(self) -> None:
        self.version += 1

    def __setitem__(self, key, value):  # type: ignore[no-untyped-def]
        self._changed()
        super().__setitem__(key, value)

    def __delitem__(self, key):  # type: ignore[no-untyped-def]
        self._changed()
        super().__delitem__(key)

    def remove(self, value: Step) -> None:
        self._changed()
        super().remove(value)


class _Rewrite:
    """A mutable copy of a program's steps and tensors, for one pass."""

    def __init__(self, program: Program, graph: Graph) -> None:
        self.program, self.graph = program, graph
        self.steps: _Steps = _Steps(program.steps)
        self._index: tuple[tuple[int, int, tuple[str, ...]], dict, dict] | None = None
        self.tensors: dict[str, Tensor] = dict(program.tensors)
        self.counter = itertools.count(1)

    def result(self) -> Program:
        return dataclasses.replace(self.program, steps=tuple(self.steps), tensors=self.live())

    def live(self) -> dict[str, Tensor]:
        used = set(self.program.inputs) | set(self.program.constants) | set(self.program.outputs)
        used |= {name for step in self.steps for name in (*step.inputs, *step.outputs)}
        return {name: t for name, t in self.tensors.items() if name in used}

    def rename(self, old: str, new: str) -> None:
        """Every read of tensor `old` reads `new` instead."""

        def swap(names: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(new if n == old else n for n in names)

        for i, step in enumerate(self.steps):
            if old not in step.inputs:
                continue
            if isinstance(step, Compute):
                self.steps[i] = dataclasses.replace(
                    step, op=dataclasses.replace(step.op, inputs=swap(step.op.inputs))
                )
            else:
                self.steps[i] = dataclasses.replace(step, source=new)
        self.program = dataclasses.replace(self.program, outputs=swap(self.program.outputs))

    def index(self) -> tuple[dict[str, int], dict[str, list[int]]]:
        """Producer and readers (-1 for each graph output) of every tensor."""
        key = (id(self.steps), self.steps.version, self.program.outputs)
        if self._index is None or self._index[0] != key:
            self._index = (key, *step_index(self.steps, self.program.outputs))
        return self._index[1], self._index[2]

    def producer(self, tensor: str) -> int | None:
        return self.index()[0].get(tensor)

    def readers(self, tensor: str) -> list[int]:
        """Indices of the steps reading `tensor`; -1 for each graph output it is."""
        return list(self.index()[1].get(tensor, []))

    def sole_reader(self, tensor: str) -> int | None:
        readers = set(self.readers(tensor))
        return readers.pop() if len(readers) == 1 and -1 not in readers else None

    def fresh(self, like: str, sharding: Sharding) -> str:
        old = self.tensors[like]
        while (name := f"{old.value}~c{next(self.counter)}") in self.tensors:
            pass
        self.tensors[name] = dataclasses.replace(old, name=name, sharding=sharding)
        return name

    def plan(self, source: str, sharding: Sharding) -> tuple[Collective, ...]:
        tensor = self.tensors[source]
        size = dtypes.nbytes(tensor.dtype, 1)
        return plan_reshard(tensor.sharding, sharding, tensor.shape, self.program.mesh, size)

    def chain(
        self, source: str, sharding: Sharding, target: str | None = None
    ) -> list[Communicate]:
        """Communicate steps from `source` to `sharding`, the last one defining `target`."""
        steps: list[Communicate] = []
        current = source
        collectives = self.plan(source, sharding)
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
    while dead := [i for i, s in enumerate(rw.steps) if isinstance(s, Communicate)
                   and not rw.readers(s.target)]:  # fmt: skip
        for i in reversed(dead):
            del rw.steps[i]
    i = 0
    while i < len(rw.steps):
        first = rw.steps[i]
        if not isinstance(first, Communicate):
            i += 1
            continue
        members = [i]
        while (nxt := rw.sole_reader(rw.steps[members[-1]].outputs[0])) is not None and isinstance(
            rw.steps[nxt], Communicate
        ):
            members.append(nxt)
        if len(members) > 1:
            target = rw.steps[members[-1]].outputs[0]
            replanned = rw.chain(first.source, rw.tensors[target].sharding, target)
            old = [step for k in members if isinstance(step := rw.steps[k], Communicate)]
            if _cost(replanned) < _cost(old):
                for k in reversed(members):
                    del rw.steps[k]
                rw.steps[members[0] : members[0]] = replanned
                if not replanned:  # the chain comes back to where it started
                    rw.rename(target, first.source)
                continue  # the replanned chain may fuse further
        i += 1
    return rw.result()


def _cost(steps: Sequence[Communicate]) -> tuple[int, int]:
    return sum(s.collective.bytes_per_device for s in steps), len(steps)


# ---- 2. reassociate --------------------------------------------------------------------------


def reassociate(program: Program, graph: Graph) -> Program:
    """`f(c(x), c(y))` -> `c(f(x, y))` for an all_reduce or reduce_scatter c that f commutes
    with."""
    rw = _Rewrite(program, graph)
    changed = True
    while changed:
        changed = False
        for i, step in enumerate(rw.steps):
            if (rule := _elementwise(step, rw)) is not None and _reassociate_at(i, rule, rw):
                changed = True
                break
    return rw.result()


def _reassociate_at(index: int, rule: OpRule, rw: _Rewrite) -> bool:
    step = rw.steps[index]
    assert isinstance(step, Compute)
    data = [i for i, m in enumerate(rule.operands) if m is not None and step.inputs[i]]
    comms: list[Communicate] = []
    for i in data:
        at = rw.producer(step.inputs[i])
        found = rw.steps[at] if at is not None else None
        if not isinstance(found, Communicate) or rw.sole_reader(found.target) != index:
            return False
        comms.append(found)
    if not comms:
        return False
    first = comms[0].collective
    if first.kind not in (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER):
        return False
    if step.op.type not in COMMUTES_WITH.get(first.reduction or ReductionKind.SUM, ()):
        return False
    output = step.outputs[0]
    for c in comms:
        same = (c.collective.kind, c.collective.mesh_axes, c.collective.src, c.collective.dst)
        if same != (first.kind, first.mesh_axes, first.src, first.dst):
            return False
        if rw.tensors[c.source].shape != rw.tensors[output].shape:
            return False  # a broadcast operand would be reduced once per copy
    partial = rw.fresh(output, first.src)
    inputs = list(step.inputs)
    for i, c in zip(data, comms, strict=True):
        inputs[i] = c.source
    rank = len(rw.tensors[output].shape)
    moved = Compute(
        dataclasses.replace(step.op, inputs=tuple(inputs), outputs=(partial,)),
        _option(first.src, rank),
    )
    rw.steps[index : index + 1] = [moved, *rw.chain(partial, first.dst, output)]
    for c in comms:
        rw.steps.remove(c)
    return True


# ---- 3. move_all_gathers_down ----------------------------------------------------------------


def move_all_gathers_down(program: Program, graph: Graph) -> Program:
    """Move all_gathers below the elementwise ops reading them; split all_reduces into
    reduce_scatter + all_gather where that lets the all_gather move."""
    rw = _Rewrite(program, graph)
    changed = True
    while changed:
        changed = False
        for i, step in enumerate(rw.steps):
            if not isinstance(step, Communicate):
                continue
            kind = step.collective.kind
            if kind is CollectiveKind.ALL_GATHER and _move_down(i, rw):
                changed = True
                break
            if kind is CollectiveKind.ALL_REDUCE and _decompose(i, rw):
                changed = True
                break
    return rw.result()


def _move_down(index: int, rw: _Rewrite) -> bool:
    """Move the all_gather at `index` below its only reader, if that is an elementwise op whose
    other operands reach the finer sharding for free and whose result is no bigger."""
    gather = rw.steps[index]
    assert isinstance(gather, Communicate)
    reader = rw.sole_reader(gather.target)
    if reader is None:
        return False
    step = rw.steps[reader]
    rule = _elementwise(step, rw)
    if rule is None or not isinstance(step, Compute):
        return False
    fine, coarse = gather.collective.src, gather.collective.dst
    output = step.outputs[0]
    out = rw.tensors[output]
    if fine.partial_axes or out.shape != rw.tensors[gather.target].shape:
        return False
    if out.sharding != coarse:
        return False
    option = _option(fine, len(out.shape))
    inputs, slices = list(step.inputs), []
    for i, name in enumerate(step.inputs):
        if not name or rule.operands[i] is None:
            continue
        if name == gather.target:
            inputs[i] = gather.source
            continue
        need = rule.operand_sharding(option, i)
        chain = rw.chain(name, need)
        if any(c.collective.kind is not CollectiveKind.ALL_SLICE for c in chain):
            return False
        slices += chain
        inputs[i] = chain[-1].outputs[0] if chain else name
    computed = rw.fresh(output, fine)
    after = rw.chain(computed, coarse, output)
    if _cost(after) > _cost([gather]):
        return False
    moved = Compute(dataclasses.replace(step.op, inputs=tuple(inputs), outputs=(computed,)), option)
    rw.steps[reader : reader + 1] = [*slices, moved, *after]
    del rw.steps[index]
    return True


def _decompose(index: int, rw: _Rewrite) -> bool:
    """Replace the all_reduce at `index` by reduce_scatter + all_gather when the all_gather then
    moves down. The scatter dim: one the value is already split on (its shards stay contiguous
    pieces of the same rows), else the largest; the first that works."""
    reduce = rw.steps[index]
    assert isinstance(reduce, Communicate)
    reader = rw.sole_reader(reduce.target)
    if reader is None or _elementwise(rw.steps[reader], rw) is None:
        return False
    dst = reduce.collective.dst
    shape = rw.tensors[reduce.target].shape
    axes = reduce.collective.mesh_axes
    order = sorted(range(len(shape)), key=lambda d: (not dst.axes_of(d), -shape[d], d))
    for dim in order:
        split = list(dst.split_axes) + [()] * (len(shape) - len(dst.split_axes))
        split[dim] = tuple(split[dim]) + tuple(axes)
        scattered = dataclasses.replace(dst, split_axes=tuple(split))
        trial = _Rewrite(rw.result(), rw.graph)
        trial.counter = rw.counter
        middle = trial.fresh(reduce.target, scattered)
        down = trial.chain(reduce.source, scattered, middle)
        up = trial.chain(middle, dst, reduce.target)
        if not _single(down, CollectiveKind.REDUCE_SCATTER) or not _single(
            up, CollectiveKind.ALL_GATHER
        ):
            continue
        trial.steps[index : index + 1] = [*down, *up]
        if _move_down(index + 1, trial):
            rw.steps, rw.tensors = _Steps(trial.steps), trial.tensors
            return True
    return False


def _single(steps: Sequence[Communicate], kind: CollectiveKind) -> bool:
    return len(steps) == 1 and steps[0].collective.kind is kind


# ---- the pipeline ----------------------------------------------------------------------------

PASSES: tuple[Callable[[Program, Graph], Program], ...] = (
    fuse_reshards,
    reassociate,
    move_all_gathers_down,
    fuse_reshards,
)


def optimize_collectives(program: Program, graph: Graph) -> Program:
    """Seed 001's CCL passes, in order."""
    for run in PASSES:
        program = run(program, graph)
    return program

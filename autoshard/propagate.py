"""Sharding propagation (docs/design/propagation.md).

From a few annotations, complete the sharding of every value and the sharding option of every
op: walk the ops backward, then forward; at each op, `option` derives the sharding option from
the shardings already known around it (getShardingOption) and `annotate` writes the implied
shardings on its operands and results that lack one (setShardingAnnotations).

What an op reads, in order (results first, then operands):
  0. the required annotations that bind it: its results' own, then its operands' for-users
     ones (`mesh.shard ... annotate_for_users`: how every user reads the value;
     materialization puts a reshard before the users, so no mark propagated from elsewhere overrides
     it);
  1. its results: the result-side mark of each, the for-users annotations of its results (how
     the users read them, which a reshard after the op can give, so they never bind the op:
     upstream partitions a K-split matmul whose users want its result split into a partial
     result and a reduce_scatter), then the marks propagated from its users;
  2. its operands: the mark for this use, then the operand's own result-side mark.
Within each, user marks (required, then hints) come before propagated ones. An op that cannot
read an operand as a required for-users annotation asks (no rule, or no option of its rule
reads it so) is an error naming the op, the value and the sharding. A dim's mesh axes
fix the loop the dim's map names; a later mark that disagrees is skipped, unless it and the
earlier one are both required: then the annotations conflict and the error names the op, the
value and both shardings. A propagated mark only asks for splits (its unsplit dims say nothing),
so a replicated guess never blocks a split found later. A loop is split only over mesh axes
whose device count divides it, so every split is exact; invalid loops are never split.

Reading the marks in order gives one option; reading any one of them first gives others. The
op takes the one that moves the fewest bytes (its operands from how they are held, its results
to how they are held or read, as `plan_reshard` moves them), the in-order one on a tie, never
one that reads an operand otherwise than a user required, and never one that drops the splits
of a non-binding user annotation read earlier to keep a later one's: of two such annotations
whose splits cannot both be kept, the first read wins, as upstream's sharding-propagation keeps
the first combination of annotations that fits (`y = x + z` follows x; a returned y annotated
for its users is produced so). So the fewest bytes only rescue splits: an operand split that a
replicated mark would skip is kept when it saves gathering a weight (the 2x4 MLP of
tests/golden/test_conformance.py).

Worked example (the MLP of docs/design/propagation.md on mesh [2]; x required [[], [], [0]], the
second dot's result required partial = sum[0]): backward, dot2's partial result puts its reduction
loop d3 on axis 0, so its lhs (the max) gets [[], [], [0]]; the max passes it to dot1's result,
whose option becomes [[], [], [0]] (d2, the n loop, on axis 0); x's own mark [[], [], [0]] would put
d3 on axis 0 too and is skipped, so dot1 reads x replicated: materialization all_gathers it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from autoshard.annotations import Annotation, binds, check_annotations, unread
from autoshard.errors import AutoshardError, ShardingError
from autoshard.ir import dtypes
from autoshard.ir.graph import Graph, Op
from autoshard.mesh import Mesh
from autoshard.plan import RETURN, Plan, computed_shardings, returned_as
from autoshard.reshard import plan_reshard
from autoshard.rules import IteratorType, OpRule, rule_for
from autoshard.rules.base import IndexingMap, ring_loops
from autoshard.sharding import Sharding, ShardingOption


class ConflictError(AutoshardError):
    """Two required annotations ask one op for incompatible shardings."""


class Source(enum.IntEnum):
    PROPAGATED = 0
    HINT = 1
    REQUIRED = 2


@dataclass(frozen=True)
class Mark:
    """A sharding known for a value (result side) or for one use of it (operand side).

    `binding` is False for an operand's own result-side mark as its consumer sees it: a
    required `x` pins how x is held, not how each user reads it (a user may reshard: the
    3-axis MLP of tests/golden/test_seed_004.py reads its required [[], [], [0, 1, 2]] input as
    [[], [], [0]]).
    """

    sharding: Sharding
    source: Source
    origin: str  # the value whose annotation this is, for messages
    binding: bool = True


class _State:
    def __init__(self, graph: Graph, mesh: Mesh, fixed: Mapping[str, ShardingOption]) -> None:
        self.graph, self.mesh, self.fixed = graph, mesh, fixed
        self.result: dict[str, Mark] = {}
        self.use: dict[tuple[str, int], Mark] = {}
        self.rules: dict[str, OpRule | None] = {op.name: rule_for(op, graph) for op in graph.ops}
        self.options: dict[str, ShardingOption] = {}

    def uses(self, value: str) -> list[tuple[str, int]]:
        places = [
            (op.name, i)
            for op in self.graph.consumers(value)
            for i, name in enumerate(op.inputs)
            if name == value
        ]
        places += [(RETURN, i) for i, name in enumerate(self.graph.outputs) if name == value]
        return places

    def mark(self, key: Any, mark: Mark, table: dict[Any, Mark]) -> None:
        old = table.get(key)
        if (
            old is not None
            and old.source == mark.source == Source.REQUIRED
            and old.sharding != mark.sharding
        ):
            raise ConflictError(
                f"conflicting required annotations of {mark.origin!r}: "
                f"{old.sharding} and {mark.sharding}"
            )
        if old is None or mark.source > old.source:
            table[key] = mark

    # ---- getShardingOption ------------------------------------------------------------------

    def option(self, op: Op, rule: OpRule) -> ShardingOption:
        """The option the marks around the op ask for, read in order (conflicts between
        required marks are errors); or, if it moves fewer bytes, the option found by reading
        one of the marks first: a required operand split that the first reading skipped for a
        replicated mark may save gathering a weight (GSPMD's choice by operand shardings)."""
        if op.name in self.fixed:
            return self.checked(op, rule, self.fixed[op.name])
        marks = self.marks(op, rule)
        best = self.read(op, rule, marks)
        if len(marks) < 2:
            return best
        cost, kept = self.moved(op, rule, best), _kept(rule, marks, best)
        for first in range(1, len(marks)):
            try:
                candidate = self.read(op, rule, [marks[first], *marks[:first], *marks[first + 1 :]])
            except ConflictError:
                continue
            if not all(
                candidate.loops[loop] == axes
                for side, _, _, mark, indexing in marks
                if side == 1 and mark.binding and mark.source is Source.REQUIRED
                for loop, axes in _wanted(rule, mark, indexing, False).items()
            ):
                continue  # the op must read an operand as a user required
            if _kept(rule, marks, candidate) < kept:
                continue  # it drops a user's splits for a later one's: the first one wins
            moved = self.moved(op, rule, candidate)
            if moved < cost:
                best, cost = candidate, moved
        return best

    def marks(self, op: Op, rule: OpRule) -> list[tuple[int, int, int, Mark, IndexingMap]]:
        """The marks around the op, in the order they are read (module docstring)."""
        marks: list[tuple[int, int, int, Mark, IndexingMap]] = []
        for j, name in enumerate(op.outputs):
            marks += [(0, -m.source, 0, m, rule.results[j]) for m in [self.result.get(name)] if m]
            for k, use in enumerate(self.uses(name), 1):
                mark = self.use.get(use)
                if mark is None:
                    continue
                if mark.source is not Source.PROPAGATED:
                    # A user's for-users mark says how the users read the result, not how the
                    # op makes it (a reshard may come between: annotate_for_users): it binds
                    # the op to nothing, so the required marks that do come first.
                    mark = dataclasses.replace(mark, binding=False)
                marks.append((0, -mark.source, k, mark, rule.results[j]))
        for i, name in enumerate(op.inputs):
            indexing = rule.operands[i] if i < len(rule.operands) else None
            if not name or indexing is None:
                continue
            held = self.result.get(name)
            found = [self.use.get((op.name, i)), held and dataclasses.replace(held, binding=False)]
            marks += [(1, -m.source, 2 * i + k, m, indexing) for k, m in enumerate(found) if m]
        return sorted(marks, key=lambda m: (not _binds(m[3]), *m[:3]))

    def read(
        self, op: Op, rule: OpRule, marks: list[tuple[int, int, int, Mark, IndexingMap]]
    ) -> ShardingOption:
        """The option of reading `marks` in their order: each fixes the loops it names that
        earlier ones left free."""
        loops: list[tuple[int, ...] | None] = [None] * len(rule.loops)
        owners: list[Mark | None] = [None] * len(rule.loops)
        for side, _, _, mark, indexing in marks:
            self.apply(op, rule, mark, indexing, side != 1, loops, owners)
        return ShardingOption(tuple(axes or () for axes in loops))

    def moved(self, op: Op, rule: OpRule, option: ShardingOption) -> float:
        """Bytes a device sends to run the op with `option`: its operands from how they are
        known to be held; its results to how they are required to be held, else to every
        sharding known to be read of them (as `plan_reshard` moves them; a reshard no
        collective makes is infinite)."""
        pairs: list[tuple[str, Sharding, Sharding]] = []
        for i, name in enumerate(op.inputs):
            held = self.result.get(name)
            if name and i < len(rule.operands) and held is not None:
                pairs.append((name, held.sharding, rule.operand_sharding(option, i)))
        for j, name in enumerate(op.outputs):
            if not name:
                continue
            produced, held = rule.result_sharding(option, j), self.result.get(name)
            if held is not None and held.source is Source.REQUIRED:
                pairs.append((name, produced, held.sharding))  # its users read it as held
                continue
            wanted = [self.use.get(u) for u in self.uses(name)]
            pairs += [(name, produced, m.sharding) for m in wanted if m is not None]
        total = 0.0
        for name, src, dst in pairs:
            value = self.graph.values[name]
            try:
                plan = plan_reshard(src, dst, value.shape, self.mesh, dtypes.nbytes(value.dtype, 1))
            except ShardingError:
                return math.inf
            total += sum(c.bytes_per_device for c in plan)
        return total

    def checked(self, op: Op, rule: OpRule, option: ShardingOption) -> ShardingOption:
        """A user's sharding option for `op`: one entry per loop, mesh axes used once, invalid
        loops unsplit."""
        where = f"sharding option {option} of op '{op.name}' ({op.type})"
        if len(option.loops) != len(rule.loops):
            raise AutoshardError(
                f"{where} has {len(option.loops)} loops; the op has {len(rule.loops)}"
            )
        rings = ring_loops(option)
        for home, ring in rings:
            if (home, ring) not in rule.ring:
                axis = min(set(option.loops[home]) & set(option.loops[ring]))
                raise AutoshardError(
                    f"{where}: mesh axis {axis} splits on dims {home} and {ring}, and the op has "
                    f"no ring attention over them (its rings: {list(rule.ring)})"
                )
        passed = {ring for _, ring in rings}
        axes = [a for i, loop in enumerate(option.loops) if i not in passed for a in loop]
        Sharding(tuple((a,) for a in axes)).check(self.mesh)  # each axis exists, used once
        for i, (loop, split) in enumerate(zip(rule.loops, option.loops, strict=True)):
            if split and loop.kind is IteratorType.INVALID and i not in passed:
                raise AutoshardError(f"{where} splits loop d{i}, which cannot be split")
        return option

    def apply(
        self,
        op: Op,
        rule: OpRule,
        mark: Mark,
        indexing: IndexingMap,
        is_result: bool,
        loops: list[tuple[int, ...] | None],
        owners: list[Mark | None],
    ) -> None:
        """Fix the loops `mark` names, skipping what contradicts earlier marks."""
        wanted = _wanted(rule, mark, indexing, is_result)
        for loop, axes in sorted(wanted.items()):
            if loops[loop] == axes:
                continue
            clash = loops[loop] is not None and loops[loop] != axes
            taken = {a for i, other in enumerate(loops) if other and i != loop for a in other}
            unfit = bool(axes) and (
                rule.loops[loop].kind is IteratorType.INVALID
                or rule.loops[loop].size % self.mesh.group_size(axes) != 0
                or bool(taken & set(axes))
            )
            if clash or unfit:
                # The mark that stands in the way: this loop's owner, or the owner of the loop
                # already holding one of these mesh axes.
                holder = next(
                    (
                        i
                        for i, other in enumerate(loops)
                        if other and i != loop and taken & set(other) & set(axes)
                    ),
                    loop,
                )
                earlier = owners[loop] if clash else owners[holder]
                # A value's result-side and for-users annotations may differ (that is what
                # annotate_for_users is for: a reshard); two values' required ones may not.
                if (
                    mark.source is Source.REQUIRED
                    and mark.binding
                    and earlier is not None
                    and earlier.source is Source.REQUIRED
                    and earlier.binding
                    and earlier.origin != mark.origin
                ):
                    raise ConflictError(
                        f"op '{op.name}' ({op.type}) cannot follow both required annotations: "
                        f"{earlier.origin!r} as {earlier.sharding} and {mark.origin!r} as "
                        f"{mark.sharding}"
                    )
                continue
            loops[loop] = axes
            owners[loop] = mark

    # ---- setShardingAnnotations ---------------------------------------------------------------

    def annotate(self, op: Op, rule: OpRule, option: ShardingOption) -> None:
        """Mark the op's results and operands as its option implies. Propagated marks are
        rewritten (the forward pass refines what the backward pass guessed); user marks never."""
        for j, name in enumerate(op.outputs):
            if name and self._guessed(self.result.get(name)):
                self.result[name] = Mark(rule.result_sharding(option, j), Source.PROPAGATED, name)
        for i, name in enumerate(op.inputs):
            if name and i < len(rule.operands) and self._guessed(self.use.get((op.name, i))):
                sharding = rule.operand_sharding(option, i)
                self.use[(op.name, i)] = Mark(sharding, Source.PROPAGATED, name)

    @staticmethod
    def _guessed(mark: Mark | None) -> bool:
        return mark is None or mark.source is Source.PROPAGATED

    def visit(self, op: Op) -> None:
        rule = self.rules[op.name]
        if rule is None:
            return
        option = self.option(op, rule)
        self.options[op.name] = option
        self.annotate(op, rule, option)


def _binds(mark: Mark) -> bool:
    """A required annotation the op must follow: its result's, or its operand's for users."""
    return mark.source is Source.REQUIRED and mark.binding


def _kept(
    rule: OpRule, marks: list[tuple[int, int, int, Mark, IndexingMap]], option: ShardingOption
) -> tuple[bool, ...]:
    """For each split-asking user mark that binds nothing, in the order the marks are read:
    does `option` keep its splits? Compared as tuples, an option that drops an earlier mark's
    split for a later one's comes out smaller (upstream tries the annotations in this order and
    keeps the first that fits: `y = x + z` follows x, the first operand)."""
    return tuple(
        all(option.loops[loop] == axes for loop, axes in wanted.items() if axes)
        for side, _, _, mark, indexing in marks
        if mark.source is not Source.PROPAGATED and not _binds(mark)
        for wanted in [_wanted(rule, mark, indexing, side != 1)]
        if any(wanted.values())
    )


def _wanted(
    rule: OpRule, mark: Mark, indexing: IndexingMap, is_result: bool
) -> dict[int, tuple[int, ...]]:
    """The loops a mark names and the mesh axes it puts on each. A propagated mark only asks
    for splits; a partial result names the reduction loop it comes from, when there is one."""
    wanted: dict[int, tuple[int, ...]] = {}
    split = mark.sharding.split_axes
    for dim in range(len(indexing.dims)):
        axes = split[dim] if dim < len(split) else ()
        if not axes and mark.source is Source.PROPAGATED:
            continue
        loop = indexing.loop_of(dim)
        if loop is None:
            continue
        wanted[loop] = axes
    partial = mark.sharding.partial_axes
    reductions = [i for i, x in enumerate(rule.loops) if x.kind is IteratorType.REDUCTION]
    if (
        partial
        and is_result
        and len(reductions) == 1
        and rule.loops[reductions[0]].reduction is mark.sharding.partial_type
    ):
        wanted[reductions[0]] = partial
    return wanted


def propagate(
    graph: Graph,
    mesh: Mesh,
    annotations: Iterable[Annotation] = (),
    options: Mapping[str, ShardingOption] | None = None,
) -> Plan:
    """Complete the shardings of `graph` on `mesh` from annotations and fixed op options."""
    annotations = tuple(annotations)
    check_annotations(annotations, {n: v.shape for n, v in graph.values.items()}, mesh)
    state = _State(graph, mesh, options or {})
    for a in annotations:
        mark = Mark(a.sharding, Source.REQUIRED if a.required else Source.HINT, a.value)
        if a.for_users:
            for use in state.uses(a.value):
                if use[0] == RETURN or binds(graph.op_by_name[use[0]]):
                    state.mark(use, mark, state.use)
        else:
            state.mark(a.value, mark, state.result)
    user_results = dict(state.result)
    for op in reversed(graph.ops):
        state.visit(op)
    for op in graph.ops:
        state.visit(op)
    return _resolve(graph, mesh, state, user_results)


def _resolve(graph: Graph, mesh: Mesh, state: _State, user: Mapping[str, Mark]) -> Plan:
    """Final shardings: each op computes with its option; values are held as produced, unless
    a required result annotation says otherwise; producer-less values (inputs, weights) are
    held as annotated, else as their first user needs them; constants stay replicated. Graph
    outputs are returned as annotated for their users, else as held, reduced unless a user
    required them partial."""
    produced, needs, unruled = computed_shardings(graph, state.options, state.rules)
    for (name, i), asked in state.use.items():
        if (
            name != RETURN
            and asked.source is Source.REQUIRED
            and needs[(name, i)] != asked.sharding
        ):
            op = graph.op_by_name[name]
            option = state.options.get(name)
            how = f"its option {option} reads it as {needs[(name, i)]}" if option else "no rule"
            raise ConflictError(unread(op.name, op.type, asked.origin, asked.sharding, how))
    values: dict[str, Sharding] = {}
    for name in graph.values:
        mark = user.get(name)
        if name in produced:
            required = mark is not None and mark.source is Source.REQUIRED
            values[name] = mark.sharding if mark and required else produced[name]
        elif name in graph.constants:
            values[name] = produced[name] = Sharding()
        else:
            firsts = [state.use[u] for u in state.uses(name) if u in state.use]
            best = max(firsts, key=lambda m: m.source, default=None)
            chosen = mark or best
            values[name] = produced[name] = chosen.sharding if chosen else Sharding()
    for i, name in enumerate(graph.outputs):
        mark = state.use.get((RETURN, i))
        if mark is not None and mark.source is not Source.PROPAGATED:
            needs[(RETURN, i)] = mark.sharding
        elif name in user and user[name].source is Source.REQUIRED:
            needs[(RETURN, i)] = values[name]  # held as the user pinned it, partial or not
        else:
            # A partial sum is no value to return: a propagated partial output is reduced
            # (Megatron's MLP ends in the row projection's all_reduce), its splits kept.
            needs[(RETURN, i)] = returned_as(graph, values, name)
    options = {op.name: state.options.get(op.name) for op in graph.ops}
    return Plan(mesh, options, values, produced, needs, unruled)

"""Candidate sharding options of one op: its rule's loops x the mesh's axes.

Every assignment of mesh axes to loops: each axis splits one loop or none, several axes on one
loop in every order ([[0, 1]] and [[1, 0]] lay shards out differently), a reduction loop split
makes a partial result. A split must be exact (the loop size divisible by the devices splitting
it) and invalid loops are never split, as in propagation. Two options that read and write the
same shardings are one candidate (the one with fewer FLOPs per device is kept: the other is
dominated), e.g. splitting a loop of size 1 is impossible anyway, and a loop seen by no operand
nor result does not exist in the rules.

    MatMul [8, 16] x [16, 32] on mesh 2x2: loops d0 (8), d1 (32), d2 (16, reduction);
    axis 0 in {none, d0, d1, d2} x axis 1 in {none, d0, d1, d2}, plus the reversed orders of
    the two axes on one loop: 16 + 3 = 19 candidates.

An attention kernel's rule may add ring attention (`OpRule.ring`): its key loop split over the
axes that split its query loop, the keys passed around them (`rules.base.ring_loops`). An op
that commutes with a reduction (`OpRule.partial`: Add of two partial sums) adds, after the
others, every option again with some of the axes it leaves unused partial: it reads its data
operands and writes its results as partial values over them (`[[0]] partial = sum[1]`).
"""

from __future__ import annotations

import functools
import itertools

from autoshard.mesh import Mesh
from autoshard.rules import IteratorType, OpRule
from autoshard.sharding import Sharding, ShardingOption


def candidates(rule: OpRule, mesh: Mesh) -> tuple[ShardingOption, ...]:
    """The distinct candidate options of an op, in a fixed order (replicated first)."""
    loops = len(rule.loops)
    axes = range(len(mesh.shape))
    seen: dict[tuple, ShardingOption] = {}
    for placement in itertools.product(range(-1, loops), repeat=len(axes)):
        groups: list[list[int]] = [[] for _ in range(loops)]
        for axis, loop in zip(axes, placement, strict=True):
            if loop >= 0:
                groups[loop].append(axis)
        if not all(_splittable(rule, i, g, mesh) for i, g in enumerate(groups)):
            continue
        for orders in itertools.product(*(itertools.permutations(g) for g in groups)):
            option = ShardingOption(tuple(tuple(o) for o in orders))
            key = _boundary(rule, option)
            if key not in seen:
                seen[key] = option
    found = list(seen.values())
    for option in found[:]:  # a ring reads and writes like a split may: a key of its own
        found += [ring for ring in _rings(rule, option, mesh) if ring not in found]
    for option in list(seen.values()):
        for partial in _partials(rule, option, mesh):
            if (key := _boundary(rule, partial)) not in seen:
                seen[key] = partial
                found.append(partial)
    return tuple(found)


def _partials(rule: OpRule, option: ShardingOption, mesh: Mesh) -> list[ShardingOption]:
    """`option` reading and writing partial values (`OpRule.partial`) over each nonempty set of
    the mesh axes it leaves unused, smaller sets first, for each reduction the op allows (an
    axis of one device holds no partial values)."""
    used = {a for axes in option.loops for a in axes}
    unused = [a for a, size in enumerate(mesh.shape) if a not in used and size > 1]
    return [
        ShardingOption(option.loops, axes, kind)
        for kind in rule.partial
        for size in range(1, len(unused) + 1)
        for axes in itertools.combinations(unused, size)
    ]


def _rings(rule: OpRule, option: ShardingOption, mesh: Mesh) -> list[ShardingOption]:
    """Ring attention variants of `option` (`rules.base.ring_loops`): for each of the rule's
    (home, ring) pairs whose home loop `option` splits and whose ring loop it leaves whole,
    the ring loop split over the same axes, where they divide it."""
    found = []
    for home, ring in rule.ring:
        axes = option.loops[home]
        if axes and not option.loops[ring] and rule.loops[ring].size % mesh.group_size(axes) == 0:
            loops = list(option.loops)
            loops[ring] = axes
            found.append(ShardingOption(tuple(loops)))
    return found


@functools.lru_cache(maxsize=1 << 16)
def option_reads(rule: OpRule, option: ShardingOption, index: int) -> Sharding:
    """The sharding `option` reads operand `index` in (`OpRule.operand_sharding`, cached: the
    search asks for every candidate of every op, and again for the copies in repeated layers)."""
    return rule.operand_sharding(option, index)


@functools.lru_cache(maxsize=1 << 16)
def option_writes(rule: OpRule, option: ShardingOption, index: int) -> Sharding:
    """The sharding `option` writes result `index` in (`OpRule.result_sharding`, cached alike)."""
    return rule.result_sharding(option, index)


def _splittable(rule: OpRule, loop: int, axes: list[int], mesh: Mesh) -> bool:
    if not axes:
        return True
    spec = rule.loops[loop]
    return spec.kind is not IteratorType.INVALID and spec.size % mesh.group_size(axes) == 0


def _boundary(rule: OpRule, option: ShardingOption) -> tuple:
    """What the rest of the graph sees of an option: its operand and result shardings."""
    return (
        tuple(rule.operand_sharding(option, i) for i in range(len(rule.operands))),
        tuple(rule.result_sharding(option, j) for j in range(len(rule.results))),
    )

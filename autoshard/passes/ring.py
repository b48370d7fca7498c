"""Ring attention partitioned (`cost/ring.py` prices it, `rules.base.ring_loops` shards it):
each key and value block an op computed with a ring option reads is passed around the ring's
axes, p - 1 permutes of one block each (`cost.ring.ring_permute`, the sends the price counts),
and each device joins the blocks it has held, in key order, into the keys it computes over.

Worked example: K split on its sequence over an axis of 4 devices, device r holding block r.
After t permutes device r holds block (r - t) mod 4, so device 2 holds blocks 2, 1, 0, 3 in
turn and concatenates them as 0, 1, 2, 3: the same keys the unsplit op reads, and its local op
(its query rows, the causal mask written out for them: `local_rewrites.local_attention`) is
the all-gather-K/V op. A runtime that overlaps would run the kernel on each block as it
arrives and combine the partial results by their log-sum-exp; onnxruntime runs the joined
op, which computes the same numbers. The gradients a ring passes back (dK, dV) are computed
whole over the device's rows and summed around the ring, a block a step (`ring_steps`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from autoshard.collectives import Collective
from autoshard.cost.ring import passed, ring_permute
from autoshard.ir import dtypes
from autoshard.ir.graph import Attrs, Op
from autoshard.passes.local_rewrites import Partitioning
from autoshard.program import Communicate, Compute, Tensor
from autoshard.rules import OpRule
from autoshard.rules.base import ring_loops


class Ringing(Partitioning, Protocol):
    """What the ring needs of the partitioner beyond a local rewrite's (`_Partitioner`)."""

    def add_tensor(self, tensor: Tensor) -> None: ...


@dataclass
class RingSteps:
    """A step computed as ring attention: the step reading its passed operands whole and
    writing its passed results whole (`step`); the permutes passing operand blocks before it
    (`before`) and each device's ops joining them (`joins`); each device's ops right after it
    (`first`), then the permutes passing the results' partial sums on, each with the ops that
    add a device's own part to what it received (`after`)."""

    step: Compute
    before: list[Communicate] = field(default_factory=list)
    joins: list[list[Op]] = field(default_factory=list)
    first: list[list[Op]] = field(default_factory=list)
    after: list[tuple[Communicate, list[list[Op]]]] = field(default_factory=list)


def ring_steps(p: Ringing, step: Compute, rule: OpRule) -> RingSteps:
    """`step`'s op with a ring option, partitioned as the module's docstring says. A result
    the ring passes (dK, dV: indexed by the keys alone) is computed whole over the device's
    query rows, then summed around the ring: device r starts from its part of block r - 1 and
    for t = 1 .. p-1 adds its part of block r - 1 - t to what its neighbour sends, ending with
    block r summed over every device's rows."""
    op, option = step.op, step.option
    assert option is not None
    axes = option.loops[ring_loops(option)[0][0]]
    size = p.mesh.group_size(axes)
    inputs, outputs = list(op.inputs), list(op.outputs)
    out = RingSteps(step, joins=[[] for _ in range(p.count)], first=[[] for _ in range(p.count)])
    for index in passed(rule, option):
        if index < len(rule.operands):
            if index < len(inputs) and inputs[index]:
                inputs[index] = _join(p, op, inputs[index], axes, size, out)
        elif outputs[index - len(rule.operands)]:
            at = index - len(rule.operands)
            outputs[at] = _sum_around(p, op, outputs[at], axes, size, out)
    out.step = dataclasses.replace(
        step, op=dataclasses.replace(op, inputs=tuple(inputs), outputs=tuple(outputs))
    )
    return out


def _join(p: Ringing, op: Op, name: str, axes: tuple[int, ...], size: int, out: RingSteps) -> str:
    """The blocks of operand `name` passed around and joined in key order: its whole."""
    tensor = p.tensors[name]
    dim = _dim(tensor, axes)
    blocks = [name]
    for t in range(1, size):
        block = p.fresh(f"{name}.ring{t}")
        p.add_tensor(dataclasses.replace(tensor, name=block))
        out.before.append(Communicate(blocks[-1], block, _permute(p, tensor, name, axes)))
        blocks.append(block)
    whole = _whole(p, tensor, dim, f"{name}.keys")
    for k in range(p.count):
        rank = _rank(p, name, dim, k, size)
        ordered = tuple(blocks[(rank - j) % size] for j in range(size))
        out.joins[k].append(Op(f"{op.name}/join.{name}", "Concat", "", ordered, (whole,),
                               Attrs({"axis": dim})))  # fmt: skip
    return whole


def _sum_around(
    p: Ringing, op: Op, name: str, axes: tuple[int, ...], size: int, out: RingSteps
) -> str:
    """Result `name` written whole (the name the op writes instead), summed around the ring
    into its blocks (`ring_steps`)."""
    tensor = p.tensors[name]
    dim = _dim(tensor, axes)
    whole = _whole(p, tensor, dim, f"{name}.parts")
    blk = tensor.shape[dim] // size
    ranks = [_rank(p, name, dim, k, size) for k in range(p.count)]

    def part(t: int, target: str) -> list[list[Op]]:
        """Each device's slice of its whole result: block (rank - 1 - t) mod size."""
        starts = [np.array([((r - 1 - t) % size) * blk]) for r in ranks]
        begin = p.device_constant(f"{name}.from{t}", "int64", starts)
        end = p.device_constant(f"{name}.to{t}", "int64", [s + blk for s in starts])
        axis = p.device_constant(f"{name}.axis{t}", "int64", [np.array([dim])] * p.count)
        return [[Op(f"{op.name}/part{t}.{name}", "Slice", "", (whole, begin, end, axis),
                    (target,))] for _ in range(p.count)]  # fmt: skip

    current = name if size == 1 else p.fresh(f"{name}.sum0")
    if current != name:
        p.add_tensor(dataclasses.replace(tensor, name=current))
    out.first = [a + b for a, b in zip(out.first, part(0, current), strict=True)]
    for t in range(1, size):
        received = p.fresh(f"{name}.ring{t}")
        p.add_tensor(dataclasses.replace(tensor, name=received))
        move = Communicate(current, received, _permute(p, tensor, name, axes))
        mine = p.fresh(f"{name}.part{t}")
        p.add_tensor(dataclasses.replace(tensor, name=mine))
        summed = name if t == size - 1 else p.fresh(f"{name}.sum{t}")
        if summed != name:
            p.add_tensor(dataclasses.replace(tensor, name=summed))
        ops = [
            [*slice_ops, Op(f"{op.name}/add{t}.{name}", "Add", "", (received, mine), (summed,))]
            for slice_ops in part(t, mine)
        ]
        out.after.append((move, ops))
        current = summed
    return whole


def _permute(p: Ringing, tensor: Tensor, name: str, axes: tuple[int, ...]) -> Collective:
    sent = dtypes.nbytes(tensor.dtype, math.prod(p.local(name)[0]))
    return ring_permute(axes, p.mesh, tensor.shape, tensor.sharding, sent)


def _dim(tensor: Tensor, axes: tuple[int, ...]) -> int:
    return next(d for d in range(len(tensor.shape)) if tensor.sharding.axes_of(d) == axes)


def _whole(p: Ringing, tensor: Tensor, dim: int, base: str) -> str:
    """A new tensor holding `tensor` whole along `dim` on each device."""
    split = list(tensor.sharding.split_axes)
    split[dim] = ()
    name = p.fresh(base)
    sharding = dataclasses.replace(tensor.sharding, split_axes=tuple(split))
    p.add_tensor(dataclasses.replace(tensor, name=name, sharding=sharding))
    return name


def _rank(p: Ringing, name: str, dim: int, device: int, size: int) -> int:
    """Which block of `name` along `dim` device `device` holds (its place in the ring)."""
    lo, _ = p.regions(name)[device][dim]
    return lo * size // p.tensors[name].shape[dim]

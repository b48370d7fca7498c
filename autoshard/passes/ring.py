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
op, which computes the same numbers. The gradients a ring passes back (dK, dV) are not
partitioned here: such an op is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

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


def ring_steps(
    p: Ringing, step: Compute, rule: OpRule
) -> tuple[Compute, list[Communicate], list[list[Op]]]:
    """The op of `step` reading its passed operands whole, the permutes that pass their
    blocks (program steps, in order) and each device's ops joining them (to run after the
    permutes, before the op)."""
    op, option = step.op, step.option
    assert option is not None
    home = ring_loops(option)[0][0]
    axes = option.loops[home]
    size = p.mesh.group_size(axes)
    inputs, moves = list(op.inputs), []
    joins: list[list[Op]] = [[] for _ in range(p.count)]
    for index in passed(rule, option):
        if index >= len(op.inputs):
            raise p.fail(op, "ring attention passing its gradients back is not partitioned")
        name = op.inputs[index]
        tensor = p.tensors[name]
        dim = next(d for d in range(len(tensor.shape)) if tensor.sharding.axes_of(d) == axes)
        local = p.local(name)[0]
        sent = dtypes.nbytes(tensor.dtype, _count(local))
        blocks = [name]
        for t in range(1, size):
            block = p.fresh(f"{name}.ring{t}")
            p.add_tensor(dataclasses.replace(tensor, name=block))
            collective = ring_permute(axes, p.mesh, tensor.shape, tensor.sharding, sent)
            moves.append(Communicate(blocks[-1], block, collective))
            blocks.append(block)
        split = list(tensor.sharding.split_axes)
        split[dim] = ()
        whole = p.fresh(f"{name}.keys")
        p.add_tensor(
            dataclasses.replace(tensor, name=whole, sharding=dataclasses.replace(
                tensor.sharding, split_axes=tuple(split)))
        )  # fmt: skip
        for k in range(p.count):
            rank = _rank(p, name, dim, k, size)
            ordered = tuple(blocks[(rank - j) % size] for j in range(size))
            joins[k].append(Op(f"{op.name}/ring{index}", "Concat", "", ordered, (whole,),
                               Attrs({"axis": dim})))  # fmt: skip
        inputs[index] = whole
    return dataclasses.replace(step, op=dataclasses.replace(op, inputs=tuple(inputs))), moves, joins


def _rank(p: Ringing, name: str, dim: int, device: int, size: int) -> int:
    """Which block of `name` along `dim` device `device` holds (its place in the ring)."""
    lo, _ = p.regions(name)[device][dim]
    return lo * size // p.tensors[name].shape[dim]


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count

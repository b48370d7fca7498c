"""What one kernel costs one device (`OpCost`), and the local shard it runs on: an op's loops,
or a tensor's dims, each split over its mesh axes (ceil-sized: the largest shard)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.mesh import Mesh
from autoshard.rules import IndexingMap, OpRule
from autoshard.sharding import ShardingOption, shard_size


@dataclass(frozen=True)
class OpCost:
    """What one device spends on one op: FLOPs, bytes read and written, seconds."""

    flops: int
    bytes: int
    seconds: float

    def __add__(self, other: OpCost) -> OpCost:
        return OpCost(
            self.flops + other.flops, self.bytes + other.bytes, self.seconds + other.seconds
        )

    def to_json(self) -> dict[str, object]:
        return {"flops": self.flops, "bytes": self.bytes, "compute_s": self.seconds}


def local_loops(rule: OpRule, option: ShardingOption, mesh: Mesh) -> list[int]:
    """The local sizes of an op's loops computed with `option`."""
    return [
        shard_size(loop.size, mesh.group_size(axes))
        for loop, axes in zip(rule.loops, option.loops, strict=True)
    ]


def local_shape(
    shape: Sequence[int], indexing: IndexingMap, option: ShardingOption, mesh: Mesh
) -> list[int]:
    """The local shard's dims of a tensor of `shape` read through `indexing`."""
    return [
        shard_size(size, mesh.group_size([a for loop in indexing.loops(dim)
                                          for a in option.loops[loop]]))
        for dim, size in enumerate(shape)
    ]  # fmt: skip

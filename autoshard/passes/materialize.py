"""Materialization: where a value is held in another sharding than a user computes with, insert
a reshard and lower it to collectives with `plan_reshard` (the planner that also prices it).

Reshards appear in program order: a value whose required result annotation differs from what
its producer computes is resharded right after the producer; each use then gets what its op
needs. Two uses that need the same sharding of the same value share one reshard, so the bytes
counted are the bytes the program sends.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.ir import dtypes
from autoshard.ir.graph import Graph
from autoshard.propagate import RETURN, Propagation
from autoshard.reshard import Collective, plan_reshard
from autoshard.sharding import Sharding


@dataclass(frozen=True)
class Reshard:
    """`value` from `src` to `dst` before `user` reads it (user "" = right after the producer)."""

    value: str
    user: str
    src: Sharding
    dst: Sharding
    collectives: tuple[Collective, ...]


@dataclass(frozen=True)
class Materialized:
    graph: Graph
    propagation: Propagation
    reshards: tuple[Reshard, ...]

    @property
    def bytes_per_device(self) -> int:
        return sum(c.bytes_per_device for r in self.reshards for c in r.collectives)

    def collectives_json(self) -> list[dict[str, object]]:
        return [
            {"value": r.value, "user": r.user or None, **c.to_json()}
            for r in self.reshards
            for c in r.collectives
        ]


def materialize(
    graph: Graph, propagation: Propagation, itemsize: int | None = None
) -> Materialized:
    """The reshards of a completed propagation, in program order."""
    values, mesh = propagation.values, propagation.mesh
    reshards: list[Reshard] = []
    done: set[tuple[str, Sharding]] = set()

    def add(value: str, user: str, src: Sharding, dst: Sharding) -> None:
        if src == dst or (value, dst) in done:
            return
        done.add((value, dst))
        info = graph.values[value]
        size = itemsize or dtypes.nbytes(info.dtype, 1)
        plan = plan_reshard(src, dst, info.shape, mesh, size)
        reshards.append(Reshard(value, user, src, dst, plan))

    for op in graph.ops:
        for i, name in enumerate(op.inputs):
            if name:
                add(name, op.name, values[name], propagation.needs[(op.name, i)])
        for name in op.outputs:
            if name:
                add(name, "", propagation.produced[name], values[name])
    for i, name in enumerate(graph.outputs):
        add(name, RETURN, values[name], propagation.needs[(RETURN, i)])
    return Materialized(graph, propagation, tuple(reshards))

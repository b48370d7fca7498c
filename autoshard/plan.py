"""The plan: a sharding for every value and a sharding option for every op.

Propagation completes one from annotations; search picks one by cost; materialization turns one
into a sharded program. `RETURN` is the pseudo-op reading the graph outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.sharding import Sharding

RETURN = "<return>"
"""The pseudo-op that uses the graph outputs; its operand i is output i."""


@dataclass(frozen=True)
class ShardingOption:
    """Mesh axes per loop of an op (seed 001): `[[], [], [0]]` splits loop d2 over axis 0."""

    loops: tuple[tuple[int, ...], ...]

    def __str__(self) -> str:
        loops = list(self.loops)
        while loops and not loops[-1]:
            loops.pop()
        return "[" + ", ".join("[" + ", ".join(map(str, a)) + "]" for a in loops or [()]) + "]"

    @staticmethod
    def parse(text: str, loop_count: int) -> ShardingOption:
        split = Sharding.parse(text).split_axes
        if len(split) > loop_count:
            raise AutoshardError(
                f"sharding option {text} has {len(split)} loops; the op has {loop_count}"
            )
        return ShardingOption(tuple(split) + ((),) * (loop_count - len(split)))


@dataclass(frozen=True)
class Plan:
    """The completed shardings. `values[v]` is how v is held; `produced[v]` how its producer
    computes it (they differ where a required result annotation needs a reshard right after
    the producer); `needs[(op, i)]` the sharding op computes its operand i with (the `RETURN`
    pseudo-op's operands are the graph outputs)."""

    mesh: Mesh
    options: Mapping[str, ShardingOption | None]
    values: Mapping[str, Sharding]
    produced: Mapping[str, Sharding]
    needs: Mapping[tuple[str, int], Sharding]
    unruled: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        """A mesh axis of one device splits and reduces nothing: it is dropped from every
        sharding and option, so that no collective (of zero bytes) is made over it."""
        trivial = frozenset(a for a, size in enumerate(self.mesh.shape) if size == 1)
        if not trivial:
            return

        def drop(axes: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(a for a in axes if a not in trivial)

        def canonical(sharding: Sharding) -> Sharding:
            if sharding.halo_sizes or sharding.sharded_dims_offsets:
                return sharding  # their counts follow the split dims: kept as given
            return Sharding(
                tuple(drop(axes) for axes in sharding.split_axes),
                drop(sharding.partial_axes),
                sharding.partial_type,
            )

        options = {
            op: None if option is None else ShardingOption(tuple(map(drop, option.loops)))
            for op, option in self.options.items()
        }
        object.__setattr__(self, "options", options)
        for name in ("values", "produced", "needs"):
            table: Mapping[object, Sharding] = getattr(self, name)
            object.__setattr__(self, name, {k: canonical(v) for k, v in table.items()})

"""The tensors the memory model counts for a value: its bytes in a sharding, and the tensors a
reshard of several collectives makes on its way, for the reshards counted (`targets`).

The shardings tuples of a value's copies in repeated layers are one object, so what is worked
out from them is cached by their id (and the tuples kept alive, so that the id stays theirs).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from autoshard.cost.liveness import held_bytes
from autoshard.errors import ShardingError
from autoshard.ir import dtypes
from autoshard.ir.graph import Graph
from autoshard.mesh import Mesh
from autoshard.reshard import plan_reshard
from autoshard.search.memory.literals import Literals
from autoshard.search.memory.rows import Literal
from autoshard.sharding import Sharding

Held = tuple[int | None, tuple[Sharding, ...]]
"""How a value is held: its deciding group and its sharding under each of the group's choices
(a constant: no group, one sharding)."""

Target = tuple[tuple[int, ...], str, Sharding]
"""A reshard target counted: a tensor's shape and dtype and the sharding it is resharded to."""


class Tensors:
    """The bytes and reshard steps of the values of `graph` on `mesh`, each held as `held`
    says; reshards to the `targets` are counted step by step, all others as one step."""

    def __init__(
        self,
        graph: Graph,
        mesh: Mesh,
        held: Callable[[str], Held],
        targets: Collection[Target],
        literals: Literals,
    ) -> None:
        self.graph, self.mesh, self.held = graph, mesh, held
        self.targets = targets
        self.literals = literals
        self.bytes_cache: dict[tuple[tuple[int, ...], str, str, Sharding], int] = {}
        self.vectors: dict[tuple[int, tuple[int, ...], str, str], np.ndarray] = {}
        self.steps_cache: dict[
            tuple[tuple[int, ...], str, Sharding, Sharding], tuple[Sharding, ...]
        ] = {}
        self.longest_cache: dict[tuple, int] = {}
        self.steps_to_cache: dict[tuple, dict[int, Literal | bool]] = {}
        self.passing_cache: dict[tuple, dict[Sharding, list[tuple[Sharding, Sharding]]]] = {}
        self.kept: list[tuple[Sharding, ...]] = []

    def nbytes(self, value: str, sharding: Sharding) -> int:
        """Bytes of `value`'s largest shard as a device holds it (`liveness.held_bytes`)."""
        info, fused = self.graph.values[value], self.graph.fused
        cache_key = (info.shape, info.dtype, fused.held(value), sharding)
        if cache_key not in self.bytes_cache:
            self.bytes_cache[cache_key] = held_bytes(
                value, info.shape, info.dtype, sharding, self.mesh, fused
            )
        return self.bytes_cache[cache_key]

    def held_bytes(self, value: str) -> np.ndarray:
        """The bytes of `value`'s held shard under each choice of its deciding group."""
        _, shardings = self.held(value)
        info = self.graph.values[value]
        held = self.graph.fused.held(value)
        cache_key = (id(shardings), info.shape, info.dtype, held)  # alike in repeated layers
        vector = self.vectors.get(cache_key)
        if vector is None:
            vector = np.array([self.nbytes(value, s) for s in shardings], dtype=np.int64)
            self.vectors[cache_key] = vector
            self.kept.append(shardings)  # alive, so that its id stays its own
        return vector

    def intermediates(self, name: str, src: Sharding, dst: Sharding) -> tuple[Sharding, ...]:
        """The shardings a reshard from `src` to `dst` makes on its way (its steps' results
        but the last), where reshards to `dst` are counted (`targets`)."""
        info = self.graph.values[name]
        cache_key = (info.shape, info.dtype, src, dst)
        if (info.shape, info.dtype, dst) not in self.targets:
            return ()
        if cache_key not in self.steps_cache:
            itemsize = dtypes.nbytes(info.dtype, 1)
            try:
                steps = plan_reshard(src, dst, info.shape, self.mesh, itemsize)
            except ShardingError:  # no plan holds and reads it so (the search prices it)
                steps = ()
            self.steps_cache[cache_key] = tuple(c.dst for c in steps[:-1])
        return self.steps_cache[cache_key]

    def longest(self, name: str, needs: tuple[Sharding, ...]) -> int:
        """The most collectives a reshard of `name` to one of `needs` takes, from any of the
        shardings it may be held in."""
        _, shardings = self.held(name)
        info = self.graph.values[name]
        cache_key = (id(shardings), id(needs), info.shape, info.dtype)
        if cache_key not in self.longest_cache:
            self.kept += [shardings, needs]  # alive, so that their ids stay their own
            choices_of = self.literals.choices_of
            self.longest_cache[cache_key] = (
                max(
                    len(self.intermediates(name, h, t)) + 1
                    for t in choices_of(needs)
                    if (info.shape, info.dtype, t) in self.targets
                    for h in choices_of(shardings)
                )
                if any((info.shape, info.dtype, t) in self.targets for t in needs)
                else 1
            )
        return self.longest_cache[cache_key]

    def steps_to(self, name: str, s: Sharding) -> dict[int, Literal | bool]:
        """How many steps a reshard of `name` to `s` takes, and when (its held choices)."""
        group, shardings = self.held(name)
        info = self.graph.values[name]
        cache_key = (id(shardings), info.shape, info.dtype, s)
        if (info.shape, info.dtype, s) not in self.targets:
            return {1: True}
        if cache_key not in self.steps_to_cache:
            literals = self.literals
            by_steps: dict[int, list[Literal | bool]] = {}
            for h in literals.choices_of(shardings):
                if h != s:
                    steps = len(self.intermediates(name, h, s)) + 1
                    by_steps.setdefault(steps, []).append(
                        literals.chosen(group, shardings, h, True)
                    )
            self.steps_to_cache[cache_key] = {
                steps: literals.combine(False, held_so) for steps, held_so in by_steps.items()
            }
        return self.steps_to_cache[cache_key]

    def passing_through(
        self, name: str, needed: Collection[Sharding]
    ) -> dict[Sharding, list[tuple[Sharding, Sharding]]]:
        """For each sharding that a reshard of several collectives (held h to needed t) makes
        on its way and a reader needs or another such reshard makes too, those (h, t): the
        tensors `materialize` may keep."""
        info = self.graph.values[name]
        _, shardings = self.held(name)
        cache_key = (id(shardings), info.shape, info.dtype, tuple(needed))
        if cache_key not in self.passing_cache:
            found: dict[Sharding, list[tuple[Sharding, Sharding]]] = {}
            for t in needed:
                if (info.shape, info.dtype, t) not in self.targets:
                    continue
                for h in self.literals.choices_of(shardings):
                    for m in self.intermediates(name, h, t):
                        found.setdefault(m, []).append((h, t))
            self.passing_cache[cache_key] = {
                m: ways for m, ways in found.items() if m in needed or len(ways) > 1
            }
        return self.passing_cache[cache_key]

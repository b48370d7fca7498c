"""A choice's communication as its program makes it, without lowering it.

The search's objective prices a value's reshard once per reader (docs/concepts/search.md);
materialization makes it once per value and sharding, and reuses a step an earlier reshard of
the value took (`passes.materialize.taken`), a training step's backward resharding a weight,
input, constant or recomputed layer's input again (`passes.materialize.reshards_again`).
`Traffic` replays that rule over the reads the search's memory rows are built from (each
value's home sharding and every read's sharding, under each choice of the groups deciding
them), so the seconds it gives for a choice are those of the materialized program's collectives
(`cost.price`), each run as often as the op it serves. The CCL passes that follow
materialization may send less still (one all_reduce after an Add of two, an all_gather moved
below an elementwise op): then the program's seconds are below these. Pricing a choice this way
reads every value of the graph once, not a layer, and stays far cheaper than lowering it (no
tensors, no program, no memory).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from autoshard.cost.cluster import Cluster
from autoshard.cost.price import collective_time
from autoshard.ir import dtypes
from autoshard.ir.graph import Graph
from autoshard.passes.materialize import backward_starts, reshards_again, taken
from autoshard.reshard import plan_reshard
from autoshard.search.memory.build import Chain
from autoshard.search.memory.slots import Read
from autoshard.search.memory.tensors import Held
from autoshard.sharding import Sharding


@dataclass(frozen=True, eq=False)
class Traffic:
    """Every value's home (`held`: the group deciding it and its sharding under each of the
    group's choices) and reads (`reads`: position, operand, group, sharding under each choice,
    in program order; the graph's outputs at position len(ops)), on `cluster`."""

    graph: Graph
    cluster: Cluster
    held: Mapping[str, Held]
    reads: Mapping[str, Sequence[Read]]
    _steps: dict[tuple, tuple[tuple[Sharding, float], ...]] = field(
        default_factory=dict, init=False
    )  # each reshard's steps, planned once

    def seconds(self, choice: Sequence[int]) -> tuple[float, frozenset[Chain]]:
        """The communication time of the program of `choice` (one choice per group), and the
        reshards of several collectives it makes (`budget.chains_of`)."""
        graph = self.graph
        starts, again = backward_starts(graph), reshards_again(graph)
        runs = [graph.runs(op.name) for op in graph.ops]
        runs.append(runs[-1] if runs else 1)  # the returns run with the last op
        total, chains = 0.0, set()
        for name, reads in self.reads.items():
            if not reads:
                continue
            group, shardings = self.held[name]
            home = shardings[0 if group is None else choice[group]]
            source = name in again
            reached, segment = {home}, 0
            for position, _, reader, needs in reads:
                if source and bisect.bisect_right(starts, position) != segment:
                    reached, segment = {home}, bisect.bisect_right(starts, position)
                need = needs[0 if reader is None else choice[reader]]
                if need in reached:
                    continue
                steps, made = self._reshard(name, home, need, reached)
                if len(steps) > 1:
                    info = graph.values[name]
                    chains.add((info.shape, info.dtype, home, need))
                for dst, seconds in made:
                    total += runs[position] * seconds
                    reached.add(dst)
        return total, frozenset(chains)

    def intermediates_bound(self, chains: Iterable[Chain]) -> int:
        """An upper bound of the bytes the intermediate tensors of `chains` (reshards of
        several collectives) add to a peak: each intermediate whole, all live at once."""
        total = 0
        for shape, dtype, src, dst in chains:
            steps = plan_reshard(src, dst, shape, self.cluster.mesh, dtypes.nbytes(dtype, 1))
            total += (len(steps) - 1) * dtypes.nbytes(dtype, math.prod(shape))
        return total

    def _reshard(
        self, name: str, home: Sharding, need: Sharding, reached: set[Sharding]
    ) -> tuple[tuple[tuple[Sharding, float], ...], list[tuple[Sharding, float]]]:
        """The steps from `home` to `need` (each its target and seconds), and those of them
        materialization makes, the value held in `reached` already."""
        info = self.graph.values[name]
        key = (info.shape, info.dtype, home, need)
        if key not in self._steps:
            mesh, size = self.cluster.mesh, dtypes.nbytes(info.dtype, 1)
            planned = plan_reshard(home, need, info.shape, mesh, size)
            self._steps[key] = tuple((c.dst, collective_time(c, self.cluster)) for c in planned)
        steps = self._steps[key]
        made = taken([dst for dst, _ in steps], reached)
        return steps, [step for step, new in zip(steps, made, strict=True) if new]

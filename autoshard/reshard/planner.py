"""Resharding: the collectives that turn a tensor of one sharding into another.

`plan_reshard(src, dst, shape, mesh)` returns the collectives; it is the single planner used
both to price an edge (search) and to emit it (materialize), so estimated and materialized
communication agree byte for byte.

The basis (docs/design/resharding.md), each step changing the sharding of one tensor dim:
    all_slice       append free mesh axes to a dim               [[]] -> [[1]]       free
    all_gather      drop the innermost axes of a dim             [[0, 1]] -> [[0]]
    all_to_all      move innermost axes of one dim to another    [[0], []] -> [[], [0]]
    all_reduce      reduce partial axes                          partial = sum[1] -> none
    reduce_scatter  reduce partial axes into a dim's split       partial = sum[1] -> [[1]]
    permute         devices swap whole shards                    [[0, 1]] -> [[1, 0]]
Only the innermost axes of a dim can be gathered: on mesh 2x2x2, `[[0], [1, 2]] -> [[0], [2]]`
is not one all_gather over axis 1, but `[[0], [1, 2]] -> [[0], [1]]` is one over 2.

The planner works on the graph of every sharding of the tensor over the mesh axes the two
shardings use (an axis neither uses stays out: detours through links of unknown speed are not
taken), joined by these steps, and returns the sequence moving the fewest bytes per device,
then the fewest collectives. A step is taken only when it is *exact*: when the dim does not
divide evenly, shards are ceil-sized and, e.g., gathering the inner axis of a 5-row
dim split 2x2 (shards 2, 2, 1, 0) does not give the 3-row shards of a 2-way split (3, 2); such a
dim is gathered whole and sliced from the full extent, which is always exact. The shortest path
between every two shardings is computed once per shape class (`basis.shape_classes`:
tensors alike but for dims that split evenly share the paths, their bytes scaled) with
Floyd-Warshall (ties go to the first path found, states in sorted order, so plans are
deterministic): materialization walks one path, the search prices all pairs of a tensor's
candidate shardings from the same table (`ReshardPrices`). Upstream MLIR's one-step resharding
gets multi-step cases on 2-D meshes wrong; this one is tested against an execution of every
planned sequence on all devices (`autoshard.execute.simulate`).

Bytes per device follow the ring algorithms (`collectives.ring_bytes`, the only place the
formulas are written) with n devices per group and the largest local shard; a permute sends
whole shards, one per device it serves.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from autoshard.collectives import Collective, CollectiveKind
from autoshard.errors import ShardingError
from autoshard.mesh import Mesh
from autoshard.reshard.basis import (
    Basis,
    Paths,
    Split,
    State,
    Step,
    StepGraph,
    axes_mask,
    basis_for,
    mask_axes,
    state_of,
    step_graph,
)
from autoshard.sharding import ReductionKind, Sharding


def plan_reshard(
    src: Sharding, dst: Sharding, shape: Sequence[int], mesh: Mesh, itemsize: int = 4
) -> tuple[Collective, ...]:
    """The cheapest exact sequence of collectives from `src` to `dst` (empty if equal)."""
    shape = tuple(shape)
    _check_one(src, shape, mesh)
    _check_one(dst, shape, mesh)
    _check_pair(src, dst)
    return _plan(src, dst, shape, mesh, itemsize)


class ReshardPrices:
    """What `plan_reshard`'s plans cost under one `price` per collective, for many pairs of
    shardings at once: the search asks for every pair of a tensor's candidate shardings.

    The paths are plan_reshard's own. Per tensor graph every step starting some path is priced
    once, and the cost of every pair follows from the shortest-path table, shortest paths
    first: cost(i, j) = price(i -> k) + cost(k, j), k the state the path goes to first.
    A price may depend on a collective's kind, mesh axes and bytes (as time and volume do), not
    on the order or reduction of partial axes: the steps are priced with sorted sum partials."""

    def __init__(self, mesh: Mesh, price: Callable[[Collective], float]) -> None:
        self.mesh, self.price = mesh, price
        self.tables: dict[tuple[Paths, int], np.ndarray] = {}
        self.step_prices: dict[tuple[CollectiveKind, tuple[int, ...], int], float] = {}

    def matrix(
        self,
        srcs: Sequence[Sharding],
        dsts: Sequence[Sharding],
        shape: Sequence[int],
        itemsize: int,
    ) -> np.ndarray:
        """Costs from each of `srcs` (rows) to each of `dsts` (columns)."""
        rows: dict[Sharding, int] = {}
        columns: dict[Sharding, int] = {}
        row_of = [rows.setdefault(s, len(rows)) for s in srcs]
        column_of = [columns.setdefault(d, len(columns)) for d in dsts]
        distinct = self.distinct(list(rows), list(columns), tuple(shape), itemsize)
        return distinct[np.ix_(row_of, column_of)]

    def distinct(
        self, srcs: list[Sharding], dsts: list[Sharding], shape: tuple[int, ...], itemsize: int
    ) -> np.ndarray:
        """Costs between distinct shardings: one table lookup per block of sources and
        targets over the same mesh axes (the same graph), however many pairs it holds."""
        for s in {*srcs, *dsts}:
            _check_one(s, shape, self.mesh)
        for dst in dsts:
            if dst.partial_axes:
                for src in srcs:
                    _check_pair(src, dst)
        rank = len(shape)
        out = np.empty((len(srcs), len(dsts)))
        starts = [state_of(s, rank) for s in srcs]
        ends = [state_of(d, rank) for d in dsts]
        sources: dict[tuple[int, bool], list[int]] = {}
        for r, src in enumerate(srcs):
            sources.setdefault((axes_mask(src), bool(src.partial_axes)), []).append(r)
        targets: dict[int, list[int]] = {}
        for c, dst in enumerate(dsts):
            targets.setdefault(axes_mask(dst), []).append(c)
        for (used, partial), rows in sources.items():
            for mask, columns in targets.items():
                graph = step_graph(shape, self.mesh, itemsize, mask_axes(used | mask), partial)
                if graph is None:
                    for r, c in itertools.product(rows, columns):
                        plan = _plan(srcs[r], dsts[c], shape, self.mesh, itemsize)
                        out[r, c] = sum(self.price(step) for step in plan)
                    continue
                i = np.array([graph.index[starts[r]] for r in rows])[:, None]
                j = np.array([graph.index[ends[c]] for c in columns])
                out[np.array(rows)[:, None], columns] = self.table(graph)[i, j]
        return out

    def table(self, graph: StepGraph) -> np.ndarray:
        """The costs between every two states of `graph`: one table per shape class and
        scale, which fix every step's kind, mesh axes and bytes."""
        key = (graph.paths, graph.scale)
        if key not in self.tables:
            order = tuple(range(self.mesh.ndim))
            paths = graph.paths
            count = len(paths.states)
            steps = paths.hops
            first = paths.next.astype(np.int64)
            hops = np.unique((np.arange(count)[:, None] * count + first)[steps > 0])
            price = np.zeros((count, count))
            for hop in hops.tolist():
                i, k = divmod(hop, count)
                step = paths.steps[(i, k)]
                # The price depends on the kind, mesh axes and bytes alone (above): a step
                # like one priced before, of this tensor or another, is not built again.
                like = (step.kind, step.mesh_axes, step.bytes_per_device * graph.scale)
                if like not in self.step_prices:
                    collective = graph.collective_of(i, k, order, ReductionKind.SUM)
                    self.step_prices[like] = self.price(collective)
                price[i, k] = self.step_prices[like]
            cost = np.where(paths.reachable, 0.0, np.nan)
            for level in range(1, int(steps.max(initial=0)) + 1):
                i, j = np.nonzero(steps == level)
                k = first[i, j]
                cost[i, j] = price[i, k] + cost[k, j]
            self.tables[key] = cost
        return self.tables[key]


@functools.lru_cache(maxsize=1 << 16)
def _check_one(sharding: Sharding, shape: tuple[int, ...], mesh: Mesh) -> None:
    """`ShardingError` unless the planner can reshard `sharding`; a sharding found valid is
    remembered (the search asks about the same ones for value after value)."""
    sharding.check(mesh, shape)
    if sharding.halo_sizes or sharding.sharded_dims_offsets:
        raise ShardingError(
            f"resharding {sharding} is not supported: halos and explicit offsets are not planned"
        )


def reachable(src: Sharding, dst: Sharding) -> bool:
    """Whether some reshard takes `src` to `dst`: no collective makes partial values, so `dst`
    is partial only over axes `src` is partial over, in the same reduction."""
    if not set(dst.partial_axes) <= set(src.partial_axes):
        return False
    return not dst.partial_axes or src.partial_type == dst.partial_type


def _check_pair(src: Sharding, dst: Sharding) -> None:
    if not set(dst.partial_axes) <= set(src.partial_axes):
        raise ShardingError(
            f"cannot reshard {src} to {dst}: a value cannot become partial over new mesh axes"
        )
    if dst.partial_axes and src.partial_type != dst.partial_type:
        raise ShardingError(f"cannot reshard {src} to {dst}: the partial reductions differ")


@functools.lru_cache(maxsize=65536)
def _plan(
    src: Sharding, dst: Sharding, shape: tuple[int, ...], mesh: Mesh, itemsize: int
) -> tuple[Collective, ...]:
    if src == dst:
        return ()
    axes = mask_axes(axes_mask(src) | axes_mask(dst))
    graph = step_graph(shape, mesh, itemsize, axes, bool(src.partial_axes))
    if graph is None:
        return _directed(src, dst, basis_for(shape, mesh, itemsize, axes))
    return walk(graph, src, dst)


def walk(graph: StepGraph, src: Sharding, dst: Sharding) -> tuple[Collective, ...]:
    """The collectives of `graph`'s cheapest path from `src` to `dst`."""
    rank = len(graph.shape)
    i, j = graph.index[state_of(src, rank)], graph.index[state_of(dst, rank)]
    steps = []
    while i != j:
        k = graph.next_step(i, j)
        steps.append(graph.collective_of(i, k, src.partial_axes, src.partial_type))
        i = k
    return tuple(steps)


def _directed(src: Sharding, dst: Sharding, basis: Basis) -> tuple[Collective, ...]:
    """Dijkstra from `src` over the steps making progress towards `dst`: slices, all-to-alls
    and reduce-scatters extending a dim towards its axes in `dst`, any gather, one all_reduce
    of the partial axes `dst` drops, permutes to `dst` or reordering one dim's axes."""
    rank = len(basis.shape)
    (target, kept), start = state_of(dst, rank), state_of(src, rank)

    def extends(split: Split, dim: int | None) -> bool:
        return dim is not None and target[dim][: len(split[dim])] == split[dim]

    def progress(step: Step, before: State, after: State) -> bool:
        if step.kind in (CollectiveKind.ALL_SLICE, CollectiveKind.ALL_TO_ALL):
            return extends(after[0], step.dim)
        if step.kind is CollectiveKind.ALL_REDUCE:
            return set(after[1]) == set(before[1]) & set(kept)
        if step.kind is CollectiveKind.REDUCE_SCATTER:
            return extends(after[0], step.dim) and not set(step.mesh_axes) & set(kept)
        return True

    frontier: list[tuple[int, int, int, State, tuple]] = [(0, 0, 0, start, ())]
    done: set[State] = set()
    pushed = itertools.count(1)
    while frontier:
        cost, count, _, state, path = heapq.heappop(frontier)
        if state == (target, kept):
            order, reduction = src.partial_axes, src.partial_type
            return tuple(basis.collective(a, b, step, order, reduction) for a, b, step in path)
        if state in done:
            continue
        done.add(state)
        split, partial = state
        moves = [
            (s, after) for s, after in basis.moves(split, partial) if progress(s, state, after)
        ]
        if not partial:
            goals = [] if kept else [target]
            for dim, axes in enumerate(split):
                goals += [
                    tuple(order if d == dim else a for d, a in enumerate(split))
                    for order in itertools.permutations(axes)
                    if order != axes
                ]
            for goal in goals:
                step = basis.permute(split, goal)
                if step is not None:
                    moves.append((step, (goal, ())))
        for step, after in moves:
            if after not in done:
                heapq.heappush(
                    frontier,
                    (
                        cost + step.bytes_per_device,
                        count + 1,
                        next(pushed),
                        after,
                        (*path, (state, after, step)),
                    ),
                )
    raise ShardingError(  # pragma: no cover - gather all, slice reaches all
        f"no exact resharding from {src} to {dst} on mesh {basis.mesh}"
    )


# ---- the graph of shardings --------------------------------------------------------------------

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
between every two shardings is computed once per (shape, mesh, itemsize, axes) with
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.collectives import Collective, CollectiveKind, ring_bytes
from autoshard.errors import ShardingError
from autoshard.mesh import Mesh
from autoshard.sharding import ReductionKind, Sharding, shard_bounds, shard_size

Split = tuple[tuple[int, ...], ...]


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
        self.tables: dict[_Graph, np.ndarray] = {}
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
        for s in {*srcs, *dsts}:
            _check_one(s, shape, self.mesh)
        rank = len(shape)
        out = np.empty((len(srcs), len(dsts)))
        masks = [_mask(d) for d in dsts]
        targets = [_state(d, rank) for d in dsts]
        for r, src in enumerate(srcs):
            for dst in dsts:
                if dst.partial_axes:
                    _check_pair(src, dst)
            start, used = _state(src, rank), _mask(src)
            columns: dict[int, list[int]] = {}
            for c, mask in enumerate(masks):
                columns.setdefault(used | mask, []).append(c)
            for mask, cs in columns.items():
                graph = _graph(shape, self.mesh, itemsize, _axes(mask), bool(src.partial_axes))
                if graph is None:
                    for c in cs:
                        plan = _plan(src, dsts[c], shape, self.mesh, itemsize)
                        out[r, c] = sum(self.price(step) for step in plan)
                    continue
                row = self.table(graph)[graph.index[start]]
                out[r, cs] = row[[graph.index[targets[c]] for c in cs]]
        return out

    def table(self, graph: _Graph) -> np.ndarray:
        if graph not in self.tables:
            order = tuple(range(self.mesh.ndim))
            count = len(graph.states)
            reachable = graph.length < _UNREACHABLE
            steps = np.where(reachable, graph.length % _STEP, 0)
            first = graph.next.astype(np.int64)
            hops = np.unique((np.arange(count)[:, None] * count + first)[steps > 0])
            price = np.zeros((count, count))
            for hop in hops.tolist():
                i, k = divmod(hop, count)
                step = graph.steps[(i, k)]
                # The price depends on the kind, mesh axes and bytes alone (above): a step
                # like one priced before, of this tensor or another, is not built again.
                key = (step.kind, step.mesh_axes, step.bytes_per_device)
                if key not in self.step_prices:
                    collective = graph.collective_of(i, k, order, ReductionKind.SUM)
                    self.step_prices[key] = self.price(collective)
                price[i, k] = self.step_prices[key]
            cost = np.where(reachable, 0.0, np.nan)
            for level in range(1, int(steps.max(initial=0)) + 1):
                i, j = np.nonzero(steps == level)
                k = first[i, j]
                cost[i, j] = price[i, k] + cost[k, j]
            self.tables[graph] = cost
        return self.tables[graph]


def _check_one(sharding: Sharding, shape: tuple[int, ...], mesh: Mesh) -> None:
    sharding.check(mesh, shape)
    if sharding.halo_sizes or sharding.sharded_dims_offsets:
        raise ShardingError(
            f"resharding {sharding} is not supported: halos and explicit offsets are not planned"
        )


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
    axes = _axes(_mask(src) | _mask(dst))
    graph = _graph(shape, mesh, itemsize, axes, bool(src.partial_axes))
    if graph is None:
        return _directed(src, dst, _basis(shape, mesh, itemsize, axes))
    i, j = graph.index[_state(src, len(shape))], graph.index[_state(dst, len(shape))]
    steps = []
    while i != j:
        k = graph.next_step(i, j)
        steps.append(graph.collective_of(i, k, src.partial_axes, src.partial_type))
        i = k
    return tuple(steps)


def _directed(src: Sharding, dst: Sharding, basis: _Basis) -> tuple[Collective, ...]:
    """Dijkstra from `src` over the steps making progress towards `dst`: slices, all-to-alls
    and reduce-scatters extending a dim towards its axes in `dst`, any gather, one all_reduce
    of the partial axes `dst` drops, permutes to `dst` or reordering one dim's axes."""
    rank = len(basis.shape)
    (target, kept), start = _state(dst, rank), _state(src, rank)

    def extends(split: Split, dim: int | None) -> bool:
        return dim is not None and target[dim][: len(split[dim])] == split[dim]

    def progress(step: _Step, before: State, after: State) -> bool:
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

State = tuple[Split, tuple[int, ...]]
"""A sharding as the planner sees it: split axes per dim (padded to the rank) and the partial
axes, sorted."""


def _state(sharding: Sharding, rank: int) -> State:
    return _pad(sharding.split_axes, rank), tuple(sorted(sharding.partial_axes))


def _pad(split: Split, rank: int) -> Split:
    return tuple(split) + ((),) * (rank - len(split))


@dataclass(frozen=True)
class _Step:
    """One basis collective between two states: what `Collective` says, less the shardings."""

    kind: CollectiveKind
    mesh_axes: tuple[int, ...]
    bytes_per_device: int
    dim: int | None = None
    to_dim: int | None = None


_STEP = 1 << 10
"""A path's length is `bytes * _STEP + collectives`: fewest bytes first, then fewest steps."""
_UNREACHABLE = 1 << 61  # twice it still fits in int64


_TABULATED = 700
"""States of the largest graph given a shortest-path table (Floyd-Warshall is cubic in them;
3-axis meshes stay below up to rank 6). Bigger graphs (4-axis meshes from rank 3 on) are
searched pair by pair (`_directed`)."""


def _mask(sharding: Sharding) -> int:
    """The mesh axes a sharding uses, as bits."""
    return sum(1 << a for a in sharding.mesh_axes)


def _axes(mask: int) -> tuple[int, ...]:
    return tuple(a for a in range(mask.bit_length()) if mask >> a & 1)


@functools.lru_cache(maxsize=256)
def _graph(
    shape: tuple[int, ...], mesh: Mesh, itemsize: int, axes: tuple[int, ...], partial: bool
) -> _Graph | None:
    """The graph of a tensor's shardings over `axes`, the mesh axes a reshard's two shardings
    use: an axis neither uses stays unused on the way, so a reshard never detours through
    other axes' links (slicing over one to shrink an all_reduce, gathering it back after),
    whose speed it does not know. None when it is too big to tabulate."""
    if len(_states(len(shape), axes, partial)) > _TABULATED:
        return None
    return _Graph(shape, mesh, itemsize, axes, partial)


@functools.lru_cache(maxsize=64)
def _basis(shape: tuple[int, ...], mesh: Mesh, itemsize: int, axes: tuple[int, ...]) -> _Basis:
    return _Basis(shape, mesh, itemsize, axes)


class _Basis:
    """The basis steps of one tensor (shape, itemsize) over some of the mesh's axes."""

    def __init__(
        self, shape: tuple[int, ...], mesh: Mesh, itemsize: int, axes: tuple[int, ...]
    ) -> None:
        self.shape, self.mesh, self.itemsize, self.axes = shape, mesh, itemsize, axes
        self.collectives: dict[tuple, Collective] = {}

    def collective(
        self,
        before: State,
        after: State,
        step: _Step,
        order: tuple[int, ...],
        reduction: ReductionKind,
    ) -> Collective:
        """A step as a collective; partial axes keep the source's `order`."""
        key = (before, after, step, order, reduction)
        if key not in self.collectives:
            axes = step.mesh_axes
            if step.kind is CollectiveKind.ALL_REDUCE:
                axes = tuple(a for a in order if a in axes)
            reduces = step.kind in (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER)
            self.collectives[key] = Collective(
                step.kind,
                axes,
                _sharding(before[0], tuple(a for a in order if a in before[1]), reduction),
                _sharding(after[0], tuple(a for a in order if a in after[1]), reduction),
                self.shape,
                step.bytes_per_device,
                dim=step.dim,
                to_dim=step.to_dim,
                reduction=reduction if reduces else None,
                pairs=(
                    _permute_pairs(before[0], after[0], self.shape, self.mesh)
                    if step.kind is CollectiveKind.PERMUTE
                    else ()
                ),
            )
        return self.collectives[key]

    def moves(self, split: Split, partial: tuple[int, ...]) -> Iterator[tuple[_Step, State]]:
        mesh, shape = self.mesh, self.shape
        n = mesh.group_size
        used = {a for axes in split for a in axes} | set(partial)
        free = [a for a in self.axes if a not in used]
        local = _local_bytes(split, shape, mesh, self.itemsize)

        def replaced(dim: int, axes: tuple[int, ...], other: int = -1, more: tuple = ()) -> Split:
            new = list(split)
            new[dim] = axes
            if other >= 0:
                new[other] = more
            return tuple(new)

        def exact(dim: int, fine: tuple[int, ...], keep: int, slicing: bool) -> bool:
            check = _slice_exact if slicing else _gather_exact
            return check(shape[dim], n(fine), n(fine[:keep]))

        def ring(
            kind: CollectiveKind,
            axes: tuple[int, ...],
            dim: int | None = None,
            to_dim: int | None = None,
        ) -> _Step:
            return _Step(kind, axes, ring_bytes(kind, n(axes), local), dim, to_dim)

        for dim, axes in enumerate(split):
            # all_slice: append free axes to a dim, locally.
            for k in range(1, len(free) + 1):
                for added in itertools.permutations(free, k):
                    if exact(dim, axes + added, len(axes), True):
                        yield (
                            _Step(CollectiveKind.ALL_SLICE, added, 0, dim),
                            (replaced(dim, axes + added), partial),
                        )
            for k in range(1, len(axes) + 1):
                if not exact(dim, axes, len(axes) - k, False):
                    continue
                moved = axes[-k:]
                # all_gather: drop the k innermost axes of a dim.
                yield (
                    ring(CollectiveKind.ALL_GATHER, moved, dim),
                    (replaced(dim, axes[:-k]), partial),
                )
                # all_to_all: move them to the end of another dim.
                for other, there in enumerate(split):
                    if other != dim and exact(other, there + moved, len(there), True):
                        yield (
                            ring(CollectiveKind.ALL_TO_ALL, moved, dim=other, to_dim=dim),
                            (replaced(dim, axes[:-k], other, there + moved), partial),
                        )
        for k in range(1, len(partial) + 1):
            # all_reduce over some partial axes.
            for reduced in itertools.combinations(partial, k):
                rest = tuple(a for a in partial if a not in reduced)
                yield ring(CollectiveKind.ALL_REDUCE, reduced), (split, rest)
            # reduce_scatter: reduce some partial axes into a dim's split.
            for reduced in itertools.permutations(partial, k):
                rest = tuple(a for a in partial if a not in reduced)
                for dim, axes in enumerate(split):
                    if exact(dim, axes + reduced, len(axes), True):
                        yield (
                            ring(CollectiveKind.REDUCE_SCATTER, reduced, dim),
                            (replaced(dim, axes + reduced), rest),
                        )

    def permute(self, old: Split, new: Split) -> _Step | None:
        return _permute(old, new, self.shape, self.mesh, self.itemsize)


class _Graph(_Basis):
    """Every sharding of one tensor over some mesh axes (with partial axes or without), the
    basis steps between them, and the shortest path between every two (Floyd-Warshall on
    `bytes * _STEP + steps`; ties go to the path found first, states taken in sorted order).

    Built once per (shape, mesh, itemsize, axes), it answers every pair of shardings of the
    tensor by a table walk: the search prices thousands of pairs per edge of the model."""

    def __init__(
        self,
        shape: tuple[int, ...],
        mesh: Mesh,
        itemsize: int,
        axes: tuple[int, ...],
        partial: bool,
    ) -> None:
        super().__init__(shape, mesh, itemsize, axes)
        self.states = _states(len(shape), axes, partial)
        self.index = {s: i for i, s in enumerate(self.states)}
        self.steps: dict[tuple[int, int], _Step] = {}
        for i, state in enumerate(self.states):
            for step, after in self.moves(*state):
                self.add(i, self.index[after], step)
        # Permutes, between splits whose shards (dim by dim) are among the other's.
        alike: dict[tuple, list[Split]] = {}
        for split, partial_axes in self.states:
            if not partial_axes:  # partial values stay put: their pieces are not shards
                n = self.mesh.group_size
                shards = tuple(_Shards.of(s, n(a)) for s, a in zip(shape, split, strict=True))
                alike.setdefault(shards, []).append(split)
        for have, want in itertools.product(alike, repeat=2):
            if all(w.within(h) for w, h in zip(want, have, strict=True)):
                for old, new in itertools.product(alike[have], alike[want]):
                    permute = self.permute(old, new)
                    if permute is not None:
                        self.add(self.index[(old, ())], self.index[(new, ())], permute)
        self.length, self.next = _shortest_paths(len(self.states), self.steps)

    def add(self, i: int, j: int, step: _Step) -> None:
        known = self.steps.get((i, j))
        if known is None or step.bytes_per_device < known.bytes_per_device:
            self.steps[(i, j)] = step

    def next_step(self, i: int, j: int) -> int:
        if self.length[i, j] >= _UNREACHABLE:  # pragma: no cover - gather all, slice reaches all
            raise ShardingError(
                f"no exact resharding from {self.states[i]} to {self.states[j]} on {self.mesh}"
            )
        return int(self.next[i, j])

    def collective_of(
        self, i: int, j: int, order: tuple[int, ...], reduction: ReductionKind
    ) -> Collective:
        return self.collective(self.states[i], self.states[j], self.steps[(i, j)], order, reduction)


@functools.lru_cache(maxsize=1 << 16)
def _permute(
    old: Split, new: Split, shape: tuple[int, ...], mesh: Mesh, itemsize: int
) -> _Step | None:
    """permute: every device's new shard is some device's current shard (same size); each
    device takes it from the (me mod k)-th of its k holders. None when some new shard is held
    nowhere. (A split's shards are every combination of its dims' shards, the dims' axes being
    distinct, so they are all held when, dim by dim, they are.) The graphs over different axis
    sets of one tensor share these."""
    n = mesh.group_size
    if old == new:
        return None
    for size, a, b in zip(shape, old, new, strict=True):
        if not _Shards.of(size, n(b)).within(_Shards.of(size, n(a))):
            return None
    source, target = _permute_moves(old, new, shape, mesh)
    sends = np.bincount(source).max(initial=0)
    coordinates = _coordinates(mesh)
    crossed = (coordinates[source] != coordinates[target]).any(0)
    return _Step(
        CollectiveKind.PERMUTE,
        tuple(np.flatnonzero(crossed).tolist()),
        int(sends) * _local_bytes(old, shape, mesh, itemsize),
    )


def _permute_moves(
    old: Split, new: Split, shape: tuple[int, ...], mesh: Mesh
) -> tuple[np.ndarray, np.ndarray]:
    """The (source, target) devices of a permute's moving shards, as two arrays."""
    held, wanted = _device_shards(old, shape, mesh), _device_shards(new, shape, mesh)
    order = np.argsort(held, kind="stable")
    ranked = held[order]
    first = np.searchsorted(ranked, wanted, "left")
    count = np.searchsorted(ranked, wanted, "right") - first
    devices = np.arange(len(held))
    source = order[first + devices % count]
    moving = held != wanted
    return source[moving], devices[moving]


def _permute_pairs(
    old: Split, new: Split, shape: tuple[int, ...], mesh: Mesh
) -> tuple[tuple[int, int], ...]:
    """A permute's (source, target) pairs, listed only for an emitted one: pricing needs none."""
    source, target = _permute_moves(old, new, shape, mesh)
    return tuple(zip(source.tolist(), target.tolist(), strict=True))


@functools.lru_cache(maxsize=1 << 16)
def _local_bytes(split: Split, shape: tuple[int, ...], mesh: Mesh, itemsize: int) -> int:
    """Bytes of a device's largest shard (ceil-sized on every split dim)."""
    elements = 1
    for size, axes in zip(shape, split, strict=True):
        elements *= shard_size(size, mesh.group_size(axes))
    return elements * itemsize


@functools.lru_cache(maxsize=64)
def _coordinates(mesh: Mesh) -> np.ndarray:
    """Each device's mesh coordinates, by linear index."""
    return np.array(list(mesh.devices()), dtype=np.int64).reshape(-1, mesh.ndim)


@functools.lru_cache(maxsize=1024)
def _states(rank: int, axes: tuple[int, ...], partial: bool) -> tuple[State, ...]:
    """Every placement of `axes`: on no dim, on one dim (in every order), or partial."""
    found: set[State] = set()
    places = rank + 2 if partial else rank + 1  # the dims, unused, partial
    for placement in itertools.product(range(places), repeat=len(axes)):
        on = dict(zip(axes, placement, strict=True))
        per_dim = [[a for a in axes if on[a] == d] for d in range(rank)]
        partial_axes = tuple(a for a in axes if on[a] == rank + 1)
        for split in itertools.product(*(itertools.permutations(p) for p in per_dim)):
            found.add((tuple(split), partial_axes))
    return tuple(sorted(found))


def _shortest_paths(
    count: int, steps: Mapping[tuple[int, int], _Step]
) -> tuple[np.ndarray, np.ndarray]:
    """Floyd-Warshall: the length of the shortest path between every two states and the state
    it goes to first."""
    length = np.full((count, count), _UNREACHABLE, dtype=np.int64)
    nxt = np.full((count, count), -1, dtype=np.int32)
    diagonal = np.arange(count)
    length[diagonal, diagonal] = 0
    nxt[diagonal, diagonal] = diagonal
    for (i, j), step in steps.items():
        length[i, j] = step.bytes_per_device * _STEP + 1
        nxt[i, j] = j
    better = np.empty((count, count), dtype=bool)
    for k in range(count):
        via = length[:, k, None] + length[k]
        np.less(via, length, out=better)
        np.copyto(length, via, where=better)
        np.copyto(nxt, nxt[:, k, None], where=better)
    return length, nxt


@functools.lru_cache(maxsize=1 << 16)
def _sharding(split: Split, partial: tuple[int, ...], reduction: ReductionKind) -> Sharding:
    """States recur across plans: each sharding is built (and validated) once."""
    return Sharding(split, partial, reduction)


@functools.lru_cache(maxsize=64)
def _device_shards(split: Split, shape: tuple[int, ...], mesh: Mesh) -> np.ndarray:
    """Every device's shard as one number, in linear order: equal numbers for equal shards of
    splits with the same shard size on each dim (as `_permute` compares), computed per device
    with numpy. On a dim of `size` in chunks of c, a device at position p of its group holds
    chunk min(p, ceil(size/c)) (the empty ones alike); the dims' chunks make one mixed-radix
    number."""
    coordinates = _coordinates(mesh)
    number = np.zeros(mesh.size, dtype=np.int64)
    for size, axes in zip(shape, _pad(split, len(shape)), strict=True):
        position = np.zeros(mesh.size, dtype=np.int64)
        for a in axes:  # the device's index in its group, axes outer to inner
            position = position * mesh.shape[a] + coordinates[:, a]
        chunk = shard_size(size, mesh.group_size(axes))
        chunks = -(-size // chunk) if chunk else 0
        number = number * (chunks + 1) + np.minimum(position, chunks)
    return number


@dataclass(frozen=True)
class _Shards:
    """The set of shards of a dim split n ways, without listing them: every ceil-sized chunk
    of the dim, plus an empty shard when there are more devices than chunks."""

    chunk: int
    empty: bool

    @staticmethod
    def of(size: int, n: int) -> _Shards:
        chunk = shard_size(size, n)
        return _Shards(chunk, n > (-(-size // chunk) if chunk else 0))

    def within(self, other: _Shards) -> bool:
        """Is every shard of this set one of `other`?"""
        return self.chunk == other.chunk and (other.empty or not self.empty)


@functools.lru_cache(maxsize=1 << 14)
def _gather_exact(size: int, fine: int, coarse: int) -> bool:
    """Does concatenating the shards of an n=`fine` split, g = fine/coarse at a time, give the
    shards of the `coarse` split? Boundary i of the first is min(i*g*ceil(size/fine), size),
    of the second min(i*ceil(size/coarse), size): the same for every i when the steps are
    equal, or when one coarse shard holds everything (the first step is never the smaller)."""
    step = shard_size(size, coarse)
    return (fine // coarse) * shard_size(size, fine) == step or step >= size


@functools.lru_cache(maxsize=1 << 14)
def _slice_exact(size: int, fine: int, coarse: int) -> bool:
    """Does chunking each `coarse` shard locally (ceil-sized chunks) give the `fine` shards?

    Both sides are piecewise linear in the coarse shard i, with breaks only where shards
    reach the end of the dim: the full shards, then at most one partial one, then empty ones.
    So it suffices to compare the first full shards, those around the partial one and the
    last, not all of them."""
    g = fine // coarse
    step = shard_size(size, coarse)
    full = size // step if step else coarse
    for i in sorted({0, 1, 2, full - 2, full - 1, full, full + 1, coarse - 1}):
        if not 0 <= i < coarse:
            continue
        start, stop = shard_bounds(size, coarse, i)
        for j in range(g):
            low, high = shard_bounds(stop - start, g, j)
            if (start + low, start + high) != shard_bounds(size, fine, i * g + j):
                return False
    return True

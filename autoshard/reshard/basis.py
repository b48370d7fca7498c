"""The graph the resharding planner searches: every sharding of a tensor over the mesh axes
two shardings use, joined by the exact one-collective steps between them, and the cheapest
paths through it (Floyd-Warshall, deterministic ties)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.collectives import Collective, CollectiveKind, ring_bytes
from autoshard.errors import ShardingError
from autoshard.mesh import Mesh
from autoshard.sharding import ReductionKind, Sharding, shard_bounds, shard_size

Split = tuple[tuple[int, ...], ...]


State = tuple[Split, tuple[int, ...]]
"""A sharding as the planner sees it: split axes per dim (padded to the rank) and the partial
axes, sorted."""


def state_of(sharding: Sharding, rank: int) -> State:
    return _pad(sharding.split_axes, rank), tuple(sorted(sharding.partial_axes))


def _pad(split: Split, rank: int) -> Split:
    return tuple(split) + ((),) * (rank - len(split))


@dataclass(frozen=True)
class Step:
    """One basis collective between two states: what `Collective` says, less the shardings."""

    kind: CollectiveKind
    mesh_axes: tuple[int, ...]
    bytes_per_device: int
    dim: int | None = None
    to_dim: int | None = None


STEP = 1 << 10
"""A path's length is `bytes * STEP + collectives`: fewest bytes first, then fewest steps."""


_PIECED = frozenset(
    {CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL}
)
"""The kinds whose bytes are a ceil-sized piece of the local shard (`ring_bytes`)."""


UNREACHABLE = 1 << 61  # twice it still fits in int64


_TABULATED = 700
"""States of the largest graph given a shortest-path table (Floyd-Warshall is cubic in them;
3-axis meshes stay below up to rank 6). Bigger graphs (4-axis meshes from rank 3 on) are
searched pair by pair (`_directed`)."""


def axes_mask(sharding: Sharding) -> int:
    """The mesh axes a sharding uses, as bits."""
    return sum(1 << a for a in sharding.mesh_axes)


def mask_axes(mask: int) -> tuple[int, ...]:
    return tuple(a for a in range(mask.bit_length()) if mask >> a & 1)


@functools.lru_cache(maxsize=4096)
def step_graph(
    shape: tuple[int, ...], mesh: Mesh, itemsize: int, axes: tuple[int, ...], partial: bool
) -> StepGraph | None:
    """The graph of a tensor's shardings over `axes`, the mesh axes a reshard's two shardings
    use: an axis neither uses stays unused on the way, so a reshard never detours through
    other axes' links (slicing over one to shrink an all_reduce, gathering it back after),
    whose speed it does not know. None when it is too big to tabulate. Its paths are those of
    the first of the tensor's shape classes (`shape_classes`) whose steps scale exactly,
    searched once per class."""
    if len(_states(len(shape), axes, partial)) > _TABULATED:
        return None
    for canonical, unit, scale in shape_classes(shape, mesh, itemsize, axes):
        paths = paths_of(canonical, mesh, unit, axes, partial)
        if scale == 1 or paths.even:
            return StepGraph(shape, mesh, itemsize, axes, paths, scale)
    raise AssertionError("the last class is the tensor itself")  # pragma: no cover


def shape_classes(
    shape: tuple[int, ...], mesh: Mesh, itemsize: int, axes: tuple[int, ...]
) -> tuple[tuple[tuple[int, ...], int, int], ...]:
    """The classes (shape, itemsize, scale) a tensor may share its graph over `axes` with,
    widest first, the tensor itself last: each class's graph is the tensor's, each step
    moving `scale` times the bytes, where that class's steps are `even`.

    A dim of n*m elements, n the devices of `axes` together and m >= 1, splits evenly over any
    of them: every slice and gather is exact, and its shards, their sizes aside, are those of a
    dim of n. So a tensor has the steps of one whose such dims are n (the others as they are),
    its local shards `prod(m)` times theirs, or `itemsize * prod(m)` times where the class's
    itemsize is 1. A step's bytes are the local shard's (all_gather, permute) or a ceil-sized
    n'-th of it (the other kinds, `ring_bytes`, n' the devices it reduces or moves over):
    exactly `scale` times the class's when n' divides the class's shard (`Paths.even`), as it
    always does where every dim is such a dim (the axes a step reduces or moves are not among
    some dim's splits: any dim for partial axes, the target dim for an all_to_all; that dim's
    class shard, n / n'' elements, holds n'). A path's length is `bytes * STEP + steps` with
    fewer than `STEP` steps, so scaling every step's bytes by one integer keeps every
    comparison Floyd-Warshall makes, and its paths."""
    n = mesh.group_size(axes)
    whole = [bool(size) and not size % n for size in shape]
    itself = ((shape, itemsize, 1),)
    if not any(whole):
        return itself
    canonical = tuple(n if w else size for size, w in zip(shape, whole, strict=True))
    m = math.prod(size // n for size, w in zip(shape, whole, strict=True) if w)
    wider = ((canonical, 1, itemsize * m),) if itemsize > 1 else ()
    return (*wider, (canonical, itemsize, m), *itself) if m > 1 else (*wider, *itself)


@functools.lru_cache(maxsize=64)
def basis_for(shape: tuple[int, ...], mesh: Mesh, itemsize: int, axes: tuple[int, ...]) -> Basis:
    return Basis(shape, mesh, itemsize, axes)


class Basis:
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
        step: Step,
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

    def moves(self, split: Split, partial: tuple[int, ...]) -> Iterator[tuple[Step, State]]:
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
        ) -> Step:
            return Step(kind, axes, ring_bytes(kind, n(axes), local), dim, to_dim)

        for dim, axes in enumerate(split):
            # all_slice: append free axes to a dim, locally.
            for k in range(1, len(free) + 1):
                for added in itertools.permutations(free, k):
                    if exact(dim, axes + added, len(axes), True):
                        yield (
                            Step(CollectiveKind.ALL_SLICE, added, 0, dim),
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

    def permute(self, old: Split, new: Split) -> Step | None:
        return _permute(old, new, self.shape, self.mesh, self.itemsize)


@dataclass(frozen=True, eq=False)
class Paths:
    """The states of one shape class (`shape_classes`), the basis steps between them and the
    cheapest path between every two (Floyd-Warshall on `bytes * STEP + steps`; ties go to the
    path found first, states taken in sorted order): `hops[i, j]` steps long (0 where
    unreachable), the first to state `next[i, j]`; `even` where every step moving a
    ceil-sized piece of the local shard (`ring_bytes`) divides it evenly."""

    states: tuple[State, ...]
    index: Mapping[State, int]
    steps: Mapping[tuple[int, int], Step]
    reachable: np.ndarray
    hops: np.ndarray
    next: np.ndarray
    even: bool


@functools.lru_cache(maxsize=256)
def paths_of(
    shape: tuple[int, ...], mesh: Mesh, itemsize: int, axes: tuple[int, ...], partial: bool
) -> Paths:
    """The paths of a tensor's shardings over `axes` (with partial axes or without), built
    once per (shape, mesh, itemsize, axes)."""
    basis = basis_for(shape, mesh, itemsize, axes)
    states = _states(len(shape), axes, partial)
    index = {s: i for i, s in enumerate(states)}
    steps: dict[tuple[int, int], Step] = {}

    def add(i: int, j: int, step: Step) -> None:
        known = steps.get((i, j))
        if known is None or step.bytes_per_device < known.bytes_per_device:
            steps[(i, j)] = step

    even = True
    for i, state in enumerate(states):
        local = _local_bytes(state[0], shape, mesh, itemsize)
        for step, after in basis.moves(*state):
            add(i, index[after], step)
            if step.kind in _PIECED:
                even = even and not local % mesh.group_size(step.mesh_axes)
    # Permutes, between splits whose shards (dim by dim) are among the other's.
    alike: dict[tuple, list[Split]] = {}
    for split, partial_axes in states:
        if not partial_axes:  # partial values stay put: their pieces are not shards
            n = mesh.group_size
            shards = tuple(_Shards.of(s, n(a)) for s, a in zip(shape, split, strict=True))
            alike.setdefault(shards, []).append(split)
    for have in alike:
        news = [
            new
            for want in alike
            if all(w.within(h) for w, h in zip(want, have, strict=True))
            for new in alike[want]
        ]
        for old in alike[have]:
            others = [new for new in news if new != old]
            if others:
                for new, permute in zip(
                    others, _permutes(old, others, shape, mesh, itemsize), strict=True
                ):
                    add(index[(old, ())], index[(new, ())], permute)
    length, nxt = _shortest_paths(len(states), steps)
    reachable = length < UNREACHABLE
    hops = np.where(reachable, length % STEP, 0)
    return Paths(states, index, steps, reachable, hops, nxt, even)


class StepGraph(Basis):
    """Every sharding of one tensor over some mesh axes (with partial axes or without), the
    basis steps between them and the cheapest paths: those of its shape class, each step
    moving `scale` times the bytes of the class's.

    Made once per (shape, mesh, itemsize, axes), it answers every pair of shardings of the
    tensor by a table walk: the search prices thousands of pairs per edge of the model."""

    def __init__(
        self,
        shape: tuple[int, ...],
        mesh: Mesh,
        itemsize: int,
        axes: tuple[int, ...],
        paths: Paths,
        scale: int,
    ) -> None:
        super().__init__(shape, mesh, itemsize, axes)
        self.paths, self.scale = paths, scale
        self.states, self.index = paths.states, paths.index

    def step(self, i: int, j: int) -> Step:
        """The step from state i to state j, in this tensor's bytes."""
        step = self.paths.steps[(i, j)]
        if self.scale == 1:
            return step
        return dataclasses.replace(step, bytes_per_device=step.bytes_per_device * self.scale)

    def next_step(self, i: int, j: int) -> int:
        if not self.paths.reachable[i, j]:  # pragma: no cover - gather all, slice reaches all
            raise ShardingError(
                f"no exact resharding from {self.states[i]} to {self.states[j]} on {self.mesh}"
            )
        return int(self.paths.next[i, j])

    def collective_of(
        self, i: int, j: int, order: tuple[int, ...], reduction: ReductionKind
    ) -> Collective:
        return self.collective(self.states[i], self.states[j], self.step(i, j), order, reduction)


@functools.lru_cache(maxsize=1 << 16)
def _permute(
    old: Split, new: Split, shape: tuple[int, ...], mesh: Mesh, itemsize: int
) -> Step | None:
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
    return _permutes(old, (new,), shape, mesh, itemsize)[0]


def _permutes(
    old: Split, news: Sequence[Split], shape: tuple[int, ...], mesh: Mesh, itemsize: int
) -> list[Step]:
    """The permutes from `old` to each of `news` (other splits, each of whose shards `old`
    holds, as `_permute` checks), worked out together: a graph asks for every pair of its
    splits alike."""
    source, moving = _sources(old, news, shape, mesh)
    count, devices = source.shape
    rows = np.arange(count)[:, None] * devices
    sends = np.bincount((rows + source)[moving], minlength=count * devices)
    coordinates = _coordinates(mesh)
    crossed = ((coordinates[source] != coordinates) & moving[..., None]).any(1)
    local = _local_bytes(old, shape, mesh, itemsize)
    return [
        Step(CollectiveKind.PERMUTE, tuple(np.flatnonzero(axes).tolist()), int(most) * local)
        for axes, most in zip(crossed, sends.reshape(count, devices).max(1), strict=True)
    ]


def _sources(
    old: Split, news: Sequence[Split], shape: tuple[int, ...], mesh: Mesh
) -> tuple[np.ndarray, np.ndarray]:
    """For each of `news` (rows) and each device (columns), the device it takes its new shard
    from, and whether that is another."""
    held = _device_shards(old, shape, mesh)
    wanted = np.stack([_device_shards(new, shape, mesh) for new in news])
    order = np.argsort(held, kind="stable")
    ranked = held[order]
    first = np.searchsorted(ranked, wanted, "left")
    count = np.searchsorted(ranked, wanted, "right") - first
    devices = np.arange(len(held))
    return order[first + devices % count], held != wanted


def _permute_moves(
    old: Split, new: Split, shape: tuple[int, ...], mesh: Mesh
) -> tuple[np.ndarray, np.ndarray]:
    """The (source, target) devices of a permute's moving shards, as two arrays."""
    source, moving = _sources(old, (new,), shape, mesh)
    return source[moving], np.flatnonzero(moving[0])


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
    count: int, steps: Mapping[tuple[int, int], Step]
) -> tuple[np.ndarray, np.ndarray]:
    """Floyd-Warshall: the length of the shortest path between every two states and the state
    it goes to first."""
    length = np.full((count, count), UNREACHABLE, dtype=np.int64)
    nxt = np.full((count, count), -1, dtype=np.int32)
    diagonal = np.arange(count)
    length[diagonal, diagonal] = 0
    nxt[diagonal, diagonal] = diagonal
    for (i, j), step in steps.items():
        length[i, j] = step.bytes_per_device * STEP + 1
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

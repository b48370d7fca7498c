"""Resharding: the collectives that turn a tensor of one sharding into another (seed 002).

`plan_reshard(src, dst, shape, mesh)` returns the collectives; it is the single planner used
both to price an edge (search) and to emit it (materialize), so estimated and materialized
communication agree byte for byte.

Seed 002's basis, each step changing the sharding of one tensor dim:
    all_slice       append free mesh axes to a dim               [[]] -> [[1]]       free
    all_gather      drop the innermost axes of a dim             [[0, 1]] -> [[0]]
    all_to_all      move innermost axes of one dim to another    [[0], []] -> [[], [0]]
    all_reduce      reduce partial axes                          partial = sum[1] -> none
    reduce_scatter  reduce partial axes into a dim's split       partial = sum[1] -> [[1]]
    permute         devices swap whole shards                    [[0, 1]] -> [[1, 0]]
Only the innermost axes of a dim can be gathered: on mesh 2x2x2, `[[0], [1, 2]] -> [[0], [2]]`
is not one all_gather over axis 1 (seed 002), but `[[0], [1, 2]] -> [[0], [1]]` is one over 2.

The planner searches (Dijkstra) over shardings reachable with these steps, each step only making
progress towards the target, and returns the sequence moving the fewest bytes per device, then
the fewest collectives. A step is taken only when it is *exact*: when the dim does not divide
evenly, shards are ceil-sized (seed 002) and, e.g., gathering the inner axis of a 5-row dim
split 2x2 (shards 2, 2, 1, 0) does not give the 3-row shards of a 2-way split (3, 2). Such a
dim is gathered whole and sliced from the full extent, which is always exact. Upstream MLIR's
one-step resharding gets multi-step cases on 2-D meshes wrong; this one is tested against an
execution of every planned sequence on all devices (`autoshard.simulate`).

Bytes per device follow the ring algorithms of DESIGN.md (`ring_bytes`, the only place the
formulas are written) with n devices per group and the largest local shard; a permute sends
whole shards, one per device it serves.
"""

from __future__ import annotations

import collections
import enum
import functools
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.errors import ShardingError
from autoshard.mesh import Mesh
from autoshard.sharding import ReductionKind, Sharding

Split = tuple[tuple[int, ...], ...]
Bounds = tuple[tuple[int, int], ...]


class CollectiveKind(enum.StrEnum):
    ALL_GATHER = "all_gather"
    ALL_SLICE = "all_slice"
    ALL_TO_ALL = "all_to_all"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    PERMUTE = "permute"


_AXIS_FIELDS = ("gather_axis", "slice_axis", "scatter_axis", "split_axis", "concat_axis")


def ring_bytes(kind: CollectiveKind, n: int, local: int) -> int:
    """Bytes one device sends in a ring collective over n devices, `local` its input shard's
    bytes (DESIGN.md): all_gather (n-1)/n of the n*local gathered; reduce_scatter and
    all_to_all (n-1)/n of the input; all_reduce twice that; all_slice nothing (local)."""
    piece = -(-local // n)
    return {
        CollectiveKind.ALL_GATHER: (n - 1) * local,
        CollectiveKind.REDUCE_SCATTER: (n - 1) * piece,
        CollectiveKind.ALL_TO_ALL: (n - 1) * piece,
        CollectiveKind.ALL_REDUCE: 2 * (n - 1) * piece,
        CollectiveKind.ALL_SLICE: 0,
    }[kind]


def ring_steps(kind: CollectiveKind, n: int) -> int:
    """Latency-bound steps of the same ring algorithms: n-1 for all_gather, reduce_scatter and
    all_to_all, 2(n-1) for all_reduce, one exchange for a permute, none for a local slice."""
    return {
        CollectiveKind.ALL_GATHER: n - 1,
        CollectiveKind.REDUCE_SCATTER: n - 1,
        CollectiveKind.ALL_TO_ALL: n - 1,
        CollectiveKind.ALL_REDUCE: 2 * (n - 1),
        CollectiveKind.PERMUTE: 1,
        CollectiveKind.ALL_SLICE: 0,
    }[kind]


@dataclass(frozen=True)
class Collective:
    """One communication step on a tensor of global `shape`, from sharding `src` to `dst`.

    Tensor-axis fields are set per kind, as in the mesh dialect: `gather_axis` (all_gather),
    `slice_axis` (all_slice), `scatter_axis` (reduce_scatter), `split_axis` and `concat_axis`
    (all_to_all). `pairs` lists (source, target) linear device indices of a permute.
    """

    kind: CollectiveKind
    mesh_axes: tuple[int, ...]
    src: Sharding
    dst: Sharding
    shape: tuple[int, ...]
    bytes_per_device: int
    gather_axis: int | None = None
    slice_axis: int | None = None
    scatter_axis: int | None = None
    split_axis: int | None = None
    concat_axis: int | None = None
    reduction: ReductionKind | None = None
    pairs: tuple[tuple[int, int], ...] = ()

    def __str__(self) -> str:
        text = f"{self.kind} mesh_axes = [{', '.join(map(str, self.mesh_axes))}]"
        for name in ("reduction", *_AXIS_FIELDS):
            value = getattr(self, name)
            if value is not None:
                text += f" {name} = {value}"
        return text

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "kind": self.kind.value,
            "mesh_axes": list(self.mesh_axes),
            "from": self.src.text(len(self.shape)),
            "to": self.dst.text(len(self.shape)),
            "bytes_per_device": self.bytes_per_device,
        }
        for name in _AXIS_FIELDS:
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        if self.reduction is not None:
            data["reduction"] = self.reduction.value
        if self.pairs:
            data["pairs"] = [list(p) for p in self.pairs]
        return data


def plan_reshard(
    src: Sharding, dst: Sharding, shape: Sequence[int], mesh: Mesh, itemsize: int = 4
) -> tuple[Collective, ...]:
    """The cheapest exact sequence of collectives from `src` to `dst` (empty if equal)."""
    shape = tuple(shape)
    src.check(mesh, shape)
    dst.check(mesh, shape)
    for s in (src, dst):
        if s.halo_sizes or s.sharded_dims_offsets:
            raise ShardingError(
                f"resharding {s} is not supported: halos and explicit offsets are not planned"
            )
    if not set(dst.partial_axes) <= set(src.partial_axes):
        raise ShardingError(
            f"cannot reshard {src} to {dst}: a value cannot become partial over new mesh axes"
        )
    if dst.partial_axes and src.partial_type != dst.partial_type:
        raise ShardingError(f"cannot reshard {src} to {dst}: the partial reductions differ")
    return _plan(src, dst, shape, mesh, itemsize)


@functools.lru_cache(maxsize=65536)
def _plan(
    src: Sharding, dst: Sharding, shape: tuple[int, ...], mesh: Mesh, itemsize: int
) -> tuple[Collective, ...]:
    if src == dst:
        return ()
    rank = len(shape)
    search = _Search(dst, shape, mesh, itemsize, src.partial_type)
    start = _pad(src.split_axes, rank), tuple(src.partial_axes)
    goal = _pad(dst.split_axes, rank), tuple(dst.partial_axes)
    # Dijkstra on (bytes, steps, tie-break text); the tie-break makes the choice deterministic.
    frontier: list[tuple[int, int, str, int, tuple[Split, tuple[int, ...]], tuple[Collective, ...]]]
    frontier = [(0, 0, "", 0, start, ())]
    done: set[tuple[Split, tuple[int, ...]]] = set()
    pushed = itertools.count(1)
    while frontier:
        cost, steps, key, _, state, path = heapq.heappop(frontier)
        if _same(state, goal):
            return path
        if state in done:
            continue
        done.add(state)
        for step in search.moves(*state):
            nxt = _pad(step.dst.split_axes, rank), tuple(step.dst.partial_axes)
            if nxt not in done:
                heapq.heappush(
                    frontier,
                    (
                        cost + step.bytes_per_device,
                        steps + 1,
                        f"{key}{step} -> {step.dst};",
                        next(pushed),
                        nxt,
                        (*path, step),
                    ),
                )
    raise ShardingError(
        f"no exact resharding from {src} to {dst} on mesh {mesh}"
    )  # pragma: no cover


def _pad(split: Split, rank: int) -> Split:
    return tuple(split) + ((),) * (rank - len(split))


def _same(a: tuple[Split, tuple[int, ...]], b: tuple[Split, tuple[int, ...]]) -> bool:
    return a[0] == b[0] and set(a[1]) == set(b[1])


@functools.lru_cache(maxsize=1 << 16)
def _sharding(split: Split, partial: tuple[int, ...], reduction: ReductionKind) -> Sharding:
    """States recur across plans: each sharding is built (and validated) once."""
    return Sharding(split, partial, reduction)


@functools.lru_cache(maxsize=4096)
def _device_bounds(split: Split, shape: tuple[int, ...], mesh: Mesh) -> tuple[Bounds, ...]:
    """The [start, stop) per dim of every device's shard (ceil-sized), in linear order; what
    `Sharding.slices` gives, computed once per split for the permute search."""
    per_dim = []
    for size, axes in zip(shape, _pad(split, len(shape)), strict=True):
        per_dim.append(_bounds(size, mesh, axes) if axes else [(0, size)])
    out = []
    for device in mesh.devices():
        out.append(
            tuple(
                bounds[_group_position(device, mesh, axes)] if axes else bounds[0]
                for bounds, axes in zip(per_dim, _pad(split, len(shape)), strict=True)
            )
        )
    return tuple(out)


def _group_position(device: tuple[int, ...], mesh: Mesh, axes: Sequence[int]) -> int:
    index = 0
    for a in axes:
        index = index * mesh.shape[a] + device[a]
    return index


def _bounds(size: int, mesh: Mesh, axes: Sequence[int]) -> list[tuple[int, int]]:
    """Shard i of a dim of `size` split over `axes`: [i*S, (i+1)*S) clipped, S = ceil(size/n)."""
    n = mesh.group_size(axes)
    step = -(-size // n)
    return [(min(i * step, size), min((i + 1) * step, size)) for i in range(n)]


def _gather_exact(size: int, mesh: Mesh, axes: Sequence[int], keep: int) -> bool:
    """Does concatenating the shards of the dropped inner axes give the coarser shards?"""
    fine, coarse = _bounds(size, mesh, axes), _bounds(size, mesh, axes[:keep])
    g = len(fine) // len(coarse)
    return all((fine[i * g][0], fine[i * g + g - 1][1]) == coarse[i] for i in range(len(coarse)))


def _slice_exact(size: int, mesh: Mesh, axes: Sequence[int], keep: int) -> bool:
    """Does chunking each coarse shard locally (ceil-sized chunks) give the finer shards?"""
    fine, coarse = _bounds(size, mesh, axes), _bounds(size, mesh, axes[:keep])
    g = len(fine) // len(coarse)
    for i, (start, stop) in enumerate(coarse):
        chunk = -(-(stop - start) // g)
        for j in range(g):
            mine = (
                start + min(j * chunk, stop - start),
                start + min((j + 1) * chunk, stop - start),
            )
            if mine != fine[i * g + j]:
                return False
    return True


class _Search:
    """The progress-making basis steps out of one state (split axes, partial axes)."""

    def __init__(
        self,
        dst: Sharding,
        shape: tuple[int, ...],
        mesh: Mesh,
        itemsize: int,
        reduction: ReductionKind,
    ) -> None:
        self.target = _pad(dst.split_axes, len(shape))
        self.target_partial = set(dst.partial_axes)
        self.shape, self.mesh, self.itemsize, self.reduction = shape, mesh, itemsize, reduction
        self.sizes: dict[Split, int] = {}

    def local_bytes(self, split: Split) -> int:
        if split not in self.sizes:
            elements = 1
            for size, axes in zip(self.shape, split, strict=True):
                elements *= -(-size // self.mesh.group_size(axes)) if axes else size
            self.sizes[split] = elements * self.itemsize
        return self.sizes[split]

    def make(
        self,
        kind: CollectiveKind,
        axes: Sequence[int],
        before: tuple[Split, tuple[int, ...]],
        after: tuple[Split, tuple[int, ...]],
        **fields: object,
    ) -> Collective:
        src = _sharding(before[0], before[1], self.reduction)
        dst = _sharding(after[0], after[1], self.reduction)
        sent = ring_bytes(kind, self.mesh.group_size(axes), self.local_bytes(before[0]))
        return Collective(kind, tuple(axes), src, dst, self.shape, sent, **fields)  # type: ignore[arg-type]

    def wanted(self, split: Split, dim: int) -> tuple[int, ...] | None:
        """The axes dim still needs appended, or None if its list is not a prefix of the target."""
        have, want = split[dim], self.target[dim]
        return want[len(have) :] if want[: len(have)] == have else None

    def moves(self, split: Split, partial: tuple[int, ...]) -> list[Collective]:
        mesh, shape = self.mesh, self.shape
        state = (split, partial)
        used = {a for axes in split for a in axes} | set(partial)
        local = self.local_bytes(split)
        out: list[Collective] = []

        def replaced(
            dim: int,
            axes: tuple[int, ...],
            other: int | None = None,
            other_axes: tuple[int, ...] = (),
        ) -> Split:
            new = list(split)
            new[dim] = axes
            if other is not None:
                new[other] = other_axes
            return tuple(new)

        # all_slice: append the next wanted free axes (one or several) to a dim.
        for dim in range(len(shape)):
            want = self.wanted(split, dim)
            free = list(itertools.takewhile(lambda a: a not in used, want or ()))
            for k in range(1, len(free) + 1):
                axes = split[dim] + tuple(free[:k])
                if _slice_exact(shape[dim], mesh, axes, len(split[dim])):
                    after = replaced(dim, axes)
                    out.append(
                        self.make(
                            CollectiveKind.ALL_SLICE,
                            free[:k],
                            state,
                            (after, partial),
                            slice_axis=dim,
                        )
                    )
        # all_gather: drop the k innermost axes of a dim.
        for dim, axes in enumerate(split):
            for k in range(1, len(axes) + 1):
                if _gather_exact(shape[dim], mesh, axes, len(axes) - k):
                    after = replaced(dim, axes[:-k])
                    out.append(
                        self.make(
                            CollectiveKind.ALL_GATHER,
                            axes[-k:],
                            state,
                            (after, partial),
                            gather_axis=dim,
                        )
                    )
        # all_to_all: move the k innermost axes of dim to the end of another dim that wants them.
        for dim, axes in enumerate(split):
            for other in range(len(shape)):
                want = self.wanted(split, other) if other != dim else None
                for k in range(1, len(axes) + 1):
                    moved = axes[-k:]
                    if not want or want[:k] != moved:
                        continue
                    grown = split[other] + moved
                    if _gather_exact(shape[dim], mesh, axes, len(axes) - k) and _slice_exact(
                        shape[other], mesh, grown, len(split[other])
                    ):
                        after = replaced(dim, axes[:-k], other, grown)
                        out.append(
                            self.make(
                                CollectiveKind.ALL_TO_ALL,
                                moved,
                                state,
                                (after, partial),
                                split_axis=other,
                                concat_axis=dim,
                            )
                        )
        # Reductions of partial axes the target does not keep.
        pending = tuple(a for a in partial if a not in self.target_partial)
        if pending:
            kept = tuple(a for a in partial if a in self.target_partial)
            out.append(
                self.make(
                    CollectiveKind.ALL_REDUCE,
                    pending,
                    state,
                    (split, kept),
                    reduction=self.reduction,
                )
            )
            for dim in range(len(shape)):
                want = self.wanted(split, dim) or ()
                run = list(itertools.takewhile(lambda a: a in pending, want))
                for k in range(1, len(run) + 1):
                    axes = split[dim] + tuple(run[:k])
                    if not _slice_exact(shape[dim], mesh, axes, len(split[dim])):
                        continue
                    rest = tuple(a for a in partial if a not in run[:k])
                    after = replaced(dim, axes)
                    out.append(
                        self.make(
                            CollectiveKind.REDUCE_SCATTER,
                            run[:k],
                            state,
                            (after, rest),
                            scatter_axis=dim,
                            reduction=self.reduction,
                        )
                    )
        # permute: every device's new shard is some device's current shard. Tried towards the
        # target and, as in seed 002's `[[0], [1, 2]] -> [[0], [2, 1]] -> [[0], [2]]`, to any
        # reordering of one dim's axes. Partial values stay put (their pieces are not shards).
        if not partial:
            goals = [] if self.target_partial else [self.target]
            for dim, axes in enumerate(split):
                goals += [
                    replaced(dim, order) for order in itertools.permutations(axes) if order != axes
                ]
            if goals:
                holders = self.holders(split)
                for goal in goals:
                    step = self.permute(split, goal, local, holders)
                    if step is not None:
                        out.append(step)
        return out

    def holders(self, split: Split) -> dict[Bounds, list[int]]:
        """Each distinct shard of `split` -> the linear indices of the devices holding it."""
        found: dict[Bounds, list[int]] = {}
        for index, bounds in enumerate(_device_bounds(split, self.shape, self.mesh)):
            found.setdefault(bounds, []).append(index)
        return found

    def permute(
        self,
        split: Split,
        goal: Split,
        local: int,
        holders: dict[Bounds, list[int]],
    ) -> Collective | None:
        mesh, shape = self.mesh, self.shape
        current = _sharding(split, (), ReductionKind.SUM)
        target = _sharding(goal, (), ReductionKind.SUM)
        if current == target or self.local_bytes(goal) != local:
            return None
        pairs = []
        for me, bounds in enumerate(_device_bounds(goal, shape, mesh)):
            sources = holders.get(bounds)
            if sources is None:
                return None
            if me not in sources:
                pairs.append((sources[me % len(sources)], me))
        sends = max(collections.Counter(s for s, _ in pairs).values(), default=0)
        devices = list(mesh.devices())
        axes = tuple(
            a for a in range(mesh.ndim) if any(devices[s][a] != devices[t][a] for s, t in pairs)
        )
        return Collective(
            CollectiveKind.PERMUTE, axes, current, target, shape, sends * local, pairs=tuple(pairs)
        )

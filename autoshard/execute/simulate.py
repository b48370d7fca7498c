"""Execute mesh collectives on every device's local numpy array, as docs/design/collectives.md
defines them.

This is the verification oracle: it knows nothing of the planner and follows the dialect's
semantics literally, per device group (devices agreeing outside `mesh_axes`, ordered by their
coordinates on `mesh_axes`, outer to inner). Where a collective splits a local tensor into n
pieces (all_slice, all_to_all, reduce_scatter), the pieces are ceil(len / n) long, the last
ones shorter or empty, as shards are.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from autoshard.collectives import Collective, CollectiveKind
from autoshard.mesh import Device, Mesh
from autoshard.sharding import ReductionKind, Sharding, shard_bounds

Locals = dict[Device, np.ndarray]

_REDUCE = {
    ReductionKind.SUM: lambda xs: np.sum(xs, axis=0),
    ReductionKind.MAX: lambda xs: np.max(xs, axis=0),
    ReductionKind.MIN: lambda xs: np.min(xs, axis=0),
    ReductionKind.PRODUCT: lambda xs: np.prod(xs, axis=0),
    ReductionKind.AVERAGE: lambda xs: np.mean(xs, axis=0),
    ReductionKind.BITWISE_AND: lambda xs: np.bitwise_and.reduce(xs, axis=0),
    ReductionKind.BITWISE_OR: lambda xs: np.bitwise_or.reduce(xs, axis=0),
    ReductionKind.BITWISE_XOR: lambda xs: np.bitwise_xor.reduce(xs, axis=0),
}


def reduce(kind: ReductionKind, arrays: list[np.ndarray]) -> np.ndarray:
    return np.asarray(_REDUCE[kind](np.stack(arrays))).astype(arrays[0].dtype)


def piece(array: np.ndarray, axis: int, index: int, count: int) -> np.ndarray:
    """Piece `index` of `count` ceil-sized pieces of `array` along `axis`."""
    start, stop = shard_bounds(array.shape[axis], count, index)
    return np.take(array, np.arange(start, stop), axis=axis)


def shard(array: np.ndarray, sharding: Sharding, mesh: Mesh) -> Locals:
    """Each device's local slice of a global (non-partial) array."""
    return {
        device: array[tuple(slice(a, b) for a, b in sharding.slices(mesh, array.shape, device))]
        for device in mesh.devices()
    }


def run_collective(
    collective: Collective, mesh: Mesh, local: Mapping[Device, np.ndarray]
) -> Locals:
    """Every device's result of one collective."""
    c, out = collective, {}
    if c.kind is CollectiveKind.PERMUTE:
        out = dict(local)
        for source, target in c.pairs:
            out[mesh.multi_index(target)] = local[mesh.multi_index(source)]
        return out
    for group in mesh.device_groups(c.mesh_axes):
        inputs = [local[d] for d in group]
        n = len(group)
        # The group's gathered or reduced value, computed once (the devices only read it).
        if c.kind is CollectiveKind.ALL_GATHER:
            whole = np.concatenate(inputs, axis=c.dim)
        elif c.kind in (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER):
            whole = reduce(c.reduction, inputs)  # type: ignore[arg-type]
        for i, device in enumerate(group):
            if c.kind in (CollectiveKind.ALL_GATHER, CollectiveKind.ALL_REDUCE):
                out[device] = whole
            elif c.dim is None:  # pragma: no cover - the kinds left cut a dim; Collective needs it
                raise ValueError(f"{c} names no tensor dim to cut")
            elif c.kind is CollectiveKind.ALL_SLICE:
                out[device] = piece(inputs[i], c.dim, i, n)
            elif c.kind is CollectiveKind.REDUCE_SCATTER:
                out[device] = piece(whole, c.dim, i, n)
            elif c.kind is CollectiveKind.ALL_TO_ALL:
                received = [piece(x, c.dim, i, n) for x in inputs]
                out[device] = np.concatenate(received, axis=c.to_dim)
            else:  # pragma: no cover
                raise NotImplementedError(c.kind)
    return out


def run_collectives(collectives: tuple[Collective, ...], mesh: Mesh, local: Locals) -> Locals:
    for collective in collectives:
        local = run_collective(collective, mesh, local)
    return local

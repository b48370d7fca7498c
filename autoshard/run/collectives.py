"""The mesh collectives on torch.distributed, one device's side of each.

The semantics are `autoshard.execute.simulate`'s: groups in `Mesh.device_groups` order, pieces
ceil-sized along a dim (the last ones smaller or empty). torch numbers a group's members by
their global rank, sorted (`new_group` sorts), which is not the group's order when the mesh
axes are listed inner before outer: every exchange here puts pieces in torch's order and
reads them back in the group's.

Data moves as bytes (numpy lays pieces out, torch carries them), so any element type moves;
reductions run on typed tensors: booleans as uint8 (sum becomes max: any), bfloat16 through
its 16 bits, the average as a sum divided by the group size (gloo has no average of its own
for every type). Pieces of unequal size are padded to the largest and trimmed after.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from autoshard.errors import AutoshardError
from autoshard.execute.simulate import piece
from autoshard.sharding import ReductionKind, shard_bounds

_OPS = {
    ReductionKind.SUM: dist.ReduceOp.SUM,
    ReductionKind.AVERAGE: dist.ReduceOp.SUM,
    ReductionKind.MAX: dist.ReduceOp.MAX,
    ReductionKind.MIN: dist.ReduceOp.MIN,
    ReductionKind.PRODUCT: dist.ReduceOp.PRODUCT,
    ReductionKind.BITWISE_AND: dist.ReduceOp.BAND,
    ReductionKind.BITWISE_OR: dist.ReduceOp.BOR,
    ReductionKind.BITWISE_XOR: dist.ReduceOp.BXOR,
}
# On booleans (held as 0/1 bytes), what each reduction is.
_BOOL_OPS = {
    ReductionKind.SUM: dist.ReduceOp.MAX,
    ReductionKind.AVERAGE: dist.ReduceOp.MAX,
    ReductionKind.PRODUCT: dist.ReduceOp.MIN,
}


class CollectiveError(AutoshardError):
    """A collective this backend cannot run on these values."""


class Groups:
    """One process group per device group of every collective, made in the manifest's order
    on every rank (torch requires all ranks to create every group, in the same order)."""

    def __init__(self, collectives: Sequence[Mapping[str, Any]]) -> None:
        self.made: dict[tuple[int, ...], Any] = {}
        for entry in collectives:
            for group in entry.get("groups", ()):
                key = tuple(group)
                if len(key) > 1 and key not in self.made:
                    self.made[key] = dist.new_group(list(key))

    def __getitem__(self, group: tuple[int, ...]) -> Any:
        return self.made[group]


def _to_bytes(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8).copy())


def _from_bytes(data: torch.Tensor, dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
    return data.numpy().view(dtype).reshape(shape)


def _typed(array: np.ndarray) -> torch.Tensor:
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.dtype == np.bool_:
        return torch.from_numpy(flat.astype(np.uint8))
    if flat.dtype.name == "bfloat16":
        return torch.from_numpy(flat.view(np.int16).copy()).view(torch.bfloat16)
    try:
        return torch.from_numpy(flat.copy())
    except TypeError:
        raise CollectiveError(f"torch cannot reduce {flat.dtype} values") from None


def _untyped(tensor: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    if dtype == np.bool_:
        return tensor.numpy().astype(bool)
    if dtype.name == "bfloat16":
        return tensor.view(torch.int16).numpy().view(dtype)
    return tensor.numpy()


def _op(kind: ReductionKind, dtype: np.dtype) -> Any:
    if dtype == np.bool_:
        return _BOOL_OPS.get(kind, _OPS[kind])
    return _OPS[kind]


def _finish(kind: ReductionKind, array: np.ndarray, n: int, dtype: np.dtype) -> np.ndarray:
    """The reduced values in the source's type; an average divides the sum by n."""
    if kind is ReductionKind.AVERAGE and dtype != np.bool_:
        return np.asarray(array / n).astype(dtype)
    return array.astype(dtype, copy=False)


class Executor:
    """Runs this rank's side of the manifest's collectives."""

    def __init__(self, manifest: Mapping[str, Any], rank: int, backend: str = "gloo") -> None:
        self.manifest, self.rank = manifest, rank
        # NCCL moves GPU tensors only: each rank uses the GPU of its local rank.
        self.device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            if backend == "nccl"
            else torch.device("cpu")
        )
        self.groups = Groups(manifest["collectives"])

    def put(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device)

    def run(self, entry: Mapping[str, Any], x: np.ndarray) -> np.ndarray:
        kind = entry["kind"]
        if kind == "permute":
            return self.permute(entry, x)
        group = next(tuple(g) for g in entry["groups"] if self.rank in g)
        n, p = len(group), group.index(self.rank)
        dtype = x.dtype
        if kind == "all_slice":
            return piece(x, entry["slice_axis"], p, n)
        if kind == "all_gather":
            return self.all_gather(entry, x, group)
        if kind == "all_to_all":
            return self.all_to_all(entry, x, group)
        reduction = ReductionKind(entry["reduction"])
        if kind == "all_reduce":
            if n == 1:
                return _finish(reduction, x, 1, dtype)
            tensor = self.put(_typed(x))
            dist.all_reduce(tensor, _op(reduction, dtype), group=self.groups[group])
            return _finish(reduction, _untyped(tensor.cpu(), dtype).reshape(x.shape), n, dtype)
        if kind == "reduce_scatter":
            return self.reduce_scatter(entry, x, group, reduction)
        raise CollectiveError(f"unknown collective kind {kind!r}")

    def all_gather(
        self, entry: Mapping[str, Any], x: np.ndarray, group: tuple[int, ...]
    ) -> np.ndarray:
        dim, shapes = entry["gather_axis"], entry["source_shapes"]
        if len(group) == 1:
            return x
        sizes = [int(np.prod(shapes[m])) * x.itemsize for m in group]
        width = max(sizes)
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: x.nbytes] = _to_bytes(x)
        received = [self.put(torch.empty(width, dtype=torch.uint8)) for _ in group]
        dist.all_gather(received, self.put(mine), group=self.groups[group])
        order = sorted(group)
        pieces = [
            _from_bytes(received[order.index(m)][:size].cpu(), x.dtype, shapes[m])
            for m, size in zip(group, sizes, strict=True)
        ]
        return np.concatenate(pieces, axis=dim)

    def reduce_scatter(
        self,
        entry: Mapping[str, Any],
        x: np.ndarray,
        group: tuple[int, ...],
        reduction: ReductionKind,
    ) -> np.ndarray:
        dim, n, p = entry["scatter_axis"], len(group), group.index(self.rank)
        dtype = x.dtype
        pieces = [piece(x, dim, q, n) for q in range(n)]
        if n == 1:
            return _finish(reduction, pieces[0], 1, dtype)
        width = max(q.size for q in pieces)
        typed = []
        for member in sorted(group):
            flat = _typed(pieces[group.index(member)])
            typed.append(self.put(torch.nn.functional.pad(flat, (0, width - flat.numel()))))
        out = self.put(torch.empty(width, dtype=typed[0].dtype))
        dist.reduce_scatter(out, typed, _op(reduction, dtype), group=self.groups[group])
        mine = pieces[p]
        values = _untyped(out[: mine.size].cpu(), dtype).reshape(mine.shape)
        return _finish(reduction, values, n, dtype)

    def all_to_all(
        self, entry: Mapping[str, Any], x: np.ndarray, group: tuple[int, ...]
    ) -> np.ndarray:
        split, concat = entry["split_axis"], entry["concat_axis"]
        n, p = len(group), group.index(self.rank)
        if n == 1:
            return x
        order = sorted(group)
        shapes = entry["source_shapes"]
        outgoing = [piece(x, split, group.index(m), n) for m in order]

        def incoming_shape(member: int) -> list[int]:
            shape = list(shapes[member])
            start, stop = shard_bounds(shape[split], n, p)
            shape[split] = stop - start
            return shape

        received_shapes = [incoming_shape(m) for m in order]
        send = self.put(torch.cat([_to_bytes(q) for q in outgoing]))
        out_sizes = [int(np.prod(s)) * x.itemsize for s in received_shapes]
        receive = self.put(torch.empty(sum(out_sizes), dtype=torch.uint8))
        dist.all_to_all_single(
            receive, send, out_sizes, [q.nbytes for q in outgoing], group=self.groups[group]
        )
        parts = torch.split(receive.cpu(), out_sizes)
        by_member = {
            m: _from_bytes(part, x.dtype, s)
            for m, part, s in zip(order, parts, received_shapes, strict=True)
        }
        return np.concatenate([by_member[m] for m in group], axis=concat)

    def permute(self, entry: Mapping[str, Any], x: np.ndarray) -> np.ndarray:
        """Each (source, target) pair sends the source's whole shard; a device no pair
        targets keeps its own."""
        shapes = entry["source_shapes"]
        out, works, inbox = x, [], None
        for source, target in entry.get("pairs", ()):
            if source == target == self.rank:
                continue
            if source == self.rank:
                works.append(dist.isend(self.put(_to_bytes(x)), target))
            if target == self.rank:
                size = int(np.prod(shapes[source])) * x.itemsize
                inbox = (self.put(torch.empty(size, dtype=torch.uint8)), shapes[source])
                works.append(dist.irecv(inbox[0], source))
        for work in works:
            if work is not None:
                work.wait()
        if inbox is not None:
            out = _from_bytes(inbox[0].cpu(), x.dtype, inbox[1])
        return out

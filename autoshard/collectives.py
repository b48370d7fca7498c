"""The collectives a plan is made of: their kinds, the ring formulas that price them, and the
`Collective` value that names one (kind, value, mesh axes, the dims it moves)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from autoshard.errors import CollectiveError
from autoshard.sharding import ReductionKind, Sharding, shard_size


class CollectiveKind(enum.StrEnum):
    ALL_GATHER = "all_gather"
    ALL_SLICE = "all_slice"
    ALL_TO_ALL = "all_to_all"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    PERMUTE = "permute"


AXIS_NAMES: Mapping[CollectiveKind, tuple[str, ...]] = MappingProxyType(
    {
        CollectiveKind.ALL_GATHER: ("gather_axis",),
        CollectiveKind.ALL_SLICE: ("slice_axis",),
        CollectiveKind.REDUCE_SCATTER: ("scatter_axis",),
        CollectiveKind.ALL_TO_ALL: ("split_axis", "concat_axis"),
    }
)
"""The mesh dialect's names of a collective's `dim` and `to_dim`, by kind: what the text, the
JSON and the MLIR of a collective call them."""


FIELDS: Mapping[CollectiveKind, tuple[str, ...]] = MappingProxyType(
    {
        CollectiveKind.ALL_GATHER: ("dim",),
        CollectiveKind.ALL_SLICE: ("dim",),
        CollectiveKind.ALL_TO_ALL: ("dim", "to_dim"),
        CollectiveKind.ALL_REDUCE: ("reduction",),
        CollectiveKind.REDUCE_SCATTER: ("dim", "reduction"),
        CollectiveKind.PERMUTE: ("pairs",),
    }
)
"""The optional fields of a `Collective` each kind sets, and no others: the rest stay unset.
A permute's `pairs` may be empty (no shard moves when the axes it crosses have size 1)."""

_OPTIONAL = ("dim", "to_dim", "reduction", "pairs")


def ring_bytes(kind: CollectiveKind, n: int, local: int) -> int:
    """Bytes one device sends in a ring collective over n devices, `local` its input shard's bytes
    (docs/design/collectives.md): all_gather (n-1)/n of the n*local gathered; reduce_scatter and
    all_to_all (n-1)/n of the input; all_reduce twice that; all_slice nothing (local)."""
    piece = shard_size(local, n)  # the ring moves the input in n ceil-sized chunks
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

    `dim` is the tensor dim an all_gather gathers, an all_slice slices, a reduce_scatter
    scatters or an all_to_all splits; `to_dim` the dim an all_to_all concatenates. They print
    under the dialect's names (`AXIS_NAMES`). `pairs` lists (source, target) linear device
    indices of a permute. The kind decides which of these are set (`FIELDS`), checked here.
    """

    kind: CollectiveKind
    mesh_axes: tuple[int, ...]
    src: Sharding
    dst: Sharding
    shape: tuple[int, ...]
    bytes_per_device: int
    dim: int | None = None
    to_dim: int | None = None
    reduction: ReductionKind | None = None
    pairs: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        sets = FIELDS[self.kind]
        for name in _OPTIONAL:
            value = getattr(self, name)
            if name in sets and value is None:
                raise CollectiveError(f"collective {self.kind} needs `{name}`")
            if name not in sets and value not in (None, ()):
                fields = " and ".join(f"`{f}`" for f in sets)
                raise CollectiveError(
                    f"collective {self.kind} takes no `{name}` (it sets {fields}), "
                    f"got {name}={value!r}"
                )

    @property
    def axis_attrs(self) -> dict[str, int]:
        """The dims set, under the dialect's names: `{'split_axis': 1, 'concat_axis': 0}`."""
        names = AXIS_NAMES.get(self.kind, ())
        dims = (self.dim, self.to_dim)
        return {name: d for name, d in zip(names, dims, strict=False) if d is not None}

    def __str__(self) -> str:
        text = f"{self.kind} mesh_axes = [{', '.join(map(str, self.mesh_axes))}]"
        if self.reduction is not None:
            text += f" reduction = {self.reduction}"
        for name, dim in self.axis_attrs.items():
            text += f" {name} = {dim}"
        return text

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "kind": self.kind.value,
            "mesh_axes": list(self.mesh_axes),
            "from": self.src.text(len(self.shape)),
            "to": self.dst.text(len(self.shape)),
            "bytes_per_device": self.bytes_per_device,
        }
        data.update(self.axis_attrs)
        if self.reduction is not None:
            data["reduction"] = self.reduction.value
        if self.pairs:
            data["pairs"] = [list(p) for p in self.pairs]
        return data

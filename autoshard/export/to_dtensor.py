"""A plan as PyTorch DTensor placements per parameter, and a module that applies them.

One placement per mesh axis: `Shard(d)`, `Replicate()`, or `Partial()`. A tensor dim split over
several mesh axes lists them outer to inner (the plan's split_axes order, major to minor), but
DTensor shards a dim over its mesh axes in mesh order (a lower mesh dim is more major). So an
axis gets `Shard(d)` when no axis listed before it on that dim has a higher mesh index, and
`_StridedShard(d, split_factor=F)` otherwise, F being the product of the sizes of the axes
listed before it with a higher index. Worked example, mesh dp=2,tp=2, dim 0 of 8 rows split
`[[1, 0]]` (tp-major): device (dp=i, tp=j) holds rows [2(2j + i), 2(2j + i) + 2); placements
`[_StridedShard(0, split_factor=2), Shard(0)]`. `_StridedShard` is private torch API
(torch.distributed.tensor.placement_types); the round trip in tests/export checks it.

A parameter whose ONNX weight is its transpose swaps the dim (an ONNX MatMul's B of shape
[in, out] split on dim 1 is `Shard(0)` of the torch Linear.weight [out, in]).

Uneven shards differ: the plan splits a dim of K over M shards in ceil(K/M) pieces, DTensor in
nested `torch.chunk` (6 rows on 2x2: the plan 2/2/2/0, DTensor 2/1/2/1); such parameters are
listed in the warnings.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.export.dtensor_traffic import dtensor_traffic
from autoshard.export.held import Held, mesh_dim_names
from autoshard.export.stages import stage_split
from autoshard.export.styles import Style, choose_styles, data_axes
from autoshard.mesh import Mesh
from autoshard.sharding import Sharding

SCHEMA = "autoshard.export.dtensor/1"


class Kind(enum.Enum):
    SHARD = "Shard"
    STRIDED = "_StridedShard"
    REPLICATE = "Replicate"
    PARTIAL = "Partial"


@dataclass(frozen=True)
class Placement:
    """One mesh axis's DTensor placement; `str` is the Python that builds it."""

    kind: Kind
    dim: int = 0
    split_factor: int = 1

    def __str__(self) -> str:
        if self.kind is Kind.SHARD:
            return f"Shard({self.dim})"
        if self.kind is Kind.STRIDED:
            return f"_StridedShard({self.dim}, split_factor={self.split_factor})"
        return f"{self.kind.value}()"


def placements(sharding: Sharding, mesh: Mesh, transposed: bool = False) -> tuple[Placement, ...]:
    """The DTensor placements of a tensor held as `sharding` (see the module's docstring)."""
    out = [Placement(Kind.REPLICATE)] * mesh.ndim
    for dim, axes in enumerate(sharding.split_axes):
        torch_dim = 1 - dim if transposed else dim
        for i, axis in enumerate(axes):
            higher = [a for a in axes[:i] if a > axis]
            out[axis] = (
                Placement(Kind.STRIDED, torch_dim, math.prod(mesh.shape[a] for a in higher))
                if higher
                else Placement(Kind.SHARD, torch_dim)
            )
    for axis in sharding.partial_axes:
        out[axis] = Placement(Kind.PARTIAL)
    return tuple(out)


def _uneven(sharding: Sharding, mesh: Mesh, shape: Sequence[int]) -> bool:
    """A dim split over several axes whose shards differ: ceil-div and nested torch.chunk part
    ways (a single axis cuts the same in both)."""
    return any(
        len(axes) > 1 and shape[dim] % math.prod(mesh.shape[a] for a in axes)
        for dim, axes in enumerate(sharding.split_axes)
    )


def dtensor_export(held: Held) -> dict[str, object]:
    """The DTensor export: the mesh, the parallel styles that apply the plan, then per
    parameter its placements as stored, as read, its style and where it came from (and, of a
    training plan, its strategy and the optimizer state's placements); weights with no
    recovered name, and what DTensor cannot hold as planned."""
    mesh, names = held.mesh, mesh_dim_names(held.mesh)
    styles = choose_styles(held)
    parameters: dict[str, dict[str, object]] = {}
    warnings = list(held.warnings)
    for p in held.params:
        shape = held.shapes[p.weight]
        entry: dict[str, object] = {
            "placements": [str(x) for x in placements(p.sharding, mesh, p.transposed)],
            "used": [str(x) for x in placements(Sharding(styles.used[p.param]), mesh)],
            "style": styles.params[p.param],
            "onnx_weight": p.weight,
            "transposed": p.transposed,
            "source": str(p.source),
        }
        strategy = held.strategies.get(p.weight)
        if strategy is not None:
            state = Sharding.parse(strategy.state)
            entry["strategy"] = strategy.strategy
            entry["optimizer_state"] = [str(x) for x in placements(state, mesh, p.transposed)]
        if p.param in styles.direct:
            entry["held"] = [str(x) for x in placements(Sharding(styles.direct[p.param]), mesh)]
        parameters[p.param] = entry
        if _uneven(p.sharding, mesh, shape):
            warnings.append(
                f"{p.param}: {p.sharding.text(len(shape))} on shape {list(shape)} is uneven; "
                "DTensor cuts it by nested torch.chunk, not the plan's ceil-div"
            )
    modules: dict[str, dict[str, object]] = {}
    for path, m in styles.modules.items():
        modules[path] = {"style": str(m.style)}
        if m.in_out and m.style in (Style.COLWISE, Style.ROWWISE):
            modules[path]["in_out"] = True
        if path in styles.axes:  # styled over another mesh dim than `tp`
            modules[path]["axis"] = names[styles.axes[path]]
        if m.sequence_dim is not None:
            modules[path]["sequence_dim"] = m.sequence_dim
        if m.fsdp_dims:
            modules[path]["fsdp_dims"] = dict(sorted(m.fsdp_dims.items()))
            modules[path]["reshard_after_forward"] = not m.zero
    inputs = {
        name: [str(x) for x in placements(held.plan.values.get(name, Sharding()), mesh)]
        for name in held.graph.inputs
        if name not in held.graph.weights
    }
    document: dict[str, object] = {
        "schema": SCHEMA,
        "mesh": {"shape": list(mesh.shape), "dim_names": list(names)},
        "inputs": inputs,
        "data": data_dims(held),
        "parallelize": {
            "tp": None if styles.tp_axis is None else names[styles.tp_axis],
            "fsdp": None if styles.fsdp_axis is None else names[styles.fsdp_axis],
            "fallback": styles.fallback,
            "modules": modules,
        },
        "parameters": parameters,
        "unnamed": held.unnamed,
        "warnings": warnings,
    }
    split = stage_split(held)
    if split is not None:  # a pipelined plan: its stages as torch.distributed.pipelining takes
        document["pipeline"] = split.to_json()
    if held.strategies:  # a training plan: what its step moves as torch runs it
        document["traffic"] = dtensor_traffic(held, document).to_json()
    return document


def data_dims(held: Held) -> list[str]:
    """The mesh dims that split the batch (dim 0 of some model input): each data-parallel
    group of those dims reads its own examples, and the gradients are averaged over them."""
    names = mesh_dim_names(held.mesh)
    return [names[a] for a in sorted(data_axes(held))]

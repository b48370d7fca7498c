"""Which device holds which part of a tensor: the data behind `autoshard layout`.

The drawing follows docs/design/resharding.md's diagrams: the mesh as a grid of cells (mesh axis 0
down, the last axis across; outer axes of a 3-D or larger mesh as separate blocks), each cell
showing the tensor elements its device holds. Elements of a matrix with at most 9 rows and columns
are labelled as there, row then column, 1-based (`23` is row 2, column 3); larger tensors show their
slice bounds instead.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from autoshard.errors import LimitError
from autoshard.limits import MAX_LAYOUT_DEVICES
from autoshard.mesh import Device, Mesh
from autoshard.sharding import Sharding, Slice


@dataclass(frozen=True)
class DeviceShard:
    """What one device holds: its slice of the global tensor (halo included)."""

    device: Device
    linear: int
    slices: tuple[Slice, ...]
    partial: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.slices)

    def to_json(self) -> dict[str, object]:
        return {
            "index": list(self.device),
            "linear": self.linear,
            "slices": [list(s) for s in self.slices],
            "partial": self.partial,
        }


def device_shards(mesh: Mesh, shape: tuple[int, ...], sharding: Sharding) -> list[DeviceShard]:
    """Every device's shard, in linear-index order."""
    if mesh.size > MAX_LAYOUT_DEVICES:
        raise LimitError(
            f"mesh {mesh} has {mesh.size} devices; a layout draws at most MAX_LAYOUT_DEVICES = "
            f"{MAX_LAYOUT_DEVICES} (one line each)"
        )
    sharding.check(mesh, shape)
    partial = bool(sharding.partial_axes)
    return [
        DeviceShard(
            device, mesh.linear_index(device), sharding.slices(mesh, shape, device), partial
        )
        for device in mesh.devices()
    ]


def layout_json(mesh: Mesh, shape: tuple[int, ...], sharding: Sharding) -> dict[str, object]:
    return {
        "mesh": str(mesh),
        "mesh_shape": list(mesh.shape),
        "shape": list(shape),
        "sharding": sharding.text(len(shape)),
        "devices": [shard.to_json() for shard in device_shards(mesh, shape, sharding)],
    }


def draw_layout(mesh: Mesh, shape: tuple[int, ...], sharding: Sharding) -> str:
    """The picture of the layout (mesh cells and their elements) plus one line per device."""
    shards = {s.device: s for s in device_shards(mesh, shape, sharding)}
    tensor = "x".join(map(str, shape)) if shape else "scalar"
    lines = [f"tensor {tensor} sharded {sharding.text(len(shape))} on mesh {mesh}"]
    if sharding.partial_axes:
        axes = ", ".join(map(str, sharding.partial_axes))
        lines.append(
            f"every device holds a partial {sharding.partial_type} over mesh axes [{axes}]: "
            "the value is the reduction of the devices' tensors"
        )
    lines.append("")
    labelled = len(shape) == 2 and max(shape) <= 9
    inner = mesh.ndim - 1
    rows_axis = mesh.ndim - 2 if mesh.ndim >= 2 else None
    outer_axes = range(mesh.ndim - 2)  # the axes drawn as separate blocks (none below 3-D)
    lines.append(
        f"mesh axis {inner} ->"
        + (f"   (mesh axis {rows_axis} down)" if rows_axis is not None else "")
    )
    for outer in itertools.product(*(range(mesh.shape[a]) for a in outer_axes)):
        if outer:
            where = ", ".join(f"axis {a} = {c}" for a, c in zip(outer_axes, outer, strict=True))
            lines.append(f"mesh {where}:")
        rows = range(mesh.shape[rows_axis]) if rows_axis is not None else [None]
        grid = [
            [
                _cell(shards[(*outer, *(() if r is None else (r,)), c)], labelled)
                for c in range(mesh.shape[inner])
            ]
            for r in rows
        ]
        lines.extend(_draw_grid(grid))
    lines.append("")
    for shard in shards.values():
        bounds = ", ".join(f"{a}:{b}" for a, b in shard.slices)
        local = "x".join(map(str, shard.shape)) if shard.shape else "scalar"
        empty = "  (empty)" if 0 in shard.shape else ""
        lines.append(f"device {shard.device} #{shard.linear}: [{bounds}] local {local}{empty}")
    return "\n".join(lines)


def _cell(shard: DeviceShard, labelled: bool) -> list[str]:
    if 0 in shard.shape:
        return ["empty"]
    if labelled:
        (r0, r1), (c0, c1) = shard.slices
        return [" ".join(f"{r + 1}{c + 1}" for c in range(c0, c1)) for r in range(r0, r1)]
    return ["[" + ", ".join(f"{a}:{b}" for a, b in shard.slices) + "]"]


def _draw_grid(grid: list[list[list[str]]]) -> list[str]:
    widths = [max(len(line) for row in grid for line in row[c]) for c in range(len(grid[0]))]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [rule]
    for row in grid:
        height = max(len(cell) for cell in row)
        for i in range(height):
            texts = [
                (cell[i] if i < len(cell) else "").ljust(w)
                for cell, w in zip(row, widths, strict=True)
            ]
            out.append("| " + " | ".join(texts) + " |")
        out.append(rule)
    return out

"""Which block of a tensor each device holds, as a picture (`autoshard layout`'s data,
`layout.device_shards`, drawn): the tensor as a rectangle cut into the blocks its sharding
makes, each block a colour, and beside it the mesh with every device in the colour of its block.

A tensor of more than two dims is drawn on two of them: the two split into the most shards (a
split dim and its neighbour, the last two when nothing is split); the caption names any other
split dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autoshard.cost.liveness import shard_bytes
from autoshard.explain.layout import device_shards
from autoshard.html.markup import block_colour, esc, num, size, svg, tag
from autoshard.html.mesh import Cell, axis_label, drawn_per_device, mesh_svg
from autoshard.limits import MAX_LAYOUT_DEVICES
from autoshard.mesh import Device, Mesh
from autoshard.sharding import Sharding, Slice

SIDE = 320
"""The longer side of the tensor's rectangle."""


def drawn_dims(mesh: Mesh, shape: Sequence[int], sharding: Sharding) -> tuple[int, ...]:
    """The (at most two) dims the picture shows, in order: rows, then columns."""
    rank = len(shape)
    if rank <= 1:
        return tuple(range(rank))
    counts = {d: sharding.shard_count(mesh, d) for d in range(rank)}
    split = sorted((d for d in range(rank) if counts[d] > 1), key=lambda d: (-counts[d], d))
    if len(split) >= 2:
        return tuple(sorted(split[:2]))
    if split:
        d = split[0]
        return tuple(sorted((d, rank - 1 if d != rank - 1 else rank - 2)))
    return (rank - 2, rank - 1)


def tensor_figure(
    mesh: Mesh,
    name: str,
    shape: Sequence[int],
    dtype: str,
    sharding: Sharding,
    in_node: Sequence[bool],
    how: str,
) -> str:
    """A `<figure>`: the tensor's blocks, the mesh coloured by them, and a caption saying
    `how` the tensor is held (`held`, `read by op X`) and what each device holds."""
    caption = _caption(mesh, name, shape, dtype, sharding, how)
    if mesh.size > MAX_LAYOUT_DEVICES:
        note = f"(not drawn: more than MAX_LAYOUT_DEVICES = {MAX_LAYOUT_DEVICES} devices)"
        return tag("figure", tag("figcaption", caption + " " + esc(note)), class_="tensor")
    dims = drawn_dims(mesh, shape, sharding)
    shards = device_shards(mesh, tuple(shape), sharding)
    blocks: dict[tuple[Slice, ...], list[int]] = {}
    of_device: dict[Device, int] = {}
    for shard in shards:
        key = tuple(shard.slices[d] for d in dims)
        of_device[shard.device] = list(blocks).index(key) if key in blocks else len(blocks)
        blocks.setdefault(key, []).append(shard.linear)
    rows = shape[dims[0]] if len(dims) == 2 else 1
    cols = shape[dims[-1]] if dims else 1
    aspect = min(1.0, max(0.25, rows / cols if cols else 1.0)) if len(dims) == 2 else 0.16
    width, height = SIDE, SIDE * aspect
    left, top = 28, 22
    out = []
    for i, (key, devices) in enumerate(blocks.items()):
        (r0, r1) = key[0] if len(dims) == 2 else (0, 1)
        (c0, c1) = key[-1] if dims else (0, 1)
        if r1 <= r0 or c1 <= c0:
            continue  # an empty shard: nothing to draw
        x, y = left + width * c0 / (cols or 1), top + height * r0 / (rows or 1)
        w, h = width * (c1 - c0) / (cols or 1), height * (r1 - r0) / (rows or 1)
        where = ", ".join(f"dim {d} {a}:{b}" for d, (a, b) in zip(dims, key, strict=True))
        title = f"B{i + 1}: {where or 'the whole tensor'}; devices {_list(devices)}"
        body = tag("title", esc(title))
        body += tag("rect", x=num(x), y=num(y), width=num(w), height=num(h),
                    fill=block_colour(i), class_="block")  # fmt: skip
        if w >= 24 and h >= 16:
            body += tag("text", f"B{i + 1}", x=num(x + w / 2), y=num(y + h / 2 + 4),
                        class_="cell-label")  # fmt: skip
        out.append(tag("g", body))
    if dims:
        across = f"dim {dims[-1]} ({shape[dims[-1]]}) \u2192"
        out.append(tag("text", esc(across), x=num(left), y="14", class_="axis"))
    if len(dims) == 2:
        down = f"dim {dims[0]} ({shape[dims[0]]}) \u2192"
        out.append(tag("text", esc(down), x="0", y="0", class_="axis",
                       transform=f"translate(12 {num(top)}) rotate(90)"))  # fmt: skip
    pictures = [svg(left + width + 4, top + height + 4, f"blocks of {name}", "".join(out))]
    if drawn_per_device(mesh):

        def cell(device: Device) -> Cell:
            b = of_device[device]
            return Cell(block_colour(b), f"B{b + 1}",
                        f"device {device} #{mesh.linear_index(device)} holds B{b + 1}")  # fmt: skip

        pictures.append(mesh_svg(mesh, cell, in_node))
    body = tag("div", "".join(pictures), class_="pictures") + tag("figcaption", caption)
    return tag("figure", body, class_="tensor", data_tensor=name)


def _caption(
    mesh: Mesh, name: str, shape: Sequence[int], dtype: str, sharding: Sharding, how: str
) -> str:
    rank = len(shape)
    dims = "x".join(map(str, shape)) or "scalar"
    local = [math.ceil(n / sharding.shard_count(mesh, d)) for d, n in enumerate(shape)]
    held = shard_bytes(shape, dtype, sharding, mesh)
    parts = [
        f"{tag('code', esc(name))}: {esc(dims)} {esc(dtype)}, {esc(how)} "
        f"{tag('code', esc(sharding.text(rank)))}; each device holds at most "
        f"{esc('x'.join(map(str, local)) or 'scalar')} ({esc(size(held))})."
    ]
    split_axes = {a for axes in sharding.split_axes for a in axes}
    for d, axes in enumerate(sharding.split_axes):
        if axes:
            over = ", ".join(axis_label(mesh, a) for a in axes)
            parts.append(esc(f"Dim {d} split over {over}."))
    replicated = [axis_label(mesh, a) for a in range(mesh.ndim) if a not in split_axes
                  and a not in sharding.partial_axes]  # fmt: skip
    if replicated:
        parts.append(esc(f"Replicated over {', '.join(replicated)}."))
    if sharding.partial_axes:
        over = ", ".join(axis_label(mesh, a) for a in sharding.partial_axes)
        parts.append(esc(f"Partial {sharding.partial_type} over {over}: each device holds a "
                         "partial result, the value is their reduction."))  # fmt: skip
    return " ".join(parts)


def _list(devices: Sequence[int]) -> str:
    shown = ", ".join(map(str, devices[:8]))
    return shown + (f" \u2026 ({len(devices)} devices)" if len(devices) > 8 else "")

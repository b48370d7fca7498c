"""The device mesh as an SVG picture, drawn as `autoshard layout` draws it: the last axis
across, the one before it down, a third axis as blocks side by side; the devices of one node
(the axes on the scale-up link) inside a dashed box. Each device is one cell whose colour,
label and tooltip the caller picks (the mesh section labels devices, the layout section colours
them by the block of a tensor they hold).

A mesh of more than `MAX_DRAWN` devices or more than 3 axes is drawn compactly instead: one
row of a few cells per axis, its size written out, so that no page holds thousands of
elements.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autoshard.html.markup import esc, num, svg, tag
from autoshard.mesh import Device, Mesh

MAX_DRAWN = 256
"""Devices drawn one cell each; a larger mesh is drawn compactly."""

WIDTH = 960
_LEFT, _TOP, _GAP = 34, 40, 18


@dataclass(frozen=True)
class Cell:
    """How one device is drawn: fill colour, a short label, a tooltip."""

    fill: str
    label: str
    title: str


def axis_label(mesh: Mesh, axis: int) -> str:
    """`tp` for a named axis, `axis 0` otherwise."""
    return mesh.axis_names[axis] if mesh.axis_names else f"axis {axis}"


def drawn_per_device(mesh: Mesh) -> bool:
    return mesh.size <= MAX_DRAWN and mesh.ndim <= 3


def mesh_svg(mesh: Mesh, cell: Callable[[Device], Cell], in_node: Sequence[bool]) -> str:
    """The mesh, one cell per device (`cell` draws each), or compactly when too large."""
    if not drawn_per_device(mesh):
        return compact_mesh_svg(mesh, in_node)
    blocks = list(itertools.product(range(mesh.shape[0]))) if mesh.ndim == 3 else [()]
    rows = mesh.shape[-2] if mesh.ndim >= 2 else 1
    cols = mesh.shape[-1]
    side = max(22.0, min(56.0, (WIDTH - _LEFT - _GAP * (len(blocks) - 1)) / (cols * len(blocks))))
    block_w, block_h = cols * side, rows * side
    per_line = max(1, min(len(blocks), int((WIDTH - _LEFT + _GAP) // (block_w + _GAP))))
    label_h = 18 if mesh.ndim == 3 else 0
    lines = -(-len(blocks) // per_line)
    height = _TOP + lines * (block_h + label_h + _GAP)
    width = min(WIDTH, _LEFT + per_line * (block_w + _GAP))
    out: list[str] = []
    places: dict[Device, tuple[float, float]] = {}
    for b, block in enumerate(blocks):
        x0 = _LEFT + (b % per_line) * (block_w + _GAP)
        y0 = _TOP + label_h + (b // per_line) * (block_h + label_h + _GAP)
        if block:
            where = f"{axis_label(mesh, 0)} = {block[0]}"
            out.append(tag("text", esc(where), x=num(x0), y=num(y0 - 5), class_="small"))
        for r in range(rows):
            for c in range(cols):
                device = (*block, *((r,) if mesh.ndim >= 2 else ()), c)
                places[device] = (x0 + c * side, y0 + r * side)
    for device, (x, y) in places.items():
        drawn = cell(device)
        body = tag("title", esc(drawn.title))
        body += tag("rect", x=num(x + 1), y=num(y + 1), width=num(side - 2), height=num(side - 2),
                    fill=drawn.fill, class_="cell")  # fmt: skip
        if drawn.label and side >= 26:
            body += tag("text", esc(drawn.label), x=num(x + side / 2), y=num(y + side / 2 + 4),
                        class_="cell-label")  # fmt: skip
        out.append(tag("g", body))
    out += _node_boxes(mesh, in_node, places, side)
    across = f"{axis_label(mesh, mesh.ndim - 1)} ({mesh.shape[-1]}) \u2192"
    out.append(tag("text", esc(across), x=num(_LEFT), y="16", class_="axis"))
    if mesh.ndim >= 2:
        down = f"{axis_label(mesh, mesh.ndim - 2)} ({mesh.shape[-2]}) \u2192"
        y = _TOP + label_h
        out.append(tag("text", esc(down), x="0", y="0", class_="axis",
                       transform=f"translate(14 {num(y)}) rotate(90)"))  # fmt: skip
    return svg(width, height, f"mesh {mesh}", "".join(out))


def _node_boxes(
    mesh: Mesh,
    in_node: Sequence[bool],
    places: dict[Device, tuple[float, float]],
    side: float,
) -> list[str]:
    """A dashed box around the devices of each node: the devices that agree on every axis
    across nodes."""
    if not any(in_node):
        return []
    nodes: dict[tuple[int, ...], list[tuple[float, float]]] = {}
    for device, xy in places.items():
        key = tuple(c for c, inside in zip(device, in_node, strict=True) if not inside)
        nodes.setdefault(key, []).append(xy)
    boxes = []
    for corners in nodes.values():
        x0, y0 = min(x for x, _ in corners), min(y for _, y in corners)
        x1, y1 = max(x for x, _ in corners) + side, max(y for _, y in corners) + side
        boxes.append(tag("rect", x=num(x0 - 3), y=num(y0 - 3), width=num(x1 - x0 + 6),
                         height=num(y1 - y0 + 6), class_="node"))  # fmt: skip
    return boxes


def compact_mesh_svg(mesh: Mesh, in_node: Sequence[bool]) -> str:
    """One row per axis: its name, a few cells standing for its devices, its size."""
    row_h, side = 34, 22
    out = []
    for a, n in enumerate(mesh.shape):
        y = 10 + a * row_h
        label = f"{axis_label(mesh, a)}: {n} devices"
        out.append(tag("text", esc(label), x="0", y=num(y + 16), class_="axis"))
        shown = min(n, 8)
        for i in range(shown):
            x = 180 + i * (side + 4)
            out.append(tag("rect", x=num(x), y=num(y), width=num(side), height=num(side),
                           fill="#dfe7f2", class_="cell"))  # fmt: skip
        where = "in a node" if in_node[a] else "across nodes"
        more = f"\u2026 \u00d7{n}, {where}" if n > shown else where
        out.append(tag("text", esc(more), x=num(180 + shown * (side + 4) + 6), y=num(y + 16),
                       class_="small"))  # fmt: skip
    height = 10 + mesh.ndim * row_h
    return svg(WIDTH, height, f"mesh {mesh} (drawn compactly)", "".join(out))

"""autoshard's explicit limits: the largest inputs it accepts, each named in the error a larger
one gets, so that no input costs minutes or gigabytes before it is refused.

Nothing in planning allocates per tensor element; some steps do work per device (the
permutation search of `plan_reshard`, drawing a layout, each device's program), hence a device
limit far above any machine built. Byte counts of a plan are integers the resharding planner
and CP-SAT hold in int64: the element limit keeps a tensor's bytes below 2^46, so sums of
many steps and layers of it still fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autoshard.errors import LimitError

MAX_DEVICES = 1 << 16
"""Devices per mesh (65,536: the largest training clusters have about 100,000 GPUs, in
meshes whose every axis is far smaller)."""

MAX_MESH_AXES = 6
"""Axes per mesh: the resharding planner's shortest-path tables grow with the placements of
the axes on a tensor's dims (8 axes take minutes)."""

MAX_SEARCH_AXES = 4
"""Mesh axes `autoshard plan` searches over: its candidates are every assignment of axes to an
op's loops (on 5 axes a 2-layer MLP takes minutes). Larger meshes propagate annotations."""

MAX_ELEMENTS = 1 << 42
"""Elements per tensor (4,398,046,511,104: 16 TiB of float32; a 405B model's largest weight has
about 2 * 10^9)."""

MAX_LAYOUT_DEVICES = 4096
"""Devices `autoshard layout` draws (or lists in JSON): one line each."""


def check_devices(count: int, what: str) -> None:
    if count > MAX_DEVICES:
        raise LimitError(
            f"{what} has {count} devices; autoshard's limit is MAX_DEVICES = {MAX_DEVICES} "
            "devices per mesh"
        )


def check_axes(count: int, what: str) -> None:
    if count > MAX_MESH_AXES:
        raise LimitError(
            f"{what} has {count} axes; autoshard's limit is MAX_MESH_AXES = {MAX_MESH_AXES}"
        )


def check_search_axes(count: int, what: str) -> None:
    if count > MAX_SEARCH_AXES:
        raise LimitError(
            f"{what} has {count} axes; autoshard plan searches at most MAX_SEARCH_AXES = "
            f"{MAX_SEARCH_AXES} (propagate annotations on a larger mesh)"
        )


def check_elements(shape: Sequence[int], what: str) -> None:
    """`what` (`value 'x'`, `--shape 4x8`) names the tensor; its shape is added unless `what`
    spells it."""
    count = math.prod(shape)
    if count > MAX_ELEMENTS:
        dims = "x".join(map(str, shape))
        where = what if dims in what else f"{what} of shape {dims}"
        raise LimitError(
            f"{where} has {count} elements; autoshard's limit is MAX_ELEMENTS = "
            f"{MAX_ELEMENTS} elements per tensor"
        )

"""The device mesh: an N-D grid of devices (`mesh.mesh`, docs/design/sharding.md).

A mesh has a static shape (`4x8`) and optionally axis names (`dp=4,tp=8`). Devices are named by
their multi-index; the linear index is row-major, as `mesh.process_linear_index` defines it:
on shape (10, 20, 30), device (1, 2, 3) has linear index 3 + 30*2 + 20*30*1.

Collectives run within *device groups* (docs/design/collectives.md): for a list of `mesh_axes`,
devices that agree on every coordinate outside `mesh_axes` form one group. Inside a group the
devices are ordered by their coordinates on `mesh_axes`, taken in the listed order, outer to
inner: for axes [3, 1], device (i, 1, k, 0) precedes (i, 0, k, 1) and (i, 2, k, 0).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from autoshard.errors import MeshError
from autoshard.limits import check_axes, check_devices

Device = tuple[int, ...]
"""A device's multi-index on the mesh."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Mesh:
    """A static device mesh. `Mesh.parse("4x8")`, `Mesh.parse("dp=4,tp=8")`."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = ()
    name: str = "mesh0"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "axis_names", tuple(self.axis_names))
        if not self.shape:
            raise MeshError("a mesh needs at least one axis")
        for axis, size in enumerate(self.shape):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise MeshError(
                    f"mesh axis {axis} has size {size!r}; every axis size must be an integer >= 1"
                )
        if self.axis_names:
            if len(self.axis_names) != len(self.shape):
                raise MeshError(
                    f"mesh has {len(self.shape)} axes but {len(self.axis_names)} axis names"
                )
            for axis_name in self.axis_names:
                if not _NAME.match(axis_name):
                    raise MeshError(f"mesh axis name {axis_name!r} is not an identifier")
            if len(set(self.axis_names)) != len(self.axis_names):
                raise MeshError(f"mesh axis names repeat: {', '.join(self.axis_names)}")
        if not _NAME.match(self.name):
            raise MeshError(f"mesh name {self.name!r} is not an identifier")
        check_devices(math.prod(self.shape), f"mesh {self}")
        check_axes(len(self.shape), f"mesh {self}")

    # ---- text -------------------------------------------------------------------------------

    @staticmethod
    def parse(text: str, name: str = "mesh0") -> Mesh:
        """Parse `4x8`, `2x2x2`, `8` or named axes `dp=4,tp=8`.

        A `?` (dynamic) axis is legal in MLIR but a plan needs every size, so it is rejected.
        """
        spec = text.strip()
        if not spec:
            raise MeshError("empty mesh spec; write e.g. 4x8, 8 or dp=4,tp=8")
        if "=" in spec:
            names: list[str] = []
            sizes: list[int] = []
            for item in spec.split(","):
                axis_name, sep, size = item.partition("=")
                if not sep:
                    raise MeshError(
                        f"invalid mesh {text!r}: {item.strip()!r} is not NAME=SIZE; "
                        "write e.g. dp=4,tp=8"
                    )
                names.append(axis_name.strip())
                sizes.append(_parse_size(text, len(sizes), size))
            return Mesh(tuple(sizes), tuple(names), name)
        return Mesh(tuple(_parse_size(text, i, s) for i, s in enumerate(spec.split("x"))), (), name)

    def __str__(self) -> str:
        if self.axis_names:
            return ",".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape, strict=True))
        return "x".join(map(str, self.shape))

    # ---- geometry ---------------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of devices."""
        return math.prod(self.shape)

    def devices(self) -> Iterator[Device]:
        """All devices, in linear-index order."""
        return itertools.product(*(range(s) for s in self.shape))

    def linear_index(self, device: Sequence[int]) -> int:
        """Row-major index: on shape (10, 20, 30), (1, 2, 3) -> 3 + 30*2 + 20*30*1."""
        device = self._check_device(device)
        index = 0
        for coordinate, size in zip(device, self.shape, strict=True):
            index = index * size + coordinate
        return index

    def multi_index(self, linear: int) -> Device:
        """Inverse of `linear_index`."""
        if not 0 <= linear < self.size:
            raise MeshError(
                f"device {linear} is not on mesh {self}; it has devices 0..{self.size - 1}"
            )
        coordinates = []
        for size in reversed(self.shape):
            linear, coordinate = divmod(linear, size)
            coordinates.append(coordinate)
        return tuple(reversed(coordinates))

    def axis(self, ref: int | str) -> int:
        """An axis given by number or name, checked."""
        if isinstance(ref, str):
            if ref in self.axis_names:
                return self.axis_names.index(ref)
            if ref.isdigit():
                ref = int(ref)
            else:
                raise MeshError(
                    f"unknown mesh axis {ref!r}; mesh {self} has axes {self.axes_text()}"
                )
        if not 0 <= ref < self.ndim:
            raise MeshError(f"unknown mesh axis {ref}; mesh {self} has axes {self.axes_text()}")
        return ref

    def axes_text(self) -> str:
        """How the valid axes are named in error messages: `0..1` or `0..1 (dp, tp)`."""
        text = f"0..{self.ndim - 1}" if self.ndim > 1 else "0"
        return f"{text} ({', '.join(self.axis_names)})" if self.axis_names else text

    def group_size(self, mesh_axes: Sequence[int]) -> int:
        return math.prod(self.shape[a] for a in mesh_axes)

    # ---- device groups ------------------------------------------------------------------------

    def device_groups(self, mesh_axes: Sequence[int]) -> tuple[tuple[Device, ...], ...]:
        """The groups a collective over `mesh_axes` runs in.

        Groups are listed by their multi-index on the other axes (row-major); inside a group,
        devices are ordered by their coordinates on `mesh_axes` in the listed order, outer to
        inner. Mesh 2x3x4x5 with mesh_axes [0, 1] has 20 groups indexed (k, m), each of the 6
        devices {(i, j, k, m)}.
        """
        axes = self._check_axes(mesh_axes)
        others = [a for a in range(self.ndim) if a not in axes]
        groups = []
        for outer in itertools.product(*(range(self.shape[a]) for a in others)):
            group = []
            for inner in itertools.product(*(range(self.shape[a]) for a in axes)):
                device = [0] * self.ndim
                for a, c in zip(others, outer, strict=True):
                    device[a] = c
                for a, c in zip(axes, inner, strict=True):
                    device[a] = c
                group.append(tuple(device))
            groups.append(tuple(group))
        return tuple(groups)

    def in_group_index(self, device: Sequence[int], mesh_axes: Sequence[int]) -> int:
        """Position of `device` within its group for `mesh_axes` (axes outer to inner)."""
        device = self._check_device(device)
        index = 0
        for a in self._check_axes(mesh_axes):
            index = index * self.shape[a] + device[a]
        return index

    def group_index(self, device: Sequence[int], mesh_axes: Sequence[int]) -> Device:
        """The group's multi-index: `device`'s coordinates on the axes outside `mesh_axes`."""
        device = self._check_device(device)
        axes = self._check_axes(mesh_axes)
        return tuple(c for a, c in enumerate(device) if a not in axes)

    # ---- checks -----------------------------------------------------------------------------

    def _check_axes(self, mesh_axes: Sequence[int]) -> tuple[int, ...]:
        axes = tuple(mesh_axes)
        for a in axes:
            if not isinstance(a, int) or not 0 <= a < self.ndim:
                raise MeshError(
                    f"unknown mesh axis {a} in {list(axes)}; mesh @{self.name} has axes "
                    f"{self.axes_text()}"
                )
        if len(set(axes)) != len(axes):
            raise MeshError(f"mesh axes {list(axes)} repeat an axis")
        return axes

    def _check_device(self, device: Sequence[int]) -> Device:
        device = tuple(device)
        if len(device) != self.ndim or any(
            not 0 <= c < s for c, s in zip(device, self.shape, strict=True)
        ):
            raise MeshError(f"device {device} is not on mesh {self}")
        return device


def _parse_size(text: str, axis: int, size: str) -> int:
    size = size.strip()
    if size == "?":
        raise MeshError(
            f"invalid mesh {text!r}: axis {axis} has dynamic size '?'; MLIR allows dynamic "
            "mesh axes, but a plan needs every axis size"
        )
    try:
        value = int(size)
    except ValueError:
        raise MeshError(
            f"invalid mesh {text!r}: axis {axis} size {size!r} is not an integer; "
            "write e.g. 4x8, 8 or dp=4,tp=8"
        ) from None
    if value < 1:
        raise MeshError(f"invalid mesh {text!r}: axis {axis} has size {value}; sizes must be >= 1")
    return value

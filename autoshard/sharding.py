"""How a tensor is distributed over a mesh (`mesh.sharding`, docs/design/sharding.md).

`split_axes[d]` lists, outer to inner, the mesh axes that split tensor dim `d`: `[[0], [1, 2]]`
splits dim 0 over axis 0 and dim 1 over axes 1 then 2. `partial_axes` with a reduction kind
(`partial = sum[1]`) says each device holds a partial result to be reduced over those axes.
`halo_sizes` (two per split dim) widen every shard; `sharded_dims_offsets` (shard count + 1 per
split dim) replace the even split with explicit bounds. The two are mutually exclusive.

Shard bounds follow the index maps of docs/design/resharding.md: a dim of size K split over axes of
total size M has shards of S = ceil(K / M); shard s covers [s*S, (s+1)*S) clipped to K, so the last
shards may be smaller or empty. `shard_bounds` and `shard_size` are the only place this is written.
A device's shard index on a dim is its in-group index over that dim's axes, outer to inner: on mesh
2x3 with `[[0, 1]]`, device (m, n) holds shard 3*m + n.

Text forms, one printer and one parser for both:
    terse  `[[0], [1, 2]] partial = sum[1]`
    MLIR   `mesh.sharding @mesh0 split_axes = [[0], [1, 2]] partial = sum[1] : !mesh.sharding`
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from autoshard.errors import AutoshardError, ShardingError
from autoshard.mesh import Device, Mesh

Slice = tuple[int, int]
"""Half-open [start, stop) range of a tensor dim."""


def shard_size(size: int, n: int) -> int:
    """The length of the largest of n ceil-sized shards of a dim of `size`: ceil(size / n)."""
    return -(-size // n)


def shard_bounds(size: int, n: int, index: int) -> Slice:
    """[start, stop) of shard `index` of a dim of `size` split n ways: shards are
    `shard_size(size, n)` long and clipped to the dim, so the last ones may be smaller or empty
    (5 split 4 ways: [0, 2), [2, 4), [4, 5), [5, 5))."""
    step = shard_size(size, n)
    return min(index * step, size), min((index + 1) * step, size)


class ReductionKind(enum.StrEnum):
    """How partial values combine (`generic` is not allowed in a sharding)."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"
    AVERAGE = "average"
    BITWISE_AND = "bitwise_and"
    BITWISE_OR = "bitwise_or"
    BITWISE_XOR = "bitwise_xor"

    def __repr__(self) -> str:
        return f"ReductionKind.{self.name}"


@dataclass(frozen=True)
class Sharding:
    """A tensor's sharding, canonical at construction (trailing unsplit dims dropped)."""

    split_axes: tuple[tuple[int, ...], ...] = ()
    partial_axes: tuple[int, ...] = ()
    partial_type: ReductionKind = ReductionKind.SUM
    halo_sizes: tuple[int, ...] = ()
    sharded_dims_offsets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        split = [tuple(axes) for axes in self.split_axes]
        while split and not split[-1]:
            split.pop()
        partial = tuple(self.partial_axes)
        kind = ReductionKind(self.partial_type) if partial else ReductionKind.SUM
        object.__setattr__(self, "split_axes", tuple(split))
        object.__setattr__(self, "partial_axes", partial)
        object.__setattr__(self, "partial_type", kind)
        object.__setattr__(self, "halo_sizes", tuple(self.halo_sizes))
        object.__setattr__(self, "sharded_dims_offsets", tuple(self.sharded_dims_offsets))
        self._check_alone()

    # ---- checks that need no mesh -----------------------------------------------------------

    def _check_alone(self) -> None:
        seen: dict[int, int] = {}
        for dim, axes in enumerate(self.split_axes):
            for axis in axes:
                if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
                    raise ShardingError(f"mesh axis {axis!r} in {self} is not an axis number")
                if axis in seen:
                    where = "twice on dim" if seen[axis] == dim else f"on dims {seen[axis]} and"
                    raise ShardingError(f"mesh axis {axis} splits {where} {dim} in {self}")
                seen[axis] = dim
        for axis in self.partial_axes:
            if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
                raise ShardingError(f"partial mesh axis {axis!r} in {self} is not an axis number")
            if axis in seen:
                raise ShardingError(
                    f"mesh axis {axis} is both split (dim {seen[axis]}) and partial in {self}"
                )
        if len(set(self.partial_axes)) != len(self.partial_axes):
            raise ShardingError(f"partial axes repeat in {self}")
        if self.halo_sizes and self.sharded_dims_offsets:
            raise ShardingError(
                f"{self} has both halo_sizes and sharded_dims_offsets; they are mutually exclusive"
            )
        split_dims = len(self.sharded_dims)
        if self.halo_sizes:
            if len(self.halo_sizes) != 2 * split_dims:
                raise ShardingError(
                    f"{self} has {len(self.halo_sizes)} halo sizes; it needs 2 per split dim "
                    f"({2 * split_dims})"
                )
            if any(h < 0 for h in self.halo_sizes):
                raise ShardingError(f"halo sizes in {self} must be >= 0")

    def check(self, mesh: Mesh, shape: Sequence[int] | None = None) -> Sharding:
        """Check against a mesh (axes exist, offsets count) and optionally a tensor shape."""
        for axis in self.mesh_axes:
            if axis >= mesh.ndim:
                raise ShardingError(
                    f"unknown mesh axis {axis} in {self}; mesh @{mesh.name} has axes "
                    f"{mesh.axes_text()}"
                )
        if shape is not None:
            shape = tuple(shape)
            if len(self.split_axes) > len(shape):
                raise ShardingError(
                    f"sharding {self} has {len(self.split_axes)} dims but the tensor "
                    f"{_shape_text(shape)} has rank {len(shape)}"
                )
        if self.sharded_dims_offsets:
            self._offsets_by_dim(mesh, shape)
        return self

    # ---- derived facts ----------------------------------------------------------------------

    @property
    def sharded_dims(self) -> tuple[int, ...]:
        """Tensor dims split over at least one mesh axis, in order."""
        return tuple(d for d, axes in enumerate(self.split_axes) if axes)

    @property
    def mesh_axes(self) -> tuple[int, ...]:
        """Every mesh axis the sharding uses (split or partial)."""
        return tuple(a for axes in self.split_axes for a in axes) + self.partial_axes

    def axes_of(self, dim: int) -> tuple[int, ...]:
        return self.split_axes[dim] if dim < len(self.split_axes) else ()

    def shard_count(self, mesh: Mesh, dim: int) -> int:
        return mesh.group_size(self.axes_of(dim))

    # ---- where each device's data lies ------------------------------------------------------

    def shard_range(self, mesh: Mesh, shape: Sequence[int], dim: int, device: Device) -> Slice:
        """[start, stop) of `device`'s shard on `dim`, halos excluded."""
        size = shape[dim]
        axes = self.axes_of(dim)
        if not axes:
            return (0, size)
        index = mesh.in_group_index(device, axes)
        if self.sharded_dims_offsets:
            offsets = self._offsets_by_dim(mesh, shape)[dim]
            return (offsets[index], offsets[index + 1])
        return shard_bounds(size, mesh.group_size(axes), index)

    def slices(self, mesh: Mesh, shape: Sequence[int], device: Device) -> tuple[Slice, ...]:
        """The part of the global tensor `device` holds, one [start, stop) per dim.

        Halos widen a shard on both sides, clipped to the tensor: a device never holds more
        than the tensor has.
        """
        self.check(mesh, shape)
        bounds = [self.shard_range(mesh, shape, d, device) for d in range(len(shape))]
        for k, dim in enumerate(self.sharded_dims if self.halo_sizes else ()):
            before, after = self.halo_sizes[2 * k], self.halo_sizes[2 * k + 1]
            start, stop = bounds[dim]
            bounds[dim] = (max(0, start - before), min(shape[dim], stop + after))
        return tuple(bounds)

    def local_shape(self, mesh: Mesh, shape: Sequence[int], device: Device) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.slices(mesh, shape, device))

    def _offsets_by_dim(
        self, mesh: Mesh, shape: Sequence[int] | None
    ) -> dict[int, tuple[int, ...]]:
        offsets, by_dim, at = self.sharded_dims_offsets, {}, 0
        for dim in self.sharded_dims:
            count = self.shard_count(mesh, dim) + 1
            part = offsets[at : at + count]
            at += count
            if len(part) < count:
                break
            if part[0] != 0 or any(b < a for a, b in zip(part, part[1:], strict=False)):
                raise ShardingError(
                    f"sharded_dims_offsets {list(part)} of dim {dim} in {self} must start at 0 "
                    "and never decrease"
                )
            if shape is not None and part[-1] != shape[dim]:
                raise ShardingError(
                    f"sharded_dims_offsets {list(part)} of dim {dim} in {self} end at {part[-1]}, "
                    f"not at the dim size {shape[dim]}"
                )
            by_dim[dim] = part
        if at != len(offsets) or len(by_dim) != len(self.sharded_dims):
            need = sum(self.shard_count(mesh, d) + 1 for d in self.sharded_dims)
            raise ShardingError(
                f"{self} has {len(offsets)} sharded_dims_offsets; mesh {mesh} needs {need} "
                "(shard count + 1 per split dim)"
            )
        return by_dim

    # ---- text -------------------------------------------------------------------------------

    def text(self, rank: int | None = None) -> str:
        """The terse notation; `rank` pads with empty dims (`[[0], []]` for a matrix)."""
        split = list(self.split_axes)
        if rank is not None:
            split += [()] * (rank - len(split))
        out = "[" + ", ".join(_int_list(axes) for axes in split or [()]) + "]"
        if self.partial_axes:
            out += f" partial = {self.partial_type}{_int_list(self.partial_axes)}"
        if self.halo_sizes:
            out += f" halo_sizes = {_int_list(self.halo_sizes)}"
        if self.sharded_dims_offsets:
            out += f" sharded_dims_offsets = {_int_list(self.sharded_dims_offsets)}"
        return out

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return f"Sharding.parse({self.text()!r})"

    def to_mlir(self, mesh_name: str = "mesh0") -> str:
        return f"mesh.sharding @{mesh_name} split_axes = {self.text()} : !mesh.sharding"

    @staticmethod
    def parse(text: str) -> Sharding:
        """Parse the terse or the MLIR form (the mesh name of the MLIR form is dropped)."""
        return parse_sharding(text)[1]


def parse_sharding(text: str) -> tuple[str | None, Sharding]:
    """Parse either text form; return (mesh name or None for the terse form, sharding)."""
    return _Parser(text).sharding()


def _int_list(values: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, values)) + "]"


def _shape_text(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


_TOKEN = re.compile(
    r"\s*(mesh\.sharding|!mesh\.sharding|@[A-Za-z_][\w.$-]*|-?\d+|[A-Za-z_]\w*|[\[\],=:?])"
)


class _Parser:
    """Recursive descent over the sharding grammar shared by both forms."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, int]] = []
        at = 0
        while at < len(text):
            match = _TOKEN.match(text, at)
            if not match:
                if text[at:].strip():
                    self.fail(f"unexpected {text[at:].strip()[0]!r}", at)
                break
            self.tokens.append((match.group(1), match.start(1)))
            at = match.end()
        self.at = 0

    def fail(self, why: str, position: int | None = None) -> NoReturn:
        if position is None:
            position = self.tokens[self.at][1] if self.at < len(self.tokens) else len(self.text)
        raise ShardingError(
            f"invalid sharding {self.text.strip()!r}: {why} at column {position + 1}; "
            "write e.g. [[0], [1, 2]] partial = sum[1]"
        )

    def peek(self) -> str | None:
        return self.tokens[self.at][0] if self.at < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            self.fail(f"expected {expected!r}" if expected else "unexpected end")
        self.at += 1
        return token

    def integer(self) -> int:
        token = self.peek()
        if token == "?":
            self.fail("dynamic '?' sizes are not supported")
        if token is None or not token.lstrip("-").isdigit():
            self.fail("expected an integer")
        self.at += 1
        return int(token)

    def separator(self) -> None:
        """After a list item: `,` continues the list, `]` ends it (left for the caller)."""
        if self.peek() == ",":
            self.take()
            if self.peek() == "]":  # a trailing comma: `[[0],]` is not the notation
                self.fail("expected a list item after ','")
        elif self.peek() != "]":
            self.fail("expected ',' or ']'")

    def int_list(self) -> tuple[int, ...]:
        """A list of non-negative integers (mesh axes, sizes, offsets)."""
        self.take("[")
        values: list[int] = []
        while self.peek() != "]":
            if (self.peek() or "").startswith("-"):
                self.fail("expected an integer >= 0")
            values.append(self.integer())
            self.separator()
        self.take("]")
        return tuple(values)

    def sharding(self) -> tuple[str | None, Sharding]:
        mesh_name = None
        if self.peek() == "mesh.sharding":
            self.take()
            token = self.take()
            if not token.startswith("@"):
                self.fail("expected the mesh symbol, like @mesh0")
            mesh_name = token[1:]
            self.take("split_axes")
            self.take("=")
        self.take("[")
        split: list[tuple[int, ...]] = []
        while self.peek() != "]":
            split.append(self.int_list())
            self.separator()
        self.take("]")
        fields: dict[str, object] = {}
        seen: set[str] = set()
        while self.peek() not in (None, ":"):
            key = self.take()
            if key not in ("partial", "halo_sizes", "sharded_dims_offsets") or key in seen:
                self.at -= 1
                self.fail(f"unexpected {key!r}")
            seen.add(key)
            self.take("=")
            if key == "partial":
                kind = self.take()
                try:
                    fields["partial_type"] = ReductionKind(kind)
                except ValueError:
                    self.at -= 1
                    kinds = ", ".join(k.value for k in ReductionKind)
                    self.fail(f"unknown reduction {kind!r} (valid: {kinds})")
                fields["partial_axes"] = self.int_list()
            else:
                fields[key] = self.int_list()
        if self.peek() == ":":
            self.take()
            self.take("!mesh.sharding")
        if self.peek() is not None:
            self.fail(f"unexpected {self.peek()!r}")
        return mesh_name, Sharding(tuple(split), **fields)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ShardingOption:
    """Mesh axes per loop of an op: `[[], [], [0]]` splits loop d2 over axis 0.

    `partial_axes` (with `partial_type`) are for an op linear in its data operands (Add, Sub,
    Sum: `OpRule.partial`): it reads every data operand as partial values over those axes and
    writes its results so (`[[0]] partial = sum[1]`: x_i + y_i summed over axis 1 is x + y), so
    that partial values are added and reduced once, after the op. MLIR's ShardingInterface
    allows it for such ops."""

    loops: tuple[tuple[int, ...], ...]
    partial_axes: tuple[int, ...] = ()
    partial_type: ReductionKind = ReductionKind.SUM

    def __post_init__(self) -> None:
        partial = tuple(self.partial_axes)
        object.__setattr__(self, "partial_axes", partial)
        kind = ReductionKind(self.partial_type) if partial else ReductionKind.SUM
        object.__setattr__(self, "partial_type", kind)
        split = {a for axes in self.loops for a in axes}
        if split & set(partial) or len(set(partial)) != len(partial):
            raise ShardingError(
                f"sharding option {self}: a partial axis repeats or also splits a loop"
            )

    def __str__(self) -> str:
        loops = list(self.loops)
        while loops and not loops[-1]:
            loops.pop()
        text = "[" + ", ".join("[" + ", ".join(map(str, a)) + "]" for a in loops or [()]) + "]"
        if self.partial_axes:
            text += f" partial = {self.partial_type}{_int_list(self.partial_axes)}"
        return text

    @staticmethod
    def parse(text: str, loop_count: int) -> ShardingOption:
        """The option `text` writes (`str`): a sharding's split, but that a loop may repeat an
        earlier loop's axes exactly (ring attention: `rules.base.ring_loops`); then its
        partial axes, if any, as a sharding writes them."""
        loops_text, _, partial_text = text.partition(" partial")
        partial = Sharding.parse("[] partial" + partial_text) if partial_text else Sharding()
        loops = _loops(loops_text, loop_count)
        return ShardingOption(loops, partial.partial_axes, partial.partial_type)


def _loops(text: str, loop_count: int) -> tuple[tuple[int, ...], ...]:
    """The loops of an option's text (`ShardingOption.parse`), padded to `loop_count`."""
    lists = re.findall(r"\[([\d,\s]*)\]", text)
    loops = [tuple(int(a) for a in item.replace(",", " ").split()) for item in lists]
    first = {axes for k, axes in enumerate(loops) if axes and axes not in loops[:k]}
    kept = [() if axes in first and axes in loops[:k] else axes for k, axes in enumerate(loops)]
    if first and kept != loops and re.fullmatch(r"\[(\s*\[[\d,\s]*\]\s*,?)*\]", text):
        Sharding(tuple(kept))  # the axes once each, as any sharding
        split: tuple[tuple[int, ...], ...] = tuple(loops)
    else:
        split = Sharding.parse(text).split_axes
    if len(split) > loop_count:
        raise AutoshardError(
            f"sharding option {text} has {len(split)} loops; the op has {loop_count}"
        )
    return tuple(split) + ((),) * (loop_count - len(split))

"""The MLIR text of a sharded program, printed: one printer, two spellings (one parser,
`autoshard.mlir.parse`, reads both back).

`dialect="mesh"` is the mesh dialect's spelling, `dialect="shard"` upstream LLVM 22's rename of it
(`mesh.mesh` -> `shard.grid`, `mesh_axes` -> `grid_axes`, `reduction = <max>` -> `max`, and no
`partial` in `shard.sharding`, so there partial axes ride in its attribute dict). The MLP of
docs/design/lowering.md on mesh [2] prints, in the mesh spelling, as

    mesh.mesh @mesh0(shape = 2)
    func.func @mlp(%arg0: tensor<2x4x4xf32>, ...) -> tensor<2x4x4xf32> {
      %sharding = mesh.sharding @mesh0 split_axes = [[], [], [0]] : !mesh.sharding
      %sharding_3 = mesh.sharding @mesh0 split_axes = [[]] : !mesh.sharding
      %x = mesh.shard %arg0 to %sharding : tensor<2x4x4xf32> loc("x")
      %2 = mesh.all_gather %x on @mesh0 mesh_axes = [0] gather_axis = 2
        : tensor<2x4x4xf32> -> tensor<2x4x8xf32>
      %x_1 = mesh.shard %2 to %sharding_3 : tensor<2x4x8xf32> loc("x~1"("x"))
      %3 = "onnx.MatMul"(%x_1, %w1) {sharding = "[[], [], [0], []]"}
        : (tensor<2x4x8xf32>, tensor<8x16xf32>) -> tensor<2x4x16xf32> loc("dot1")
      %h = mesh.shard %3 to %sharding : tensor<2x4x16xf32> loc("h")

Collectives act on per-device tensors (docs/design/collectives.md), so every type is LOCAL: a dim
split M ways has size K/M when M divides K, else `?` (shards differ). The global shape stays
recoverable: every tensor is the result of a `mesh.shard` op whose sharding gives the split counts,
and a sharding with a `?` dim carries `sharded_dims_offsets` (upstream's explicit shard bounds),
whose last entry per dim is the global size. Names survive tools that renumber SSA values as
locations: `loc("x~1")` names a tensor (`loc("x~1"("x"))` when its graph value differs) and
`loc("dot1")` an ONNX node; SSA names are only sanitized hints. ONNX ops are generic unregistered
ops `"onnx.Type"` (a non-default domain in `onnx_domain`), their sharding option a string attribute
listing every loop; an absent optional operand is onnx-mlir's `"onnx.NoValue"`, an absent result has
type `none`.

Upstream has no permute; the mesh dialect's `shift` moves a uniform offset along one axis and
`send`/`recv` name one in-group peer for every group, while ours move arbitrary device pairs.
So a permute is spelled like StableHLO's collective_permute, as a generic op of our own
namespace: `"autoshard.permute"(%x) {mesh = @mesh0, mesh_axes = array<i16: 0>,
source_target_pairs = dense<[[0, 1], [1, 0]]> : tensor<2x2xi64>}` (linear device indices).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import numpy as np

from autoshard.collectives import Collective, CollectiveKind
from autoshard.errors import MlirError
from autoshard.mesh import Mesh
from autoshard.mlir.syntax import (
    COLLECTIVES,
    DIALECTS,
    NUMPY,
    PERMUTE_OP,
    RESERVED,
    Dialect,
    TensorType,
    attr_text,
    ceil_offsets,
    dense_text,
    quote,
    symbol,
)
from autoshard.program import Communicate, Compute, Program, Tensor
from autoshard.sharding import Sharding, ShardingOption

__all__ = ["print_program"]

_MESH_OP = {"mesh": "mesh.mesh", "shard": "shard.grid"}
_AXES = {"mesh": "mesh_axes", "shard": "grid_axes"}


def print_program(
    program: Program, dialect: str = Dialect.MESH, constants: Mapping[str, np.ndarray] | None = None
) -> str:
    """The module text of `program`; `constants` override constant values by tensor name."""
    if dialect not in DIALECTS:
        raise MlirError(f"unknown dialect {dialect!r}; choose one of {', '.join(Dialect)}")
    unknown = sorted(set(constants or {}) - set(program.constants))
    if unknown:
        raise MlirError(f"{unknown[0]!r} is not a constant of program {program.name!r}")
    return _Printer(program, dialect, dict(constants or {})).module()


class _Printer:
    def __init__(self, program: Program, dialect: str, constants: dict[str, np.ndarray]) -> None:
        self.p, self.dialect, self.mesh = program, dialect, program.mesh
        self.constants = {**program.constants, **constants}
        self.used: set[str] = set()
        self.ssa: dict[str, str] = {}  # tensor name -> SSA name
        self.count = 0

    def name(self, hint: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_$.\-]", "_", hint) or "v"
        base = "v" + base if base[0].isdigit() else base
        name, k = base, 0
        while name in self.used:
            k += 1
            name = f"{base}_{k}"
        self.used.add(name)
        return "%" + name

    def ref(self, tensor: str) -> str:
        if tensor not in self.ssa:
            raise MlirError(f"program {self.p.name!r} reads tensor {tensor!r} before defining it")
        return self.ssa[tensor]

    def local(self, name: str) -> TensorType:
        t = self.p.tensors[name]
        return TensorType(_local_dims(t.sharding, self.mesh, t.shape), t.dtype)

    def module(self) -> str:
        p, mesh = self.p, self.mesh
        order = [*p.inputs, *p.constants, *(o for s in p.steps for o in s.outputs if o)]
        texts = dict.fromkeys(self.sharding_text(p.tensors[n]) for n in order)
        shardings = {text: self.name("sharding") for text in texts}
        args = [self.name(f"arg{i}") for i in range(len(p.inputs))]
        body = [f"{ssa} = {text}" for text, ssa in shardings.items()]
        self.none = self.name("none") if any("" in s.inputs for s in p.steps) else None
        for arg, name in zip(args, p.inputs, strict=True):
            body.append(self.shard(arg, name, shardings))
        if self.none:
            body.append(f'{self.none} = "onnx.NoValue"() {{value}} : () -> none')
        for name in p.constants:
            body += self.constant(name, shardings)
        for step in p.steps:
            if isinstance(step, Compute):
                body += self.compute(step, shardings)
            else:
                body += self.communicate(step, shardings)
        outs = [self.local(n) for n in p.outputs]
        if outs:
            refs = ", ".join(self.ref(n) for n in p.outputs)
            body.append(f"return {refs} : {', '.join(map(str, outs))}")
        else:
            body.append("return")
        signature = ", ".join(f"{a}: {self.local(n)}" for a, n in zip(args, p.inputs, strict=True))
        results = ", ".join(map(str, outs))
        results = results if len(outs) == 1 else f"({results})"
        names = f" {{axis_names = {attr_text(mesh.axis_names)}}}" if mesh.axis_names else ""
        shape = "x".join(map(str, mesh.shape))
        return "\n".join(
            [
                f"module {{\n  {_MESH_OP[self.dialect]} @{mesh.name}(shape = {shape}){names}",
                f"  func.func {symbol(p.name)}({signature}) -> {results} {{",
                *(f"    {line}" for line in body),
                "  }\n}\n",
            ]
        )

    def sharding_text(self, t: Tensor) -> str:
        d, sharding = self.dialect, _with_offsets(t.sharding, self.mesh, t.shape)
        if d == "mesh" or not sharding.partial_axes:
            return f"{d}.sharding @{self.mesh.name} split_axes = {sharding} : !{d}.sharding"
        split = dataclasses.replace(sharding, partial_axes=())
        partial = f'{{partial = "{sharding.partial_type}{list(sharding.partial_axes)}"}}'
        return f"{d}.sharding @{self.mesh.name} split_axes = {split} {partial} : !{d}.sharding"

    def shard(self, source: str, tensor: str, shardings: dict[str, str]) -> str:
        t = self.p.tensors[tensor]
        self.ssa[tensor] = ssa = self.name(tensor)
        sharding = shardings[self.sharding_text(t)]
        loc = quote(tensor) + (f"({quote(t.value)})" if t.value != tensor else "")
        return (
            f"{ssa} = {self.dialect}.shard {source} to {sharding} : {self.local(tensor)} loc({loc})"
        )

    def result(self, count: int) -> list[str]:
        self.count += 1
        return [f"%{self.count}"] if count == 1 else [f"%{self.count}#{i}" for i in range(count)]

    def constant(self, name: str, shardings: dict[str, str]) -> list[str]:
        t, value = self.p.tensors[name], np.asarray(self.constants[name])
        if t.sharding.split_axes or t.sharding.partial_axes:
            raise MlirError(f"constant {name!r} is held as {t.sharding}; constants are replicated")
        if value.shape != t.shape or NUMPY.get(value.dtype) != t.dtype:
            raise MlirError(
                f"constant {name!r} is {t.dtype}{list(t.shape)} in the program but the value "
                f"given is {value.dtype}{list(value.shape)}"
            )
        (ref,) = self.result(1)
        typ = self.local(name)
        line = f'{ref} = "onnx.Constant"() {{value = {dense_text(value)}}} : () -> {typ}'
        return [line, self.shard(ref, name, shardings)]

    def compute(self, step: Compute, shardings: dict[str, str]) -> list[str]:
        operands = [self.ref(n) if n else str(self.none) for n in step.inputs]
        types = [str(self.local(n)) if n else "none" for n in step.inputs]
        outs = [str(self.local(n)) if n else "none" for n in step.outputs]
        refs = self.result(len(step.outputs))
        head = f"%{self.count}" + (f":{len(refs)}" if len(refs) > 1 else "")
        op, attrs = step.op, dict(step.op.attrs)
        clash = [k for k in RESERVED if k in attrs]
        if clash:
            raise MlirError(f"op {op.name!r} has an ONNX attribute named {clash[0]!r}")
        if step.option is not None:
            attrs["sharding"] = _loops_text(step.option.loops) + _partial_text(step.option)
        if op.domain:
            attrs["onnx_domain"] = op.domain
        inner = ", ".join(f"{k} = {attr_text(v, typed=True)}" for k, v in sorted(attrs.items()))
        dict_text = f" {{{inner}}}" if inner else ""
        result = outs[0] if len(outs) == 1 else f"({', '.join(outs)})"
        lines = [
            f'{head + " = " if outs else ""}"onnx.{op.type}"({", ".join(operands)}){dict_text}'
            f" : ({', '.join(types)}) -> {result} loc({quote(op.name)})"
        ]
        for ref, name in zip(refs, step.outputs, strict=True):
            if name:
                lines.append(self.shard(ref, name, shardings))
        return lines

    def communicate(self, step: Communicate, shardings: dict[str, str]) -> list[str]:
        """The collective, between `tensor.cast`s where its shards are uneven: upstream types
        a collective's moved axes only as exact multiples (a gather multiplies by the group
        size) or as `?` on both sides, so uneven shards are cast to `?` and back."""
        c, source, lines = step.collective, self.ref(step.source), []
        src, dst = self.local(step.source), self.local(step.target)
        n = self.mesh.group_size(c.mesh_axes)
        # all_gather grows its dim; the other kinds cut theirs, and all_to_all grows `to_dim`
        gathers = c.kind is CollectiveKind.ALL_GATHER
        grow = [a for a in (c.dim if gathers else c.to_dim,) if a is not None]
        shrink = [a for a in (c.dim,) if a is not None and not gathers]

        def exact(axis: int, big: TensorType, small: TensorType) -> bool:
            b, s = big.shape[axis], small.shape[axis]
            return b is not None and s is not None and s * n == b

        even = all(exact(a, dst, src) for a in grow) and all(exact(a, src, dst) for a in shrink)
        src_as, dst_as = src, dst
        if not even:
            src_as, dst_as = (_dynamic(t, grow + shrink) for t in (src, dst))
        if src_as != src:
            (cast,) = self.result(1)
            lines.append(f"{cast} = tensor.cast {source} : {src} to {src_as}")
            source = cast
        (ref,) = self.result(1)
        lines.append(f"{ref} = {self.collective(c, source, str(src_as), str(dst_as))}")
        if dst_as != dst:
            (cast,) = self.result(1)
            lines.append(f"{cast} = tensor.cast {ref} : {dst_as} to {dst}")
            ref = cast
        return [*lines, self.shard(ref, step.target, shardings)]

    def collective(self, c: Collective, source: str, src: str, dst: str) -> str:
        d, axes = self.dialect, _AXES[self.dialect]
        if c.kind is CollectiveKind.PERMUTE:
            pairs = np.array(c.pairs, np.int64).reshape(len(c.pairs), 2)
            mesh = "mesh" if d == "mesh" else "grid"
            attrs = f"{mesh} = @{self.mesh.name}, {axes} = array<i16{_ints(c.mesh_axes, ': ')}>"
            attrs += f", source_target_pairs = {dense_text(pairs)}"
            return f'"{PERMUTE_OP}"({source}) {{{attrs}}} : ({src}) -> {dst}'
        fields = f" {axes} = {list(c.mesh_axes)}"
        for name in COLLECTIVES[c.kind]:
            value: object = c.axis_attrs.get(name)
            if name == "reduction":
                value = f"<{c.reduction}>" if d == "mesh" else c.reduction
            fields += f" {name} = {value}"
        return f"{d}.{c.kind} {source} on @{self.mesh.name}{fields} : {src} -> {dst}"


def _dynamic(t: TensorType, axes: list[int]) -> TensorType:
    return TensorType(tuple(None if a in axes else d for a, d in enumerate(t.shape)), t.dtype)


def _ints(values: tuple[int, ...], lead: str = "") -> str:
    return lead + ", ".join(map(str, values)) if values else ""


def _loops_text(loops: tuple[tuple[int, ...], ...]) -> str:
    return "[" + ", ".join(f"[{_ints(a)}]" for a in loops) + "]"


def _partial_text(option: ShardingOption) -> str:
    """An option's partial axes as a sharding writes them (` partial = sum[1]`), if any."""
    if not option.partial_axes:
        return ""
    return f" partial = {option.partial_type}[{_ints(option.partial_axes)}]"


def _local_dims(sharding: Sharding, mesh: Mesh, shape: tuple[int, ...]) -> tuple[int | None, ...]:
    if sharding.halo_sizes:
        raise MlirError(f"sharding {sharding} has halos; the printer does not express them")
    if sharding.sharded_dims_offsets:
        per_device = [sharding.local_shape(mesh, shape, d) for d in mesh.devices()]
        sizes = [set(dim) for dim in zip(*per_device, strict=True)]
        return tuple(s.pop() if len(s) == 1 else None for s in sizes)
    counts = [sharding.shard_count(mesh, d) for d in range(len(shape))]
    return tuple(k // m if k % m == 0 else None for k, m in zip(shape, counts, strict=True))


def _with_offsets(sharding: Sharding, mesh: Mesh, shape: tuple[int, ...]) -> Sharding:
    if sharding.sharded_dims_offsets or None not in _local_dims(sharding, mesh, shape):
        return sharding
    offsets = ceil_offsets(sharding, mesh, shape)
    return dataclasses.replace(sharding, sharded_dims_offsets=offsets)

"""The MLIR text of a sharded program, read back: `parse_module` reads a module (or a fragment of
ops like docs/design/collectives.md's examples) in either spelling, and `Module.to_program` rebuilds
the Program that a module printed by `autoshard.mlir.print` holds, so the parser is the printer's
round-trip oracle. The notation is described in `autoshard.mlir.print`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from autoshard.collectives import AXIS_NAMES, Collective, CollectiveKind, ring_bytes
from autoshard.errors import AutoshardError, CollectiveError, MlirError
from autoshard.ir import dtypes
from autoshard.ir.graph import Attrs, Op
from autoshard.mesh import Mesh
from autoshard.mlir.syntax import (
    COLLECTIVES,
    DIALECTS,
    PERMUTE_OP,
    RESERVED,
    Cursor,
    MlirOp,
    TensorType,
    attr_dict,
    ceil_offsets,
    custom_op,
    generic_op,
    loc,
    op_results,
    refs,
    signature,
    statements,
    trailing_types,
    unquote,
)
from autoshard.program import Communicate, Compute, Program, Step, Tensor
from autoshard.sharding import ReductionKind, Sharding, ShardingOption, parse_sharding, shard_size

__all__ = ["MlirError", "MlirOp", "Module", "parse_module"]


@dataclass(frozen=True)
class Module:
    """A parsed module: its mesh, its function and the ops in order (region bodies skipped)."""

    mesh: Mesh | None
    func: str | None
    args: tuple[tuple[str, TensorType | str], ...]
    ops: tuple[MlirOp, ...]
    returns: tuple[str, ...]

    @cached_property
    def _producers(self) -> dict[str, MlirOp]:
        return {r: op for op in self.ops for r in op.results}

    def defining(self, ssa: str) -> MlirOp | None:
        return self._producers.get(ssa)

    def users(self, ssa: str) -> list[MlirOp]:
        return [op for op in self.ops if ssa in op.operands]

    def sharding(self, ssa: str) -> Sharding:
        """The sharding a `mesh.shard` result (or a `mesh.sharding` result) stands for."""
        op = self.defining(ssa)
        if op is not None and op.kind == "shard":
            op = self.defining(op.operands[1])
        if op is None or op.kind != "sharding":
            raise MlirError(f"{ssa} is not a sharding nor the result of a shard op")
        return op.attrs["sharding"]

    def to_program(self) -> Program:
        """The program a module printed by `print_program` holds."""
        return _Rebuild(self).program()


# ---- parsing --------------------------------------------------------------------------------


def parse_module(text: str) -> Module:
    """Read MLIR text: a whole module, or a fragment of ops without the module around them."""
    mesh: Mesh | None = None
    func: str | None = None
    args: tuple[tuple[str, TensorType | str], ...] = ()
    ops: list[MlirOp] = []
    returns: tuple[str, ...] = ()
    defined: set[str] = set()
    for statement in statements(text):
        c = Cursor(statement)
        head = c.peek()
        if head in ("module", "}") or head.startswith("^"):
            continue
        if head in ("mesh.mesh", "shard.grid"):
            mesh = _mesh(statement, c)
        elif head == "func.func":
            func, args = signature(c)
        elif head in ("return", "func.return"):
            c.take()
            returns = tuple(refs(c))
        else:
            ops.append(_op(c, defined))
            defined.update(ops[-1].results)
        defined.update(ssa for ssa, _ in args)
    return Module(mesh, func, args, tuple(ops), returns)


def _mesh(statement: str, c: Cursor) -> Mesh:
    match = re.match(r"\s*\S+\s+@([\w$.]+)\s*\(\s*shape\s*=\s*([\dx?]+)\s*\)\s*(.*)$", statement)
    if match is None:
        c.fail("expected `mesh.mesh @name(shape = 2x2)`")
    if "?" in match.group(2):
        c.fail("a dynamic mesh axis '?' cannot be planned")
    names: tuple[str, ...] = ()
    if match.group(3).startswith("{"):
        names = attr_dict(Cursor(match.group(3))).get("axis_names", ())
    return Mesh(tuple(int(s) for s in match.group(2).split("x")), names, match.group(1))


def _op(c: Cursor, defined: set[str]) -> MlirOp:
    results = op_results(c)
    name = c.take()
    if name.startswith('"'):
        op = generic_op(c, unquote(name), results)
        if op.name == PERMUTE_OP:
            return dataclasses.replace(op, attrs={_field(k): v for k, v in op.attrs.items()})
        return op
    dialect, _, kind = name.partition(".")
    if dialect in DIALECTS and kind == "sharding":
        return _sharding_op(c, name, results)
    if dialect in DIALECTS and (kind == "shard" or c.peek(1) == "on"):
        operand = c.take()
        attrs: dict[str, Any] = {}
        if kind == "shard":
            c.take("to")
            operands: tuple[str, ...] = (operand, c.take())
            attrs["annotate_for_users"] = c.accept("annotate_for_users")
        else:
            operands = (operand,)
            c.take("on")
            attrs["mesh"] = c.take()[1:]
            while c.peek() not in ("", ":", "{"):
                key = c.take()
                attrs[_field(key)] = _field_value(c) if c.accept("=") else True
        attrs.update(attr_dict(c) if c.peek() == "{" else {})
        types = trailing_types(c)
        return MlirOp(name, results, operands, attrs, types, loc(c))
    return custom_op(c, name, results, defined)


def _field(key: str) -> str:
    return {"grid_axes": "mesh_axes", "grid": "mesh"}.get(key, key)


def _field_value(c: Cursor) -> Any:
    if c.peek() == "[":
        c.take()
        values = []
        while not c.accept("]"):
            values.append(int(c.take()))
            c.accept(",")
        return tuple(values)
    if c.accept("<"):
        value = c.take()
        c.take(">")
        return value
    token = c.take()
    return int(token) if re.fullmatch(r"[-+]?\d+", token) else token


def _sharding_op(c: Cursor, name: str, results: tuple[str, ...]) -> MlirOp:
    start = c.at
    mesh = c.take()[1:]
    c.take("split_axes")
    c.take("=")
    body: list[str] = []
    while c.peek() not in ("", ":", "{"):
        body.append(c.take())
    extra = attr_dict(c) if c.peek() == "{" else {}
    if "partial" in extra:
        body += ["partial", "=", extra["partial"]]
    try:
        sharding = parse_sharding(" ".join(body))[1]
    except AutoshardError as error:
        raise MlirError(f"{' '.join(c.tokens[start - 1 : c.at])}: {error}") from None
    if c.peek() == ":":  # a fragment may leave the type out
        trailing_types(c)
    return MlirOp(name, results, (), {"mesh": mesh, "sharding": sharding}, (), loc(c))


# ---- back to a program ----------------------------------------------------------------------


class _Rebuild:
    """A module printed by `print_program` -> the Program: shard ops name the tensors."""

    def __init__(self, module: Module) -> None:
        if module.mesh is None or module.func is None:
            raise MlirError("the module has no mesh or no function; it is not a program")
        self.m, self.mesh = module, module.mesh
        self.tensors: dict[str, Tensor] = {}
        self.names: dict[str, str] = {}  # SSA value (raw or annotated) -> tensor name
        self.none = {r for op in module.ops if op.name == "onnx.NoValue" for r in op.results}
        for op in module.ops:
            if op.kind == "shard" and op.name.split(".")[0] in DIALECTS:
                self.tensor(op)
        for op in module.ops:  # casts around uneven collectives view the same tensor
            if op.name == "tensor.cast":
                (result,), (operand,) = op.results, op.operands
                if result in self.names:
                    self.names[operand] = self.names[result]
                elif operand in self.names:
                    self.names[result] = self.names[operand]

    def tensor(self, op: MlirOp) -> None:
        typ = op.result_types[0]
        sharding = self.m.sharding(op.operands[1])
        if not isinstance(typ, TensorType):
            raise MlirError(f"{op.results[0]} is a {typ}, not a tensor")
        shape = _global_shape(sharding, self.mesh, typ.shape, op.results[0])
        if sharding.sharded_dims_offsets == ceil_offsets(sharding, self.mesh, shape):
            sharding = dataclasses.replace(sharding, sharded_dims_offsets=())
        name = op.loc[0] if op.loc else op.results[0][1:]
        value = op.loc[1] if len(op.loc) > 1 else name
        self.tensors[name] = Tensor(name, value, shape, typ.dtype, sharding)
        self.names[op.results[0]] = self.names[op.operands[0]] = name

    def name(self, ssa: str) -> str:
        if ssa not in self.names:
            raise MlirError(f"{ssa} is not named by a shard op; the module is not a program")
        return self.names[ssa]

    def program(self) -> Program:
        m, steps, constants = self.m, list[Step](), {}
        for op in m.ops:
            if op.name == "onnx.Constant":
                constants[self.name(op.results[0])] = np.asarray(op.attrs["value"])
            elif op.name.startswith("onnx.") and op.name != "onnx.NoValue":
                steps.append(self.compute(op))
            elif op.name == PERMUTE_OP or (
                op.kind in map(str, CollectiveKind) and "mesh" in op.attrs
            ):
                steps.append(self.communicate(op))
        inputs = tuple(self.name(ssa) for ssa, _ in m.args)
        unruled = tuple(s.op.name for s in steps if isinstance(s, Compute) and s.option is None)
        outputs = tuple(self.name(r) for r in m.returns)
        return Program(
            m.func or "", self.mesh, self.tensors, inputs, outputs, tuple(steps), constants, unruled
        )

    def compute(self, op: MlirOp) -> Compute:
        attrs = {k: v for k, v in op.attrs.items() if k not in RESERVED}
        inputs = tuple("" if r in self.none else self.name(r) for r in op.operands)
        outputs = tuple(
            "" if t == "none" else self.name(r)
            for r, t in zip(op.results, op.result_types, strict=True)
        )
        name = op.loc[0] if op.loc else (op.results or ("",))[0][1:]
        node = Op(name, op.kind, op.attrs.get("onnx_domain", ""), inputs, outputs, Attrs(attrs))
        option = None
        if "sharding" in op.attrs:
            text = op.attrs["sharding"]
            loops = text.partition(" partial")[0]  # its loops, then its partial axes
            option = ShardingOption.parse(text, len(re.findall(r"\[[^\[\]]*\]", loops)))
        return Compute(node, option)

    def communicate(self, op: MlirOp) -> Communicate:
        source, target = self.name(op.operands[0]), self.name(op.results[0])
        src, dst = self.tensors[source], self.tensors[target]
        kind = CollectiveKind.PERMUTE if op.name == PERMUTE_OP else CollectiveKind(op.kind)
        fields: dict[str, Any] = {}
        for name in COLLECTIVES[kind]:
            value = op.attrs.get(name, "sum" if name == "reduction" else None)
            if name == "reduction":
                fields[name] = ReductionKind(value)
            elif name == "source_target_pairs":
                fields["pairs"] = tuple(tuple(int(x) for x in p) for p in np.asarray(value))
            else:  # a tensor dim; all_to_all's second (concat_axis) is `to_dim`
                fields[("dim", "to_dim")[AXIS_NAMES[kind].index(name)]] = value
        axes = tuple(op.attrs.get("mesh_axes", ()))
        local = dtypes.nbytes(src.dtype, 1)  # the largest local shard, as reshard counts it
        for dim, size in enumerate(src.shape):
            local *= shard_size(size, src.sharding.shard_count(self.mesh, dim))
        if kind is CollectiveKind.PERMUTE:
            sources = [s for s, _ in fields["pairs"]]
            sent = max((sources.count(s) for s in sources), default=0) * local
        else:
            sent = ring_bytes(kind, self.mesh.group_size(axes), local)
        try:
            collective = Collective(
                kind, axes, src.sharding, dst.sharding, src.shape, sent, **fields
            )
        except CollectiveError as error:
            raise MlirError(f"{op.name} {op.operands[0]}: {error}") from None
        return Communicate(source, target, collective)


def _global_shape(
    sharding: Sharding, mesh: Mesh, local: tuple[int | None, ...], where: str
) -> tuple[int, ...]:
    offsets, at, shape = sharding.sharded_dims_offsets, 0, []
    for dim, size in enumerate(local):
        count = sharding.shard_count(mesh, dim)
        if sharding.axes_of(dim) and offsets:
            at += count + 1
            shape.append(offsets[at - 1])
        elif size is None:
            raise MlirError(
                f"dim {dim} of {where} is dynamic and its sharding {sharding} has no offsets"
            )
        else:
            shape.append(size * count)
    return tuple(shape)

"""MLIR's textual syntax, as much as autoshard's notation uses: builtin types and attributes,
tokens, statements, locations. `autoshard.mlir.print` and `autoshard.mlir.parse` build the
mesh/shard notation on it; the few words of it they share (dialects, collective fields) are here.

Attributes map to python values both ways: `3 : i64` <-> 3, `1.5 : f32` <-> 1.5 (f32 values
exact: printed shortest, read back through float32), `"a/b"` <-> "a/b", `[1, 2]` <-> (1, 2),
`dense<[[1, 2]]> : tensor<1x2xi64>` <-> a numpy array (`dense<"0x...">` hex as mlir-opt prints
large ones, i1 bit-packed), `@mesh0` <-> SymbolRef("mesh0"). Floats that are not finite are
printed in hex (`0x7FC00000`), as MLIR requires.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from autoshard.collectives import CollectiveKind
from autoshard.errors import MlirError
from autoshard.ir import dtypes
from autoshard.mesh import Mesh
from autoshard.sharding import Sharding, shard_bounds

ELEMENT = {
    **{f"float{b}": f"f{b}" for b in (16, 32, 64)},
    **{f"int{b}": f"i{b}" for b in (2, 4, 8, 16, 32, 64)},
    **{f"uint{b}": f"ui{b}" for b in (2, 4, 8, 16, 32, 64)},
    "bfloat16": "bf16",
    "bool": "i1",
    "float8_e4m3fn": "f8E4M3FN",
    "float8_e4m3fnuz": "f8E4M3FNUZ",
    "float8_e5m2": "f8E5M2",
    "float8_e5m2fnuz": "f8E5M2FNUZ",
    "float8_e8m0fnu": "f8E8M0FNU",
    "float4_e2m1fn": "f4E2M1FN",
    "float6_e2m3fn": "f6E2M3FN",
    "float6_e3m2fn": "f6E3M2FN",
    "complex64": "complex<f32>",
    "complex128": "complex<f64>",
    "string": "!onnx.String",
}
DTYPE = {v: k for k, v in ELEMENT.items()}


def _numpy_dtypes() -> dict[np.dtype, str]:
    found = {}
    for name in ("float32", "float64", "float16", "bfloat16", "bool", "int8", "uint8"):
        found[dtypes.numpy_dtype(name)] = name
    for bits in (16, 32, 64):
        found[np.dtype(f"int{bits}")], found[np.dtype(f"uint{bits}")] = f"int{bits}", f"uint{bits}"
    return found


NUMPY = _numpy_dtypes()


@dataclass(frozen=True)
class TensorType:
    """`tensor<2x?x8xf32>`: shape with None for `?`, and the IR dtype name."""

    shape: tuple[int | None, ...]
    dtype: str

    def __str__(self) -> str:
        dims = "".join(f"{'?' if d is None else d}x" for d in self.shape)
        return f"tensor<{dims}{ELEMENT[self.dtype]}>"


@dataclass(frozen=True)
class SymbolRef:
    name: str


@dataclass(frozen=True)
class MlirOp:
    """One operation. `attrs` hold python values (`autoshard.mlir.parse` puts the fields of the
    mesh/shard ops' custom syntax there too); ops in a custom syntax of another dialect (linalg,
    tosa) keep only their name, results and operands. `loc` holds the names of a name location:
    `loc("x~1"("x"))` -> ("x~1", "x")."""

    name: str
    results: tuple[str, ...] = ()
    operands: tuple[str, ...] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)
    result_types: tuple[TensorType | str, ...] = ()
    loc: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return self.name.split(".", 1)[-1]


# ---- the words of the mesh/shard notation, shared by the printer and the parser --------------


class Dialect(enum.StrEnum):
    """The spelling of the mesh ops: the `mesh` dialect, or upstream LLVM 22's rename `shard`."""

    MESH = "mesh"
    SHARD = "shard"


DIALECTS = frozenset(Dialect)  # a StrEnum member is equal to its spelling: "mesh" in DIALECTS

# Collective kind -> its attribute fields after `mesh_axes`, in the dialect's order.
COLLECTIVES: dict[CollectiveKind, tuple[str, ...]] = {
    CollectiveKind.ALL_GATHER: ("gather_axis",),
    CollectiveKind.ALL_SLICE: ("slice_axis",),
    CollectiveKind.ALL_TO_ALL: ("split_axis", "concat_axis"),
    CollectiveKind.ALL_REDUCE: ("reduction",),
    CollectiveKind.REDUCE_SCATTER: ("reduction", "scatter_axis"),
    CollectiveKind.PERMUTE: ("source_target_pairs",),
}
PERMUTE_OP = "autoshard.permute"
RESERVED = ("sharding", "onnx_domain")  # op attributes that are not ONNX attributes


def ceil_offsets(sharding: Sharding, mesh: Mesh, shape: tuple[int, ...]) -> tuple[int, ...]:
    """`sharded_dims_offsets` of the ceil-sized shards: 5 split 2 ways -> [0, 3, 5]."""
    out: list[int] = []
    for dim in sharding.sharded_dims:
        size, count = shape[dim], sharding.shard_count(mesh, dim)
        out += [shard_bounds(size, count, s)[0] for s in range(count)] + [size]
    return tuple(out)


# ---- printing --------------------------------------------------------------------------------


def quote(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\' or not 32 <= ord(ch) < 127:
            out += [f"\\{b:02X}" for b in ch.encode()]
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def symbol(name: str) -> str:
    return "@" + (name if re.fullmatch(r"[A-Za-z_][\w$.]*", name, re.A) else quote(name))


def float_text(value: Any, dtype: str = "float32") -> str:
    x = np.float64(value) if dtype == "float64" else np.float32(value)
    if not np.isfinite(x):
        bits = x.view(np.uint64 if dtype == "float64" else np.uint32)
        return f"0x{int(bits):0{2 * x.itemsize}X}"
    text = str(x)
    mantissa, e, exponent = text.partition("e")
    return (mantissa if "." in mantissa else mantissa + ".0") + (e + exponent if e else "")


def attr_text(value: Any, typed: bool = False) -> str:
    """An ONNX attribute value as MLIR attribute text (`3 : i64`, `[1, 2]`, `dense<...>`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | np.integer):
        return f"{value} : i64" if typed else str(value)
    if isinstance(value, float | np.floating):
        return f"{float_text(value)} : f32"
    if isinstance(value, str):
        return quote(value)
    if isinstance(value, np.ndarray):
        return dense_text(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(attr_text(v) for v in value) + "]"
    raise MlirError(f"attribute value {value!r} has no MLIR spelling")


def dense_text(array: np.ndarray) -> str:
    dtype = NUMPY.get(array.dtype)
    if dtype is None:
        raise MlirError(f"tensor of numpy dtype {array.dtype} has no MLIR spelling")
    typ = TensorType(array.shape, dtype)
    if array.size == 0:
        return f"dense<> : {typ}"
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.tobytes() == np.repeat(flat[:1], flat.size).tobytes():
        return f"dense<{_element(flat[0], dtype)}> : {typ}"
    if array.size > 100 and dtype != "bool":  # as mlir-opt prints large elements: hex bytes
        return f'dense<"0x{flat.tobytes().hex().upper()}"> : {typ}'

    def nested(a: np.ndarray) -> str:
        if a.ndim == 0:
            return _element(a[()], dtype)
        return "[" + ", ".join(nested(x) for x in a) + "]"

    return f"dense<{nested(array)}> : {typ}"


def _element(value: Any, dtype: str) -> str:
    if dtype == "bool":
        return "true" if value else "false"
    if dtype.startswith(("float", "bfloat")):
        return float_text(value, "float64" if dtype == "float64" else "float32")
    return str(int(value))


# ---- reading --------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s*(
      "(?:[^"\\]|\\.)*" | @"(?:[^"\\]|\\.)*"
    | (?:tensor|vector|memref)<(?:[^<>]|<[^<>]*>)*>
    | [-+]?0x[0-9A-Fa-f]+ | [-+]?\d+\.\d*(?:[eE][-+]?\d+)? | [-+]?\d+
    | [%@^\#!][\w$.\-]+(?:\#\d+)? | [A-Za-z_][\w$.]* | -> | [\[\](){}<>,:=?*+]
    )""",
    re.X | re.A,
)
_STRING = r'"(?:[^"\\]|\\.)*"'
_COMMENT = re.compile(rf"({_STRING})|//.*$")  # a `//` comment, not inside a string
_STATEMENT = re.compile(r"\s*(%|\"|\^|\}|[A-Za-z_][\w$]*\.[\w.$]+|return\b|module\b)", re.A)


def statements(text: str) -> Iterator[str]:
    """Ops one by one: continuation lines joined, regions of ops (not of func/module) dropped."""
    current: list[str] = []
    depth = 0
    for line in text.splitlines():
        line = _COMMENT.sub(lambda m: m.group(1) or "", line)
        if not line.strip() or line.strip() == "...":
            continue
        balance = sum({"{": 1, "}": -1}.get(ch, 0) for ch in re.sub(_STRING, "", line))
        if depth > 0:  # inside an op's region: keep only what follows its closing brace
            depth += balance
            if depth <= 0:
                current.append(line.strip().lstrip("}"))
                depth = 0
            continue
        if _STATEMENT.match(line):
            if current:
                yield " ".join(current)
            current = [line.strip()]
        else:
            current.append(line.strip())
        opener = current[0].split(" ", 1)[0] in ("module", "func.func")
        if balance > 0 and not opener:
            depth = balance
    if current:
        yield " ".join(current)


class Cursor:
    """The tokens of one statement, read front to back; errors quote the statement."""

    def __init__(self, text: str) -> None:
        self.text, self.tokens, self.at = text, [], 0
        position = 0
        while position < len(text) and text[position:].strip():
            match = _TOKEN.match(text, position)
            if match is None:
                self.fail(f"unexpected {text[position:].strip()[:12]!r}")
            self.tokens.append(match.group(1))
            position = match.end()

    def fail(self, why: str) -> NoReturn:
        raise MlirError(f"cannot read MLIR {self.text.strip()[:100]!r}: {why}")

    def peek(self, ahead: int = 0) -> str:
        at = self.at + ahead
        return self.tokens[at] if at < len(self.tokens) else ""

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if not token or (expected is not None and token != expected):
            self.fail(f"expected {expected or 'more'}, found {token or 'the end'!r}")
        self.at += 1
        return token

    def accept(self, token: str) -> bool:
        if self.peek() == token:
            self.at += 1
            return True
        return False


def trailing_types(c: Cursor) -> tuple[TensorType | str, ...]:
    """`: type`, `: type -> type` or `: (types) -> types`; the result types."""
    c.take(":")
    if c.accept("("):
        while not c.accept(")"):
            c.take()
    else:
        first = type_of(c.take())
        if c.peek() != "->":
            return (first,)
    c.take("->")
    return types_of(c)


def types_of(c: Cursor) -> tuple[TensorType | str, ...]:
    if not c.accept("("):
        return (type_of(c.take()),)
    types = []
    while not c.accept(")"):
        types.append(type_of(c.take()))
        c.accept(",")
    return tuple(types)


def type_of(token: str) -> TensorType | str:
    match = re.fullmatch(r"tensor<((?:(?:\d+|\?)x)*)([^,>]+)(?:,.*)?>", token)
    if match is None:
        return token
    dims = tuple(None if d == "?" else int(d) for d in match.group(1).split("x")[:-1])
    element = match.group(2)
    if element not in DTYPE:
        raise MlirError(f"element type {element!r} of {token} has no ONNX dtype")
    return TensorType(dims, DTYPE[element])


def loc(c: Cursor) -> tuple[str, ...]:
    """A name location `loc("x")` or `loc("x"("y"))` -> ("x", "y"); other locations -> ()."""
    if not c.accept("loc"):
        return ()
    start, depth = c.at, 0
    while True:
        token = c.take()
        depth += {"(": 1, ")": -1}.get(token, 0)
        if depth == 0:
            break
    inner = c.tokens[start + 1 : c.at - 1]
    if any(t.startswith("#") for t in inner):
        c.fail("location aliases are not supported; print with --mlir-print-local-scope")
    names = [t for t in inner if t.startswith('"')]
    if not names or ":" in inner or inner[0] in ("fused", "callsite"):
        return ()
    return tuple(unquote(n) for n in names)


def signature(c: Cursor) -> tuple[str, tuple[tuple[str, TensorType | str], ...]]:
    """`func.func @f(%arg0: tensor<...> loc(...), ...)` -> ("f", (("%arg0", type), ...))."""
    c.take("func.func")
    name = unquote(c.take()[1:])
    args = []
    c.take("(")
    while not c.accept(")"):
        ssa = c.take()
        c.take(":")
        args.append((ssa, type_of(c.take())))
        if c.peek() == "{":
            attr_dict(c)
        loc(c)
        c.accept(",")
    return name, tuple(args)


def refs(c: Cursor) -> list[str]:
    """`%a, %b` -> ["%a", "%b"]."""
    found = []
    while c.peek().startswith("%"):
        found.append(c.take())
        c.accept(",")
    return found


def op_results(c: Cursor) -> tuple[str, ...]:
    """`%a, %b:2 =` -> ("%a", "%b#0", "%b#1"); nothing when the op has no results."""
    results: list[str] = []
    if c.peek().startswith("%"):
        while not c.accept("="):
            ref = c.take()
            count = int(c.take()) if c.accept(":") else 1
            results += [ref] if count == 1 else [f"{ref}#{i}" for i in range(count)]
            c.accept(",")
    return tuple(results)


def custom_op(c: Cursor, name: str, results: tuple[str, ...], defined: set[str]) -> MlirOp:
    """An op in another dialect's custom syntax: its operands are the values defined before it
    (block arguments of its regions, like linalg's `(%in: f32, %out: f32)`, are not)."""
    refs = dict.fromkeys(t for t in c.tokens[c.at :] if t in defined)
    return MlirOp(name, results, tuple(refs))


def generic_op(c: Cursor, name: str, results: tuple[str, ...]) -> MlirOp:
    c.take("(")
    operands = tuple(refs(c))
    c.take(")")
    attrs: dict[str, Any] = {}
    if c.accept("<"):
        attrs.update(attr_dict(c))
        c.take(">")
    if c.peek() == "{":
        attrs.update(attr_dict(c))
    c.take(":")
    c.take("(")
    while not c.accept(")"):
        c.take()
    c.take("->")
    return MlirOp(name, results, operands, attrs, types_of(c), loc(c))


def attr_dict(c: Cursor) -> dict[str, Any]:
    c.take("{")
    attrs: dict[str, Any] = {}
    while not c.accept("}"):
        key = unquote(c.take())
        attrs[key] = _value(c) if c.accept("=") else True
        c.accept(",")
    return attrs


def _value(c: Cursor) -> Any:
    token = c.take()
    if token.startswith('"'):
        return unquote(token)
    if token == "[":
        items = []
        while not c.accept("]"):
            items.append(_value(c))
            c.accept(",")
        return tuple(items)
    if token == "dense":
        return _dense_value(c)
    if token == "array":
        c.take("<")
        c.take()
        values = []
        if c.accept(":"):
            while c.peek() != ">":
                values.append(int(c.take()))
                c.accept(",")
        c.take(">")
        return tuple(values)
    if token in ("true", "false"):
        return token == "true"
    if token.startswith("@"):
        return SymbolRef(unquote(token[1:]))
    if re.fullmatch(r"[-+]?(0x[0-9A-Fa-f]+|\d[\d.eE+-]*)", token):
        decimal = "0x" not in token.lower() and re.search(r"[.eE]", token)
        element = type_of(c.take()) if c.accept(":") else ("f64" if decimal else "i64")
        return _number(token, DTYPE.get(str(element), "int64")).item()
    if token.startswith("#"):
        depth = 0
        while c.peek() == "<" or depth:
            depth += {"<": 1, ">": -1}.get(c.take(), 0)
        return token
    return type_of(token)


def _number(token: str, dtype: str) -> Any:
    numpy = dtypes.numpy_dtype(dtype)
    if dtype.startswith(("float", "bfloat")):
        if "0x" in token.lower():
            width = np.dtype(f"uint{8 * numpy.itemsize}")
            return np.array(int(token, 16), width).view(numpy)[()]
        return numpy.type(float(token))
    if dtype == "bool":
        return np.bool_(token == "true")
    return numpy.type(int(token, 0))


def _dense_value(c: Cursor) -> np.ndarray:
    c.take("<")
    items: list[Any] = []
    raw = None
    if c.peek().startswith('"'):
        raw = bytes.fromhex(unquote(c.take())[2:])
    elif c.peek() != ">":
        items = [_nested(c)]
    c.take(">")
    c.take(":")
    typ = type_of(c.take())
    if not isinstance(typ, TensorType) or None in typ.shape:
        c.fail(f"dense elements need a static tensor type, not {typ}")
    shape, numpy = tuple(int(d or 0) for d in typ.shape), dtypes.numpy_dtype(typ.dtype)
    if raw is not None:
        flat = np.frombuffer(raw, numpy)
        if typ.dtype == "bool":  # i1 elements are packed 8 per byte, first in the low bit
            bits = np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little")
            flat = (
                bits[: int(np.prod(shape))].astype(bool)
                if len(bits) >= np.prod(shape)
                else bits[:1].astype(bool)
            )
    else:
        flat = np.array([_number(t, typ.dtype) for t in _flatten(items)], numpy)
    return np.full(shape, flat[0], numpy) if flat.size == 1 else flat.reshape(shape)


def _nested(c: Cursor) -> Any:
    if not c.accept("["):
        return c.take()
    items = []
    while not c.accept("]"):
        items.append(_nested(c))
        c.accept(",")
    return items


def _flatten(items: list[Any]) -> Iterator[str]:
    for item in items:
        yield from _flatten(item) if isinstance(item, list) else [item]


def unquote(token: str) -> str:
    if not token.startswith('"'):
        return token
    raw, out, i = token[1:-1], bytearray(), 0
    while i < len(raw):
        if raw[i] == "\\":
            nxt = raw[i + 1]
            if nxt in '"\\':
                out += nxt.encode()
                i += 2
            elif nxt in "nt":
                out += b"\n" if nxt == "n" else b"\t"
                i += 2
            else:
                out.append(int(raw[i + 1 : i + 3], 16))
                i += 3
        else:
            out += raw[i].encode()
            i += 1
    return out.decode("utf-8", errors="replace")

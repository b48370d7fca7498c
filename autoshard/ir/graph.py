"""The graph IR: small frozen values (`Value`, `Op`, `Weight`) and the `Graph` that holds them.

Every later stage (rules, propagation, search, partition) reads this IR and never ONNX, so it is
deliberately plain: tensors are named, every shape is a tuple of static ints (symbolic dims are
bound and shape subgraphs folded by the importer), ops refer to values by name in operand order,
and model parameters are lazy `Weight`s so a model whose weight data is absent still plans.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
from onnx import TensorProto, numpy_helper

from autoshard.errors import GraphError, ModelError
from autoshard.ir import dtypes
from autoshard.ir.fused import Fused

if TYPE_CHECKING:
    import networkx as nx

AttrValue = int | float | str | bytes | tuple | np.ndarray

PHASES = ("forward", "backward", "gradient_sync", "optimizer")
"""The phases of a training step, in order (`Graph.phases`)."""

FORWARD = PHASES[0]
"""The phase of every op outside a training step."""

ROLES = ("input", "weight", "constant", "activation", "output")
"""Roles of a value in `Graph.role` / `to_networkx`, in order of precedence."""


def _frozen_array(array: np.ndarray) -> np.ndarray:
    """A read-only copy, so a tensor stored in a frozen IR value cannot be mutated in place."""
    out = np.array(array, copy=True)
    out.flags.writeable = False
    return out


def _hash_key(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, tuple):
        return tuple(_hash_key(v) for v in value)
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
        )
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


class Attrs(Mapping[str, AttrValue]):
    """Op attributes: an immutable mapping, sorted by name, that is hashable and comparable.

    Values are plain python (int, float, str, bytes, tuples of those) or read-only numpy arrays
    for tensor attributes. A MappingProxy would do for immutability, but `Op` must be hashable
    (ops go into sets and dict keys) and numpy arrays are not, so hashing and equality here treat
    arrays by dtype, shape and bytes.
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, AttrValue] | Iterable[tuple[str, AttrValue]] = ()):
        pairs = dict(items)
        for name, value in pairs.items():
            if isinstance(value, np.ndarray):
                pairs[name] = _frozen_array(value)
            elif isinstance(value, list):
                pairs[name] = tuple(value)
        self._items: dict[str, AttrValue] = dict(sorted(pairs.items()))

    def __getitem__(self, name: str) -> AttrValue:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple((k, _hash_key(v)) for k, v in self._items.items()))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Attrs):
            return NotImplemented
        return self._items.keys() == other._items.keys() and all(
            _same(v, other._items[k]) for k, v in self._items.items()
        )

    def __repr__(self) -> str:
        return f"Attrs({self._items!r})"


class TensorLike:
    """Size and bytes of anything with a static `shape` and a `dtype` name."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the dense tensor (sub-byte dtypes packed, rounded up)."""
        return dtypes.nbytes(self.dtype, self.size)


@dataclass(frozen=True)
class Value(TensorLike):
    """A tensor of the graph: its name, static shape and dtype name (`"float32"`, `"int64"`)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if not all(isinstance(d, int | np.integer) and d >= 0 for d in shape):
            raise GraphError(f"value {self.name!r} has a non-static shape {shape}")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))

    def __str__(self) -> str:
        return f"{self.name}: {self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class Op:
    """One operation: ONNX op type and domain, operand and result value names, attributes.

    `domain` is "" for the default ONNX domain. `inputs` keeps ONNX operand positions: an
    omitted optional operand is `""`. `attrs` may be given as a dict; it is stored as an `Attrs`.
    Fields have defaults so ops are easy to write by keyword:
    `Op("mm", "MatMul", inputs=("x", "w"), outputs=("y",))`.
    """

    name: str
    type: str
    domain: str = ""
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    attrs: Attrs = field(default_factory=Attrs)

    def __post_init__(self) -> None:
        if not isinstance(self.domain, str):
            raise TypeError(f"op {self.name!r}: domain must be a str, got {self.domain!r}")
        for kind in ("inputs", "outputs"):
            names = getattr(self, kind)
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise TypeError(f"op {self.name!r}: {kind} must be value names, got {names!r}")
            object.__setattr__(self, kind, tuple(names))
        if not isinstance(self.attrs, Attrs):
            object.__setattr__(self, "attrs", Attrs(self.attrs))

    def attr(self, name: str, default: AttrValue | None = None) -> AttrValue | None:
        """The attribute `name`, or `default` when the node does not set it (ONNX defaults)."""
        return self.attrs.get(name, default)

    def __str__(self) -> str:
        domain = f"{self.domain}." if self.domain else ""
        return f"{', '.join(self.outputs)} = {domain}{self.type}({', '.join(self.inputs)})"


@dataclass(frozen=True)
class Weight(TensorLike):
    """A model parameter (an ONNX initializer) whose data is read only by `load()`.

    `external` is the resolved data file, `offset`/`length` the byte range inside it (length
    -1 = to the end); for embedded data `tensor` is the initializer proto. `has_data` is False when
    the external file is absent: the model is then shape-only and still plans.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    has_data: bool
    external: Path | None = None
    offset: int = 0
    length: int = -1
    tensor: TensorProto | None = field(default=None, compare=False, repr=False)

    def load(self) -> np.ndarray:
        """The weight's data; external data is memory-mapped read-only, not read eagerly."""
        if not self.has_data:
            where = f"external data file '{self.external}'" if self.external else "its data"
            raise ModelError(f"weight {self.name!r} has no data: {where} is missing")
        if self.external is None:
            assert self.tensor is not None
            return numpy_helper.to_array(self.tensor)
        dtype = dtypes.numpy_dtype(self.dtype)
        if dtypes.bits(self.dtype) % 8 == 0 and dtypes.bits(self.dtype) > 0:
            return np.memmap(self.external, dtype, "r", self.offset, self.shape, order="C")
        # Packed sub-byte types: unpack through onnx, which knows the nibble order.
        with open(self.external, "rb") as f:
            f.seek(self.offset)
            raw = f.read(self.nbytes)
        proto = TensorProto(dims=self.shape, data_type=dtypes.onnx_type(self.dtype), raw_data=raw)
        return numpy_helper.to_array(proto).astype(dtype, copy=False)


@dataclass(frozen=True, eq=False)
class Graph:
    """A model as ops in topological order over named values with static shapes.

    `values` holds every tensor (inputs, weights, constants, op results); `weights` every
    initializer of the file, even those only folded shape subgraphs read (parameter counts and
    per-device weight files need them all); `constants` the tensors the importer computed
    (ONNX `Constant` nodes, folded shape subgraphs). `nodes_in_file` is the node count of the
    imported file before inlining and folding (None when not imported); `buffers` the weights
    the exporter says are no parameters (torch buffers: a training step never trains them);
    a training step's graph adds those it found to be buffers itself (`training.buffers`).
    Compared by identity: it is a large container, not a small value.

    A training step (`autoshard.training`) also says which outputs are the next value of a
    weight or input (`updates`: output -> the value it replaces, returned in the sharding that
    value is held in, and written over it: the old value is dead after its last reader) and
    the phase of each op (`phases`: op name -> "forward", "backward", "gradient_sync" or
    "optimizer"; ops not listed are forward), and how many times the forward and backward
    run per step (`micro_batches`: gradients accumulate, then are synchronized once), and the
    ops whose matrix units compute in another dtype than their result's (`matmul_dtypes`:
    op name -> dtype; a linear layer's matmuls in FP8 under fp8-mixed precision).

    `fused` names the ops engines run as one kernel and what that kernel keeps of the values
    inside it (`ir.fused`: flash attention; empty when the graph is priced op by op).
    `on_chip` names the values compiled elementwise kernels keep in registers, priced as
    neither written nor read (`training.compiled`; empty for eager kernels).
    """

    name: str
    ops: tuple[Op, ...]
    values: Mapping[str, Value]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: Mapping[str, Weight] = field(default_factory=dict)
    constants: Mapping[str, np.ndarray] = field(default_factory=dict)
    opset: int = 0
    nodes_in_file: int | None = None
    buffers: frozenset[str] = frozenset()
    updates: Mapping[str, str] = field(default_factory=dict)
    phases: Mapping[str, str] = field(default_factory=dict)
    micro_batches: int = 1
    fused: Fused = Fused()
    matmul_dtypes: Mapping[str, str] = field(default_factory=dict)
    on_chip: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))
        object.__setattr__(self, "weights", MappingProxyType(dict(self.weights)))
        consts = {k: _frozen_array(np.asarray(v)) for k, v in self.constants.items()}
        object.__setattr__(self, "constants", MappingProxyType(consts))
        object.__setattr__(self, "updates", MappingProxyType(dict(self.updates)))
        object.__setattr__(self, "phases", MappingProxyType(dict(self.phases)))
        object.__setattr__(self, "matmul_dtypes", MappingProxyType(dict(self.matmul_dtypes)))

    def phase(self, op_name: str) -> str:
        """The phase of the training step op `op_name` runs in ("forward" outside training)."""
        return self.phases.get(op_name, FORWARD)

    def runs(self, op_name: str) -> int:
        """How many times op `op_name` runs per step."""
        return self.micro_batches if self.phase(op_name) in PHASES[:2] else 1

    @cached_property
    def replaced(self) -> frozenset[str]:
        """The weights and inputs a training step writes over (`updates`)."""
        return frozenset(self.updates.values())

    @cached_property
    def _producers(self) -> Mapping[str, Op]:
        return MappingProxyType({out: op for op in self.ops for out in op.outputs if out})

    @cached_property
    def _consumers(self) -> Mapping[str, tuple[Op, ...]]:
        users: dict[str, list[Op]] = {}
        for op in self.ops:
            for name in dict.fromkeys(i for i in op.inputs if i):
                users.setdefault(name, []).append(op)
        return MappingProxyType({k: tuple(v) for k, v in users.items()})

    @cached_property
    def op_by_name(self) -> Mapping[str, Op]:
        """Ops keyed by their unique name."""
        return MappingProxyType({op.name: op for op in self.ops})

    def producer(self, value_name: str) -> Op | None:
        """The op computing `value_name`, or None for inputs, weights and constants."""
        return self._producers.get(value_name)

    def consumers(self, value_name: str) -> tuple[Op, ...]:
        """Ops reading `value_name`, in graph order, each once."""
        return self._consumers.get(value_name, ())

    def role(self, value_name: str) -> str:
        """One of `ROLES`: input, weight, constant, output (a graph output computed by an op)
        or activation."""
        if value_name in self.inputs:
            return "input"
        if value_name in self.weights:
            return "weight"
        if value_name in self.constants:
            return "constant"
        return "output" if value_name in self.outputs else "activation"

    def to_networkx(self) -> nx.MultiDiGraph:
        """A bipartite MultiDiGraph: `("op", name)` and `("value", name)` nodes.

        Edges go value → op keyed and labelled by `operand` index, and op → value by `result`
        index, so an op reading the same value twice keeps two edges. networkx is imported
        here: no plan needs it.
        """
        import networkx as nx

        g = nx.MultiDiGraph(name=self.name)
        for value in self.values.values():
            g.add_node(
                ("value", value.name),
                kind="value",
                shape=value.shape,
                dtype=value.dtype,
                role=self.role(value.name),
            )
        for op in self.ops:
            node = ("op", op.name)
            g.add_node(node, kind="op", type=op.type, domain=op.domain, attrs=op.attrs)
            for index, name in enumerate(op.inputs):
                if name:
                    g.add_edge(("value", name), node, key=index, operand=index)
            for index, name in enumerate(op.outputs):
                if name:
                    g.add_edge(node, ("value", name), key=index, result=index)
        return g


def verify(graph: Graph) -> None:
    """Check the IR's invariants; raise GraphError naming the first op or value breaking one.

    Ops name known values (or "" for an omitted operand), every value has one producer or is an
    input, weight or constant, ops are in topological order (hence acyclic), op names are unique,
    outputs exist, and shapes are tuples of non-negative ints.
    """
    sources = {"input": graph.inputs, "weight": graph.weights, "constant": graph.constants}
    defined: dict[str, str] = {}
    for kind, names in sources.items():
        for name in names:
            if name in defined:
                raise GraphError(f"value {name!r} is both {defined[name]} and {kind}")
            defined[name] = kind
    for name, value in graph.values.items():
        if name != value.name:
            raise GraphError(f"value {value.name!r} is stored under the name {name!r}")
        if not all(type(d) is int and d >= 0 for d in value.shape):
            raise GraphError(f"value {name!r} has a non-static shape {value.shape!r}")
    seen_ops: set[str] = set()
    for op in graph.ops:
        if op.name in seen_ops:
            raise GraphError(f"op name {op.name!r} is used twice")
        seen_ops.add(op.name)
        for name in op.inputs:
            if not name:
                continue
            if name not in graph.values:
                raise GraphError(f"op {op.name!r} ({op.type}) reads unknown value {name!r}")
            if name not in defined:
                raise GraphError(
                    f"op {op.name!r} ({op.type}) reads {name!r} before it is produced "
                    "(ops are not in topological order, or the graph has a cycle)"
                )
        for name in op.outputs:
            if not name:
                continue
            if name in defined:
                raise GraphError(
                    f"value {name!r} produced by op {op.name!r} ({op.type}) is already "
                    f"defined as {defined[name]}"
                )
            if name not in graph.values:
                raise GraphError(f"op {op.name!r} ({op.type}) result {name!r} has no Value")
            defined[name] = f"result of op {op.name!r}"
    for name in graph.values:
        if name not in defined:
            raise GraphError(f"value {name!r} has no producer and is not an input/weight/constant")
    for name in (*graph.inputs, *graph.weights, *graph.constants):
        if name not in graph.values:
            raise GraphError(
                f"value {name!r} is listed as a graph {defined[name]} but has no Value"
            )
    for name in graph.outputs:
        if name not in graph.values:
            raise GraphError(f"graph output {name!r} is not a value of the graph")
    for new, old in graph.updates.items():
        if new not in graph.outputs or old not in (*graph.inputs, *graph.weights):
            raise GraphError(f"update {new!r} -> {old!r} is not an output replacing an input")
        if graph.values[new].shape != graph.values[old].shape:
            raise GraphError(f"update {new!r} has another shape than {old!r}")

"""Shape inference plus folding of shape subgraphs, until every tensor has a static shape.

Exporters compute shapes at run time: TorchScript emits `Shape → Gather → Unsqueeze → Concat →
Reshape` for `x.view(b, s, h, d)`, `ConstantOfShape`/`Range`/`Where` for masks and positions.
Once the user binds the symbolic input dims these subgraphs compute constants, but ONNX shape
inference alone cannot always see through them (its data propagation stops at Range, Where,
Equal, ConstantOfShape, Expand...). So `fold_shapes` alternates two steps:

1. infer shapes (onnx) on a light model whose constants are initializers;
2. in one forward pass evaluate every node whose operands are all constants (or that reads only
   the static shape of its operand: `Shape`, `Size`) and whose results are small, and turn its
   results into constants;

until a pass folds nothing; then, if a result's type is still unknown, once more with onnx's
data propagation (`data_prop=True`): it is seldom needed (folding sees through the same shape
code) and costs several times as much as plain inference on a large model, so it runs only
where folding stalls.
When inference already knew every result's type, the round after a pass is known without
running it (inference would learn nothing; a pass over the same types folds nothing more), so
a model whose shapes inference sees through costs one inference, not two. Worked example
(batch bound to 2, x: float32[2, 12]):

    s = Shape(x)           → round 1 folds s = [2, 12]
    b = Gather(s, 0)       → same pass: b = 2 (its operands are now constant)
    t = Concat(b, [3, 4])  → t = [2, 3, 4]
    y = Reshape(x, t)      → x is an activation: stays an op; round 2's inference gives
                             y: [2, 3, 4] (t is an initializer now), and a `Shape(y)` further
                             down folds in round 2.

Results bigger than `limit` elements are never materialized (a [seq, seq] causal mask for a long
sequence, anything computed from a large weight), and nodes whose result shape inference cannot
bound are not evaluated when they may expand data (`ConstantOfShape`, `Expand`, `Tile`, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import ModelProto, NodeProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from autoshard.errors import ModelError

FOLD_LIMIT = 65536
"""Largest number of elements of a tensor the folder will compute and keep as a constant."""

# Ops whose result differs from run to run: never folded.
_RANDOM = frozenset(
    {
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
    }
)
# Ops whose result can be far larger than their operands: evaluated only when shape inference
# bounded the result's size first.
_EXPANDING = frozenset(
    {
        "ConstantOfShape",
        "Expand",
        "Tile",
        "Range",
        "Resize",
        "Upsample",
        "Pad",
        "EyeLike",
        "OneHot",
        "MatMul",
        "Gemm",
        "Einsum",
        "Col2Im",
        "ConvTranspose",
    }
)


@dataclass(frozen=True)
class TensorType:
    """What shape inference knows of a tensor: ONNX element type (0 = unknown) and dims
    (None for an unknown dim; `shape` None when even the rank is unknown)."""

    elem_type: int
    shape: tuple[int | None, ...] | None

    @property
    def static(self) -> bool:
        """True when the rank and every dim are known."""
        return self.shape is not None and all(d is not None for d in self.shape)

    @property
    def dims(self) -> tuple[int, ...]:
        """The shape as ints; only for a static type."""
        assert self.shape is not None and self.static, "dims of a non-static type"
        return tuple(int(d) for d in self.shape if d is not None)

    def __str__(self) -> str:
        if self.shape is None:
            return "[unknown rank]"
        return "[" + ", ".join("?" if d is None else str(d) for d in self.shape) + "]"


@dataclass(frozen=True)
class FoldResult:
    """The folded model: the ops left (topological order), the constants computed, the type of
    every tensor known to inference, and why a candidate node could not be evaluated."""

    nodes: tuple[NodeProto, ...]
    constants: Mapping[str, np.ndarray]
    types: Mapping[str, TensorType]
    failures: Mapping[str, str] = field(default_factory=dict)
    rounds: int = 0
    model: ModelProto = field(default_factory=ModelProto, repr=False)


def tensor_type(type_proto: onnx.TypeProto) -> TensorType:
    """A `TensorType` of an ONNX type; a non-tensor type (sequence, map...) is unknown."""
    if type_proto.WhichOneof("value") != "tensor_type":
        return TensorType(0, None)
    tt = type_proto.tensor_type
    if not tt.HasField("shape"):
        return TensorType(tt.elem_type, None)
    dims = tuple(
        d.dim_value if d.WhichOneof("value") == "dim_value" else None for d in tt.shape.dim
    )
    return TensorType(tt.elem_type, dims)


def infer_types(model: ModelProto, data_prop: bool = True) -> dict[str, TensorType]:
    """Types of all tensors of `model` after onnx shape inference, with data propagation
    where `data_prop`."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=data_prop)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"shape inference failed: {first}") from None
    types = _types(inferred)
    unknown_ops = [n for n in model.graph.node if not onnx.defs.has(n.op_type, n.domain)]
    if any(not types.get(o, TensorType(0, None)).static for n in unknown_ops for o in n.output):
        types = {**_runtime_types(inferred), **{k: t for k, t in types.items() if t.static}}
    return types


def _types(model: ModelProto) -> dict[str, TensorType]:
    graph = model.graph
    types: dict[str, TensorType] = {}
    for info in (*graph.input, *graph.value_info, *graph.output):
        types[info.name] = tensor_type(info.type)
    for init in graph.initializer:
        types[init.name] = TensorType(init.data_type, tuple(init.dims))
    return types


_RUNTIME_LEFTOVER = "sym_shape_infer_temp.onnx*"
"""What onnxruntime's symbolic shape inference saves in the working directory when it cannot
infer every shape (the model and its external data)."""


def _runtime_types(model: ModelProto) -> dict[str, TensorType]:
    """Types from onnxruntime's symbolic shape inference, which knows its own operators
    (com.microsoft's fused attention, norms and activations, which onnx does not); none
    where it fails (the import then names the op whose shape stayed unknown)."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    before = set(Path().glob(_RUNTIME_LEFTOVER))
    try:
        inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    except Exception:  # its own assertion and key errors on what it cannot infer
        return {}
    finally:  # where incomplete it saves its model in the working directory: not ours to leave
        for left in set(Path().glob(_RUNTIME_LEFTOVER)) - before:
            left.unlink(missing_ok=True)
    return _types(inferred) if inferred is not None else {}


def inference_error(model: ModelProto) -> str | None:
    """The first error strict shape inference reports on `model`, on one line (None if none):
    why a shape stayed unknown, when lenient inference skipped a failing node."""
    try:
        onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        return " ".join(str(exc).split()) or type(exc).__name__
    return None


def _shape_of(node: NodeProto, types: Mapping[str, TensorType]) -> np.ndarray | None:
    """`Shape(x)` / `Size(x)` from x's static type, without x's data; None if x is not static."""
    known = types.get(node.input[0])
    if known is None or not known.static:
        return None
    dims = list(known.dims)
    if node.op_type == "Size":
        return np.array(math.prod(dims), dtype=np.int64)
    attrs = {a.name: a.i for a in node.attribute}
    rank = len(dims)
    start, end = attrs.get("start", 0), attrs.get("end", rank)
    start, end = (min(max(i + rank if i < 0 else i, 0), rank) for i in (start, end))
    return np.array(dims[start:end], dtype=np.int64)


def _gather_elements(node: NodeProto, data: np.ndarray, indices: np.ndarray) -> np.ndarray:
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    axis = axis + data.ndim if axis < 0 else axis
    indices = np.where(indices < 0, indices + data.shape[axis], indices)
    return np.take_along_axis(data, indices, axis)


# Kernels replacing onnx.reference ones that are wrong on exporter patterns: its GatherElements
# (np.choose) fails past 32 choices, e.g. BERT's token_type_ids buffer sliced to seq.
_KERNELS = {("", "GatherElements"): _gather_elements}


def _evaluate(node: NodeProto, constants: Mapping[str, np.ndarray], opset: int) -> list[np.ndarray]:
    feeds = {name: constants[name] for name in node.input if name}
    kernel = _KERNELS.get((node.domain, node.op_type))
    if kernel is not None:
        return [np.asarray(kernel(node, *(constants[name] for name in node.input)))]
    evaluator = ReferenceEvaluator(node, opsets={"": opset})
    # Exported shape code computes log(0) or casts inf on branches a Where then discards (T5's
    # relative-position buckets): the results are right, the warnings are noise.
    with np.errstate(all="ignore"):
        return [np.asarray(r) for r in evaluator.run(None, feeds)]


def _fold_pass(
    nodes: list[NodeProto],
    constants: dict[str, np.ndarray],
    types: Mapping[str, TensorType],
    opset: int,
    limit: int,
    failures: dict[str, str],
) -> tuple[list[NodeProto], dict[str, np.ndarray]]:
    """One forward pass: the nodes kept and the constants newly computed (also added to
    `constants`, so later nodes of the same pass see them)."""
    kept: list[NodeProto] = []
    new: dict[str, np.ndarray] = {}
    for node in nodes:
        results = _try_fold(node, constants, types, opset, limit, failures)
        if results is None:
            kept.append(node)
            continue
        for name, array in zip(node.output, results, strict=False):
            if name:
                new[name] = constants[name] = array
    return kept, new


def _try_fold(
    node: NodeProto,
    constants: Mapping[str, np.ndarray],
    types: Mapping[str, TensorType],
    opset: int,
    limit: int,
    failures: dict[str, str],
) -> list[np.ndarray] | None:
    if node.domain not in ("", "ai.onnx") or node.op_type in _RANDOM:
        return None
    if node.op_type == "Constant":
        return _evaluate(node, constants, opset)
    if node.op_type in ("Shape", "Size"):
        shape = _shape_of(node, types)
        return None if shape is None else [shape]
    if not all(name in constants for name in node.input if name):
        return None
    outs = [types.get(name) for name in node.output if name]
    bounded = all(t is not None and t.static for t in outs)
    if bounded and any(math.prod(t.dims) > limit for t in outs if t is not None):
        return None
    if not bounded and node.op_type in _EXPANDING:
        return None
    try:
        results = _evaluate(node, constants, opset)
    # The reference evaluator raises whatever its numpy kernels raise; a node it cannot run
    # simply stays an op, and the reason is kept for the error if its shape stays unknown.
    except Exception as exc:  # noqa: BLE001
        failures[node.name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return None
    if any(r.size > limit for r in results):
        return None
    return _conform(node, results, types, failures)


def _conform(
    node: NodeProto,
    results: list[np.ndarray],
    types: Mapping[str, TensorType],
    failures: dict[str, str],
) -> list[np.ndarray] | None:
    """Results cast to the element types ONNX defines for them (a reference kernel may compute
    in another precision); None if a result contradicts its inferred static shape."""
    conformed = []
    for name, array in zip(node.output, results, strict=False):
        known = types.get(name)
        if known is not None and known.static and known.dims != array.shape:
            failures[node.name] = f"evaluated {name!r} as {list(array.shape)}, inferred {known}"
            return None
        if known is not None and known.elem_type not in (0, onnx.TensorProto.STRING):
            array = array.astype(helper.tensor_dtype_to_np_dtype(known.elem_type), copy=False)
        conformed.append(array)
    return conformed


def _known(known: TensorType | None) -> bool:
    return known is not None and known.static and known.elem_type != 0


def fold_shapes(
    model: ModelProto, sources: Mapping[str, np.ndarray], limit: int = FOLD_LIMIT
) -> FoldResult:
    """Fold `model`'s shape subgraphs to constants; see the module docstring.

    `model` must be light: named nodes in topological order, no initializers (weights appear
    as typed graph inputs, so a multi-GB model infers as fast as its skeleton), input dims
    bound. `sources` are the constants folding may start from (small initializers with data).
    The model is not modified.
    """
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    work = ModelProto()
    work.CopyFrom(model)
    constants = {name: np.asarray(a) for name, a in sources.items()}
    work.graph.initializer.extend(numpy_helper.from_array(a, name) for name, a in constants.items())
    nodes = list(work.graph.node)
    failures: dict[str, str] = {}
    rounds, propagated = 0, False
    types = infer_types(work, data_prop=False)
    while True:
        rounds += 1
        known = all(_known(types.get(name)) for node in nodes for name in node.output if name)
        nodes, new = _fold_pass(nodes, constants, types, opset, limit, failures)
        if not new and (known or propagated):
            return FoldResult(tuple(nodes), constants, types, failures, rounds, work)
        if not new:
            # Folding stalls with a type unknown: data propagation may see further.
            types, propagated = infer_types(work), True
            continue
        del work.graph.node[:]
        work.graph.node.extend(nodes)
        added = [numpy_helper.from_array(a, name) for name, a in new.items()]
        work.graph.initializer.extend(added)
        if known:
            # Every result's type was known: inference learns nothing from the new constants,
            # and a pass over the same types folds nothing more (the pass already folds what
            # the constants it makes allow). That last round is derived, not run: its types
            # are these, the folded values typed as the initializers they became.
            types |= {t.name: TensorType(t.data_type, tuple(t.dims)) for t in added}
            rounds += 1
            return FoldResult(tuple(nodes), constants, types, failures, rounds, work)
        types, propagated = infer_types(work, data_prop=False), False

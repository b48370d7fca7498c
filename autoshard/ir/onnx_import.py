"""Import an ONNX model file into the IR: `import_onnx(path, dims) -> Graph`.

Steps, each failing with a one-line `ModelError` naming the culprit:
load without weight data → upgrade opsets 7-12 to 13 (`opset.py`) → reject duplicate
initializers or inputs → inline model-local functions → name every node (`MatMul_12`: type
and position, for unnamed nodes) → one producer per value → reject control flow → bind the symbolic
input dims → Identity nodes of initializers made initializers of their own → shape inference and
folding (`fold.py`) → build the `Graph`, every shape static.

Symbolic dims are named by their `dim_param` (`batch`); an input dim with neither a value nor a
name is named `INPUT.AXIS` (`input_ids.1`) and is bound by that name.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import heapq
import math
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
from google.protobuf.message import DecodeError
from onnx import (
    AttributeProto,
    ModelProto,
    NodeProto,
    TensorProto,
    helper,
    numpy_helper,
)

from autoshard.errors import LimitError, ModelError, UnboundDimError
from autoshard.ir import dtypes
from autoshard.ir.fold import FOLD_LIMIT, FoldResult, fold_shapes, inference_error
from autoshard.ir.graph import Attrs, AttrValue, Graph, Op, Value, Weight, verify
from autoshard.ir.opset import upgrade_opset
from autoshard.limits import MAX_ELEMENTS, check_elements

CONTROL_FLOW = frozenset({"If", "Loop", "Scan", "SequenceMap"})
# Results whose shape depends on tensor data: named in the error when such a shape stays unknown.
DATA_DEPENDENT = frozenset({"NonZero", "Unique", "NonMaxSuppression", "Compress", "TopK"})
_INFERENCE_PREFIX = "[ShapeInferenceError] Inference error(s): "


def load_model(path: str | os.PathLike[str]) -> ModelProto:
    """The model proto of `path`, weights left on disk; ModelError if it is not a model."""
    try:
        model = onnx.load(os.fspath(path), load_external_data=False)
    except FileNotFoundError:
        raise ModelError(f"cannot read ONNX model '{path}': no such file") from None
    except DecodeError:
        reason = "not an ONNX protobuf (corrupt or truncated file)"
        raise ModelError(f"cannot read ONNX model '{path}': {reason}") from None
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        raise ModelError(f"cannot read ONNX model '{path}': {reason}") from None
    except (ValueError, RuntimeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot read ONNX model '{path}': {reason}") from None
    # protobuf parses an empty (or suitably garbled) file as an empty message without error.
    if model.ir_version <= 0 or not model.HasField("graph") or not model.opset_import:
        reason = "empty file" if os.path.getsize(path) == 0 else "not an ONNX model (no graph)"
        raise ModelError(f"cannot read ONNX model '{path}': {reason}")
    return model


def unbound_dims(path: str | os.PathLike[str]) -> dict[str, list[str]]:
    """The symbolic dims of the model's inputs → the `input[axis]` places carrying each."""
    return _symbolic_dims(load_model(path))


def file_weights(model: ModelProto, path: str | os.PathLike[str]) -> dict[str, Weight]:
    """The model's initializers as lazy weights (external data relative to the model's folder)."""
    base = Path(path).resolve().parent
    # Weights share few data files: look each up once, not once per weight.
    located = functools.cache(_located)
    return {t.name: _weight(t, base, located) for t in model.graph.initializer}


# Dynamo's record of what each input of the exported program was (torch.export's InputSpec):
# PARAMETER, BUFFER, CONSTANT_TENSOR, ...; and the values a folded initializer was made from.
INPUT_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"


def value_metadata(model: ModelProto) -> dict[str, dict[str, str]]:
    """The exporter's metadata of each value that has some: its value_info's `metadata_props`,
    with an initializer's own over them."""
    meta = {v.name: {p.key: p.value for p in v.metadata_props} for v in model.graph.value_info}
    for t in model.graph.initializer:
        meta.setdefault(t.name, {}).update({p.key: p.value for p in t.metadata_props})
    return {name: found for name, found in meta.items() if found}


def exported_buffers(model: ModelProto) -> frozenset[str]:
    """The initializers the exporter says are no parameters: torch buffers and constants by
    dynamo's input kind (Llama's non-persistent `rotary_emb.inv_freq` is a BUFFER), and those
    folded from such values alone. Without the metadata (TorchScript, stripped) none."""
    meta = value_metadata(model)
    buffers: set[str] = set()
    for t in model.graph.initializer:
        kind = meta.get(t.name, {}).get(INPUT_KIND)
        if kind is not None and kind != "PARAMETER":
            buffers.add(t.name)
    for t in model.graph.initializer:
        sources = literal_names(meta.get(t.name, {}).get(FOLDED_FROM, ""))
        if sources and all(meta.get(s, {}).get(INPUT_KIND, "PARAMETER") != "PARAMETER"
                           for s in sources):  # fmt: skip
            buffers.add(t.name)
    return frozenset(buffers)


def literal_names(text: str) -> list[str]:
    """The names of a metadata list literal (`"['a', 'b']"`); none if it is not one."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return []
    return [v for v in value if isinstance(v, str)] if isinstance(value, list | tuple) else []


def _located(file: Path) -> tuple[Path, int | None]:
    """The file resolved, and its size in bytes (None: no such file)."""
    file = file.resolve()
    return file, file.stat().st_size if file.is_file() else None


def _symbolic_dims(model: ModelProto, weights: Collection[str] = ()) -> dict[str, list[str]]:
    inits = {t.name for t in model.graph.initializer} | set(weights)
    found: dict[str, list[str]] = {}
    for info in model.graph.input:
        if info.name in inits:
            continue
        if not info.type.tensor_type.HasField("shape"):
            raise ModelError(f"graph input {info.name!r} has no shape (not even a rank)")
        for axis, dim in enumerate(info.type.tensor_type.shape.dim):
            kind = dim.WhichOneof("value")
            if kind == "dim_value":
                continue
            name = dim.dim_param if kind == "dim_param" else f"{info.name}.{axis}"
            found.setdefault(name, []).append(f"{info.name}[{axis}]")
    return found


def _light_model(model: ModelProto) -> ModelProto:
    """A copy without initializer data: what inlining and inference need, cheap to copy."""
    light = ModelProto(ir_version=model.ir_version, producer_name=model.producer_name)
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    g = model.graph
    light.graph.name = g.name
    for part in ("node", "input", "output", "value_info"):
        getattr(light.graph, part).extend(getattr(g, part))
    if light.functions:
        light = onnx.inliner.inline_local_functions(light)
    return light


def name_nodes(nodes: Iterable[NodeProto]) -> None:
    """Give every node a unique name: its own, else `Type_index` by position; clashes get
    `_1`, `_2`... in file order, so names are deterministic."""
    used: set[str] = set()
    for index, node in enumerate(nodes):
        base = node.name or f"{node.op_type}_{index}"
        name, k = base, 0
        while name in used:
            k += 1
            name = f"{base}_{k}"
        used.add(name)
        node.name = name


def _check_unique_sources(model: ModelProto, path: object) -> None:
    """Initializers and graph inputs each named once: onnxruntime would refuse the file, and
    the IR would silently keep one of the two."""
    graph = model.graph
    for kind, entries in (("initializer", graph.initializer), ("graph input", graph.input)):
        seen: set[str] = set()
        for entry in entries:
            if entry.name in seen:
                raise ModelError(f"model '{path}' has two {kind}s named {entry.name!r}")
            seen.add(entry.name)


def _check_single_producers(
    nodes: Iterable[NodeProto], weights: Collection[str], path: object
) -> None:
    """Every value is produced by one node, and not by a node and as a weight."""
    producer: dict[str, NodeProto] = {}
    for node in nodes:
        for name in node.output:
            if not name:
                continue
            if name in weights:
                raise ModelError(
                    f"model '{path}': value {name!r} is both an initializer and the result of "
                    f"op '{node.name}' ({node.op_type})"
                )
            if name in producer:
                first = producer[name]
                raise ModelError(
                    f"model '{path}': value {name!r} is the result of two ops, "
                    f"'{first.name}' ({first.op_type}) and '{node.name}' ({node.op_type})"
                )
            producer[name] = node


def _reject_control_flow(nodes: Iterable[NodeProto]) -> None:
    for node in nodes:
        has_graph = any(
            a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in node.attribute
        )
        if node.op_type in CONTROL_FLOW or has_graph:
            raise ModelError(
                f"op '{node.name}' ({node.op_type}) is control flow, which autoshard does not "
                "support; export the model with static control flow (traced, no data-dependent "
                "branches or loops)"
            )


def _topological(nodes: list[NodeProto], defined: set[str], path: object) -> list[NodeProto]:
    """The file order when it is topological, else a stable topological sort (Kahn's algorithm,
    ready nodes taken in file order)."""
    known = set(defined) | {""}
    if all(_reads_known(n, known) for n in nodes):
        return nodes
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    waiting = [0] * len(nodes)
    users: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in dict.fromkeys(node.input):
            if name in defined or not name:
                continue
            if name not in producer:
                raise ModelError(
                    f"op '{node.name}' ({node.op_type}) reads {name!r}, which no node, graph "
                    "input or initializer defines"
                )
            waiting[i] += 1
            users.setdefault(producer[name], []).append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in users.get(i, ()):
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    if len(order) < len(nodes):
        stuck = next(nodes[i] for i, w in enumerate(waiting) if w > 0)
        raise ModelError(f"model '{path}' has a cycle through op '{stuck.name}' ({stuck.op_type})")
    return [nodes[i] for i in order]


def _aliased_weights(
    nodes: list[NodeProto], weights: Mapping[str, Weight], outputs: Collection[str]
) -> tuple[list[NodeProto], dict[str, Weight]]:
    """The nodes without the Identity nodes of initializers, whose results become initializers
    of their own with the same data. The TorchScript exporter deduplicates parameters of equal
    values (every fresh norm's ones, every zero bias) into one initializer and Identity nodes
    named as the parameters were (`layers.1.ln.weight = Identity(layers.0.ln.weight)`): left as
    ops, layer 0 would read a weight where layer 1 reads an op's result, and the layers would
    not be alike. A graph output stays an Identity's result."""
    weights = dict(weights)
    kept = []
    for node in nodes:
        source = node.input[0] if node.op_type == "Identity" and node.input else ""
        if source in weights and node.output[0] not in outputs and node.domain in ("", "ai.onnx"):
            weights[node.output[0]] = dataclasses.replace(weights[source], name=node.output[0])
        else:
            kept.append(node)
    return kept, weights


def _reads_known(node: NodeProto, known: set[str]) -> bool:
    ok = all(name in known for name in node.input)
    known.update(node.output)
    return ok


def _bind_dims(
    model: ModelProto, dims: Mapping[str, int], weights: Collection[str], path: object
) -> None:
    """Write the bound sizes into the light model's input, output and value_info dims; clear
    other dim names there so inference fills them instead of merging stale symbols."""
    present = _symbolic_dims(model, weights)
    for name, size in dims.items():
        if name not in present:
            choices = ", ".join(present) if present else "none (all input dims are static)"
            raise ModelError(f"model '{path}' has no symbolic dim {name!r}; its dims: {choices}")
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size <= 0:
            raise ModelError(f"dim {name!r} must be a positive int, got {size!r}")
        if size > MAX_ELEMENTS:
            raise LimitError(
                f"dim {name!r} = {size} is more than autoshard's limit of MAX_ELEMENTS = "
                f"{MAX_ELEMENTS} elements per tensor"
            )
    unbound = {name: where for name, where in present.items() if name not in dims}
    if unbound:
        listed = ", ".join(f"{name} ({', '.join(where)})" for name, where in unbound.items())
        anonymous = any(name not in _named_params(model) for name in unbound)
        hint = " (an unnamed dim is named INPUT.AXIS)" if anonymous else ""
        raise UnboundDimError(
            f"unbound symbolic dims: {listed}; bind them with --dim NAME=SIZE{hint}", unbound
        )
    graph = model.graph
    for info in graph.input:
        if info.name in weights:
            continue
        for axis, dim in enumerate(info.type.tensor_type.shape.dim):
            if dim.WhichOneof("value") is None and f"{info.name}.{axis}" in dims:
                dim.dim_value = int(dims[f"{info.name}.{axis}"])
    for info in (*graph.input, *graph.output, *graph.value_info):
        if info.type.WhichOneof("value") != "tensor_type":
            continue
        for dim in info.type.tensor_type.shape.dim:
            if dim.WhichOneof("value") == "dim_param":
                param = dim.dim_param
                dim.ClearField("dim_param")
                if param in dims:
                    dim.dim_value = int(dims[param])


def _named_params(model: ModelProto) -> set[str]:
    return {
        d.dim_param
        for info in model.graph.input
        for d in info.type.tensor_type.shape.dim
        if d.WhichOneof("value") == "dim_param"
    }


def _weight(
    tensor: TensorProto, base: Path, located: Callable[[Path], tuple[Path, int | None]]
) -> Weight:
    shape = tuple(int(d) for d in tensor.dims)
    dtype = dtypes.dtype_name(tensor.data_type)
    if tensor.data_location != TensorProto.EXTERNAL:
        return Weight(tensor.name, shape, dtype, has_data=True, tensor=tensor)
    info = {entry.key: entry.value for entry in tensor.external_data}
    if not info.get("location"):
        raise ModelError(f"weight {tensor.name!r} has external data but no location")
    file, size = located(base / info["location"])
    if not file.is_relative_to(base):
        # A model must not make us read (or, in the REST service, leak) files outside its folder.
        raise ModelError(
            f"weight {tensor.name!r} points outside the model's folder: {info['location']!r}"
        )
    check_elements(shape, f"weight {tensor.name!r}")
    offset, length = _byte_field(tensor, info, "offset", 0), _byte_field(tensor, info, "length", -1)
    nbytes = dtypes.nbytes(dtype, math.prod(shape))
    if length >= 0 and length != nbytes:
        raise ModelError(
            f"weight {tensor.name!r}: its external data length is {length} bytes, but its "
            f"shape {list(shape)} of {dtype} needs {nbytes}"
        )
    if size is None:
        # No data file at all: a shape-only model, which still plans.
        return Weight(tensor.name, shape, dtype, False, file, offset, length)
    if size < offset + nbytes:
        raise ModelError(
            f"weight {tensor.name!r} needs bytes {offset}..{offset + nbytes} of its external "
            f"data file '{info['location']}', which has {size} bytes (truncated?)"
        )
    return Weight(tensor.name, shape, dtype, True, file, offset, length)


def _byte_field(tensor: TensorProto, info: Mapping[str, str], key: str, default: int) -> int:
    text = info.get(key)
    if text is None:
        return default
    if not text.strip().isdigit():
        raise ModelError(
            f"weight {tensor.name!r}: external data {key} {text!r} is not a byte count"
        )
    return int(text)


def _is_fold_source(weight: Weight) -> bool:
    """Small initializers with data start folding. Floating tensors of more than one element
    are parameters: folding them would turn a parameter into an anonymous constant, and the
    graph would then depend on whether the weight data is present."""
    if not weight.has_data or weight.size > FOLD_LIMIT:
        return False
    return weight.dtype not in dtypes.FLOAT_DTYPES or weight.size <= 1


def _attr_value(attr: AttributeProto) -> AttrValue:
    if attr.type == AttributeProto.TENSOR:
        return numpy_helper.to_array(attr.t)
    if attr.type in (AttributeProto.SPARSE_TENSOR, AttributeProto.SPARSE_TENSORS):
        raise ModelError(f"attribute {attr.name!r}: sparse tensor attributes are not supported")
    if attr.type == AttributeProto.TENSORS:
        return tuple(numpy_helper.to_array(t) for t in attr.tensors)
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, list):
        return tuple(
            v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v for v in value
        )
    if isinstance(value, onnx.TypeProto):
        return str(value)
    return value


def _op(node: NodeProto) -> Op:
    domain = "" if node.domain == "ai.onnx" else node.domain
    attrs = Attrs({a.name: _attr_value(a) for a in node.attribute})
    return Op(node.name, node.op_type, domain, tuple(node.input), tuple(node.output), attrs)


def _static_value(name: str, op: Op, folded: FoldResult) -> Value:
    known = folded.types.get(name)
    if known is None or not known.static or known.elem_type == 0:
        shape = "[unknown]" if known is None else str(known)
        if op.domain:
            why = f"; shape inference does not know op type {op.type!r} of domain {op.domain!r}"
        elif op.type in DATA_DEPENDENT:
            why = f"; {op.type} results have data-dependent shapes"
        elif op.name in folded.failures:
            why = f"; evaluating it failed: {folded.failures[op.name]}"
        else:  # lenient inference skipped a failing node: strict inference says which and why
            error = inference_error(folded.model)
            why = f"; shape inference: {error.removeprefix(_INFERENCE_PREFIX)}" if error else ""
        raise ModelError(
            f"value {name!r} (result of op '{op.name}' ({op.type})) has no static shape after "
            f"shape inference and folding: {shape}{why}"
        )
    return Value(name, known.dims, dtypes.dtype_name(known.elem_type))


def import_onnx(path: str | os.PathLike[str], dims: Mapping[str, int] | None = None) -> Graph:
    """The IR of the ONNX model at `path`, with the symbolic input dims bound by `dims`.

    Weights stay on disk (`Weight.load`); external data paths resolve relative to the model's
    directory and may be absent (a shape-only model). Raises ModelError (UnboundDimError for
    unbound dims) naming the model, op or value at fault.
    """
    model, opset = upgrade_opset(load_model(path), path)
    if model.graph.sparse_initializer:
        raise ModelError(f"model '{path}': sparse initializers are not supported")
    _check_unique_sources(model, path)
    weights = file_weights(model, path)
    light = _light_model(model)
    nodes = list(light.graph.node)
    name_nodes(nodes)
    _check_single_producers(nodes, weights, path)
    _reject_control_flow(nodes)
    _bind_dims(light, dims or {}, weights, path)
    inputs = [info for info in light.graph.input if info.name not in weights]
    nodes = _topological(nodes, {i.name for i in inputs} | set(weights), path)
    nodes, weights = _aliased_weights(nodes, weights, {o.name for o in light.graph.output})
    sources = {name: w.load() for name, w in weights.items() if _is_fold_source(w)}
    # Weights become typed graph inputs, sources initializers (fold_shapes adds them): inference
    # then sees every shape without any weight data in the proto.
    del light.graph.input[:], light.graph.node[:]
    light.graph.input.extend(inputs)
    light.graph.input.extend(
        helper.make_tensor_value_info(w.name, dtypes.onnx_type(w.dtype), w.shape)
        for w in weights.values()
        if w.name not in sources
    )
    light.graph.node.extend(nodes)
    folded = fold_shapes(light, sources)
    outputs = [o.name for o in light.graph.output]
    graph = _build_graph(folded, [i.name for i in inputs], outputs, weights, path)
    graph = dataclasses.replace(
        graph,
        name=model.graph.name or Path(path).stem,
        opset=opset,
        nodes_in_file=len(model.graph.node),
        buffers=exported_buffers(model) & weights.keys(),
    )
    verify(graph)  # cheap, and every later stage relies on these invariants
    return graph


def _build_graph(
    folded: FoldResult,
    inputs: list[str],
    outputs: list[str],
    weights: Mapping[str, Weight],
    path: object,
) -> Graph:
    """The Graph of a folded model (name and opset are filled in by the caller)."""
    values: dict[str, Value] = {}
    for name in inputs:
        known = folded.types.get(name)
        if known is None or not known.static:
            raise ModelError(f"graph input {name!r} has no static shape: {known}")
        values[name] = Value(name, known.dims, dtypes.dtype_name(known.elem_type))
    for w in weights.values():
        values[w.name] = Value(w.name, w.shape, w.dtype)
    constants = {k: v for k, v in folded.constants.items() if k not in weights}
    for name, array in constants.items():
        known = folded.types.get(name)
        elem_type = known.elem_type if known and known.elem_type else None
        dtype = dtypes.dtype_name(elem_type or helper.np_dtype_to_tensor_dtype(array.dtype))
        values[name] = Value(name, array.shape, dtype)
    ops = tuple(_op(node) for node in folded.nodes)
    for op in ops:
        for name in op.outputs:
            if name:
                values[name] = _static_value(name, op, folded)
    for name in outputs:
        if name not in values:
            raise ModelError(f"graph output {name!r} is not computed by any op of '{path}'")
    for value in values.values():
        check_elements(value.shape, f"value {value.name!r}")
    return Graph("", ops, values, tuple(inputs), tuple(outputs), weights, constants)

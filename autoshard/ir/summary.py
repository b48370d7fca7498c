"""What a model is, in one dict and one table: op histogram, parameters, inputs and outputs.

The dict (`summarize`) is what the REST service returns and tests compare; the text
(`format_summary`) is what `autoshard inspect` prints. Both are pure functions of the Graph.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from onnx import ModelProto

from autoshard.errors import UnboundDimError
from autoshard.ir.dtypes import dtype_name
from autoshard.ir.graph import Graph, Weight
from autoshard.ir.onnx_import import file_weights, import_onnx, load_model
from autoshard.ir.opset import check_opset

SUMMARY_KEYS = (
    "model",
    "nodes",
    "nodes_in_file",
    "op_types",
    "parameters",
    "parameter_bytes",
    "inputs",
    "outputs",
    "weights_available",
    "missing_data_files",
    "opset",
    "unbound_dims",
)


def summarize(graph: Graph) -> dict[str, Any]:
    """The summary dict, keys in `SUMMARY_KEYS` order; JSON-serializable.

    `nodes` counts the imported ops (after folding), `nodes_in_file` the file's nodes (None if
    the graph was not imported from a file). `parameters` counts every initializer's elements,
    as onnx would, and an Identity node's of an initializer as its own (the parameters a
    TorchScript export deduplicated, `ir.onnx_import`); `weights_available` is False when any
    weight's data is absent, and `missing_data_files` names the external data files that are
    not there.
    """
    tensors = [graph.values[name] for name in (*graph.inputs, *graph.outputs)]
    listed = [{"name": v.name, "shape": list(v.shape), "dtype": v.dtype} for v in tensors]
    return {
        "model": graph.name,
        "nodes": len(graph.ops),
        "nodes_in_file": graph.nodes_in_file,
        "op_types": _histogram(op.type for op in graph.ops),
        **_parameters(graph.weights.values()),
        "inputs": listed[: len(graph.inputs)],
        "outputs": listed[len(graph.inputs) :],
        "weights_available": all(w.has_data for w in graph.weights.values()),
        "missing_data_files": _missing_files(graph.weights.values()),
        "opset": graph.opset,
        "unbound_dims": {},
    }


def inspect_model(path: str | os.PathLike[str], dims: Mapping[str, int]) -> dict[str, Any]:
    """What `autoshard inspect` shows: the imported graph's summary, or, while symbolic dims are
    unbound, the file's own summary listing them (any other import error is raised)."""
    try:
        return summarize(import_onnx(path, dims))
    except UnboundDimError as error:
        model = load_model(path)
        opset = check_opset(model, path)
        return summarize_unbound(model, file_weights(model, path), opset, error.unbound, dims)


def summarize_unbound(
    model: ModelProto,
    weights: Mapping[str, Weight],
    opset: int,
    unbound: Mapping[str, list[str]],
    dims: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The summary of a model whose symbolic dims are not all bound: what the file says, before
    folding (which needs static shapes). Symbolic dims show as their names; `unbound_dims` maps
    each unbound name to the `input[axis]` places that carry it; dims already bound show their
    sizes."""
    bound = dict(dims or {})

    def tensors(infos: Any) -> list[dict[str, Any]]:
        return [
            {
                "name": info.name,
                "shape": [
                    d.dim_value
                    if d.HasField("dim_value")
                    else bound.get(d.dim_param, d.dim_param or "?")
                    for d in info.type.tensor_type.shape.dim
                ],
                "dtype": dtype_name(info.type.tensor_type.elem_type),
            }
            for info in infos
            if info.name not in weights
        ]

    return {
        "model": model.graph.name,
        "nodes": len(model.graph.node),
        "nodes_in_file": len(model.graph.node),
        "op_types": _histogram(node.op_type for node in model.graph.node),
        **_parameters(weights.values()),
        "inputs": tensors(model.graph.input),
        "outputs": tensors(model.graph.output),
        "weights_available": all(w.has_data for w in weights.values()),
        "missing_data_files": _missing_files(weights.values()),
        "opset": opset,
        "unbound_dims": {name: list(places) for name, places in sorted(unbound.items())},
    }


def _histogram(types: Iterable[str]) -> dict[str, int]:
    return dict(sorted(Counter(types).items()))


def _parameters(weights: Iterable[Weight]) -> dict[str, int]:
    weights = list(weights)
    return {
        "parameters": sum(w.size for w in weights),
        "parameter_bytes": sum(w.nbytes for w in weights),
    }


def human_count(n: int) -> str:
    """`1234567` → `1.23 M` (powers of 1000; plain digits below 1000)."""
    for unit, scale in (("T", 10**12), ("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def _missing_files(weights: Iterable[Weight]) -> list[str]:
    """The external data files the weights name that are absent, by name."""
    return sorted({w.external.name for w in weights if not w.has_data and w.external})


def human_bytes(n: int) -> str:
    """`4928307` → `4.7 MiB` (powers of 1024)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _tensor(entry: dict[str, Any]) -> str:
    return f"{entry['dtype']}[{', '.join(str(d) for d in entry['shape'])}]"


def format_summary(summary: dict[str, Any]) -> str:
    """A text table of a `summarize` dict, columns aligned, ending without a newline."""
    in_file = summary.get("nodes_in_file")
    from_file = f" ({in_file} nodes in file)" if in_file is not None else ""
    lines = [
        f"model {summary['model']}: {summary['nodes']} ops{from_file}, opset {summary['opset']}"
    ]
    missing = summary["missing_data_files"]
    data = "" if summary["weights_available"] else " (shape-only: weight data absent)"
    if missing:  # the model's .data file(s) left behind when it was copied, most likely
        data = data[:-1] + f"; not found beside the model: {', '.join(missing)})"
    lines.append(
        f"parameters: {human_count(summary['parameters'])} "
        f"({human_bytes(summary['parameter_bytes'])}){data}"
    )
    op_types = summary["op_types"]
    if op_types:
        lines.append("op types:")
        width = max(len(t) for t in op_types)
        count_width = max(len(str(c)) for c in op_types.values())
        lines += [f"  {t:<{width}}  {c:>{count_width}}" for t, c in op_types.items()]
    for title in ("inputs", "outputs"):
        entries = summary[title]
        lines.append(f"{title}:")
        width = max((len(e["name"]) for e in entries), default=0)
        lines += [f"  {e['name']:<{width}}  {_tensor(e)}" for e in entries]
    unbound = summary.get("unbound_dims")
    if unbound:
        lines.append("unbound dims (ops are counted as in the file; bind with --dim NAME=SIZE):")
        width = max(len(name) for name in unbound)
        lines += [f"  {name:<{width}}  {', '.join(places)}" for name, places in unbound.items()]
    return "\n".join(lines)

"""The model's opset: checked, and upgraded to MIN_OPSET when older.

autoshard's rules and folding are written for opset 13 and later (where Unsqueeze, Squeeze,
Split and ReduceSum take their axes as inputs); models of opsets 7 to 12 (the ONNX model zoo's
CNNs are opset 9) are brought forward by `onnx.version_converter`, and a conversion that
fails names the op that blocked it.
"""

from __future__ import annotations

import re

import onnx
from onnx import ModelProto, helper, version_converter

from autoshard.errors import ModelError

MIN_OPSET = 13
MIN_UPGRADED_OPSET = 7


def check_opset(model: ModelProto, path: object) -> int:
    """The model's default-domain opset; ModelError if it has none or one below
    MIN_UPGRADED_OPSET (older ones are upgraded on import, `upgrade_opset`)."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        raise ModelError(f"model '{path}' imports no default-domain opset")
    if opset < MIN_UPGRADED_OPSET:
        raise ModelError(
            f"model '{path}' uses opset {opset}; autoshard reads opset >= {MIN_OPSET} and "
            f"upgrades opsets {MIN_UPGRADED_OPSET} to {MIN_OPSET - 1} (re-export with a newer "
            "opset)"
        )
    return opset


def upgrade_opset(model: ModelProto, path: object) -> tuple[ModelProto, int]:
    """The model with its nodes at opset >= MIN_OPSET, and that opset: an older model's nodes
    are upgraded by `onnx.version_converter` (the model zoo's CNNs are opset 9). The converter
    sees the skeleton only, weights as typed graph inputs: initializers (and their external
    data references) are left as the file has them. ModelError names the op that blocks it."""
    opset = check_opset(model, path)
    if opset >= MIN_OPSET:
        return model, opset
    graph = model.graph
    skeleton = helper.make_model(
        helper.make_graph(
            list(graph.node), graph.name, _typed_inputs(graph), list(graph.output),
            value_info=list(graph.value_info),
        ),
        opset_imports=list(model.opset_import), ir_version=model.ir_version,
    )  # fmt: skip
    try:
        converted = version_converter.convert_version(skeleton, MIN_OPSET)
    except Exception as exc:  # noqa: BLE001 - the converter raises RuntimeError, ValueError...
        raise ModelError(
            f"model '{path}' uses opset {opset}; upgrading it to opset {MIN_OPSET} failed: "
            f"{_blocking_op(model, opset, exc)} (re-export with opset >= {MIN_OPSET})"
        ) from None
    upgraded = ModelProto()
    upgraded.CopyFrom(model)
    del upgraded.graph.node[:], upgraded.graph.value_info[:], upgraded.opset_import[:]
    upgraded.graph.node.extend(converted.graph.node)
    upgraded.graph.value_info.extend(converted.graph.value_info)
    upgraded.opset_import.extend(converted.opset_import)
    return upgraded, MIN_OPSET


def _typed_inputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs, and every initializer not among them as a typed input."""
    listed = {info.name for info in graph.input}
    return list(graph.input) + [
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in graph.initializer
        if t.name not in listed
    ]


def _blocking_op(model: ModelProto, opset: int, error: Exception) -> str:
    """Which op the version converter could not upgrade: the first whose type has no schema,
    else the first that fails alone; the converter's own words if none does."""
    nodes = list(model.graph.node)
    for index, node in enumerate(nodes):
        if not onnx.defs.has(node.op_type, node.domain):
            name = node.name or f"{node.op_type}_{index}"
            return f"op '{name}' ({node.op_type}) is not an operator of this ONNX version"
    for index, node in enumerate(nodes):
        alone = helper.make_model(
            helper.make_graph(
                [node], "one", [helper.make_tensor_value_info(i, 0, None) for i in node.input if i],
                [helper.make_tensor_value_info(o, 0, None) for o in node.output if o],
            ),
            opset_imports=[helper.make_opsetid("", opset)],
        )  # fmt: skip
        try:
            version_converter.convert_version(alone, MIN_OPSET)
        except Exception as exc:  # noqa: BLE001
            name = node.name or f"{node.op_type}_{index}"
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            # The converter's C++ asserts say where in its source they fired: not for users.
            reason = re.sub(r"^.*?Assertion `.*?` failed: ", "", reason)
            return f"op '{name}' ({node.op_type}) cannot be converted: {reason}"
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__

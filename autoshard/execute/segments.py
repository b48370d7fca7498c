"""A device program cut into segments: the local ops between two collectives, each an ONNX model.

One device's program (`DeviceProgram.steps`) is local ops with collectives between them. The
ops from one collective to the next are a *segment*; it is run as one onnxruntime session,
built from an ONNX model of just those ops with the device's local shapes. Both executors use
these: `autoshard verify` (every device in one process, sessions cached by `Segment.key`) and
`autoshard partition`, which writes each segment's model to a file for `autoshard run`.

A segment reads the tensors computed before it (`inputs`, fed at run time: graph inputs,
weights, earlier results) and the constants it needs (`embedded`, built into its model: the
program's replicated constants and the device's own, such as rewritten Reshape targets and
lookup offsets). It returns only what a later step or the program's outputs read.

Worked example (the MLP of docs/design/lowering.md on mesh [2]): device 0's program is
    x~1 = all_gather(x); h = MatMul(x~1, w1); r = Max(h, zero); y = MatMul(r, w2);
    y~1 = reduce_scatter(y)
which cuts into segment 0 (no ops) before the all_gather, segment 1 (MatMul, Max, MatMul
reading x~1, w1, w2, embedding `zero`, returning y) before the reduce_scatter, and segment 2
(no ops) at the end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from autoshard.ir import dtypes
from autoshard.ir.graph import Op
from autoshard.passes.partition import DeviceProgram, LocalCollective, LocalCompute, Partitioned

IR_VERSION = 10


@dataclass(frozen=True)
class Segment:
    """The local ops of one device between two collectives (`collective`: the one after it,
    None for the last segment)."""

    ops: tuple[Op, ...]
    inputs: tuple[str, ...]
    embedded: tuple[str, ...]
    outputs: tuple[str, ...]
    collective: LocalCollective | None
    key: tuple[Any, ...]
    """Equal for segments whose models are equal (ops, shapes, types, constant values)."""

    @property
    def empty(self) -> bool:
        """Nothing to run: no ops, or none whose results anyone reads."""
        return not self.outputs


def cut(partitioned: Partitioned, device: DeviceProgram) -> list[Segment]:
    """The device's program as segments, one more than its collectives."""
    steps = device.steps
    last_use: dict[str, int] = {}
    for i, step in enumerate(steps):
        for name in step.inputs:
            if name:
                last_use[name] = i
    for name in partitioned.program.outputs:
        last_use[name] = len(steps)
    out: list[Segment] = []
    start = 0
    for end in range(len(steps) + 1):
        if end < len(steps) and isinstance(steps[end], LocalCompute):
            continue
        collective = steps[end] if end < len(steps) else None
        assert collective is None or isinstance(collective, LocalCollective)
        ops = tuple(s.op for s in steps[start:end] if isinstance(s, LocalCompute))
        out.append(_segment(partitioned, device, ops, end, last_use, collective))
        start = end + 1
    return out


def _segment(
    partitioned: Partitioned,
    device: DeviceProgram,
    ops: tuple[Op, ...],
    end: int,
    last_use: Mapping[str, int],
    collective: LocalCollective | None,
) -> Segment:
    produced: set[str] = set()
    reads: dict[str, None] = {}
    for op in ops:
        for name in op.inputs:
            if name and name not in produced:
                reads[name] = None
        produced.update(n for n in op.outputs if n)
    shared = partitioned.program.constants
    embedded = tuple(n for n in reads if n in shared or n in device.constants)
    inputs = tuple(n for n in reads if n not in embedded)
    outputs = tuple(n for op in ops for n in op.outputs if n and last_use.get(n, -1) >= end)
    shapes, types = device.shapes, partitioned.dtypes
    # A program constant is one object for every device: its name says its value. A device's
    # own constant is told by its bytes, so devices whose constants agree share a session.
    values = tuple(
        (n, device.constants[n].shape, device.constants[n].tobytes())
        if n in device.constants
        else (n,)
        for n in embedded
    )
    key = (
        ops,
        tuple((n, shapes[n], types[n]) for n in inputs),
        values,
        tuple((n, shapes[n]) for n in outputs),
    )
    return Segment(ops, inputs, embedded, outputs, collective, key)


def model(
    partitioned: Partitioned, device: DeviceProgram, segment: Segment, opset: int
) -> onnx.ModelProto:
    """The segment as an ONNX model: its inputs and outputs with the device's local shapes,
    its constants as initializers (the device's own value where it has one)."""
    shapes, types = device.shapes, partitioned.dtypes
    shared = partitioned.program.constants
    domains = {op.domain for op in segment.ops if op.domain not in ("", "ai.onnx")}
    initializers = [
        numpy_helper.from_array(np.asarray(device.constants.get(n, shared.get(n))), n)
        for n in segment.embedded
    ]
    graph = helper.make_graph(
        [_node(op, opset) for op in segment.ops],
        "segment",
        [_info(n, types[n], shapes[n]) for n in segment.inputs],
        [_info(n, types[n], shapes[n]) for n in segment.outputs],
        initializers,
    )
    opsets = [helper.make_opsetid("", opset)]
    opsets += [helper.make_opsetid(d, 1) for d in sorted(domains)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION)


def constants_model(values: Mapping[str, Any], opset: int) -> onnx.ModelProto:
    """A model of no inputs that returns `values` (the constants a collective reads)."""
    nodes = [
        helper.make_node("Constant", [], [n], f"{n}/constant",
                         value=numpy_helper.from_array(np.asarray(v), n))
        for n, v in values.items()
    ]  # fmt: skip
    outputs = [
        helper.make_tensor_value_info(
            n, helper.np_dtype_to_tensor_dtype(np.asarray(v).dtype), list(np.shape(v))
        )
        for n, v in values.items()
    ]
    graph = helper.make_graph(nodes, "constants", [], outputs)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION
    )


def _attribute(op: Op, key: str, value: Any, opset: int) -> onnx.AttributeProto:
    if isinstance(value, np.ndarray):
        return helper.make_attribute(key, numpy_helper.from_array(value))
    if isinstance(value, tuple) and value and isinstance(value[0], np.ndarray):
        return helper.make_attribute(key, [numpy_helper.from_array(v) for v in value])
    if isinstance(value, tuple) and not value:  # an empty list: its type is in the schema
        schema = onnx.defs.get_schema(op.type, opset, op.domain)
        kind: Any = schema.attributes[key].type
        return helper.make_attribute(key, [], attr_type=kind.value)
    return helper.make_attribute(key, list(value) if isinstance(value, tuple) else value)


def _node(op: Op, opset: int) -> onnx.NodeProto:
    node = helper.make_node(op.type, list(op.inputs), list(op.outputs), op.name, domain=op.domain)
    node.attribute.extend(_attribute(op, k, v, opset) for k, v in op.attrs.items())
    return node


def _info(name: str, dtype: str, shape: Sequence[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtypes.onnx_type(dtype), list(shape))

"""Run a partitioned program on every device in one process and check it against the model.

Each device runs its own local program (`DeviceProgram`): local ops with onnxruntime,
collectives with `autoshard.simulate` (seed 003's semantics, device groups in order), its
weights from its own file. The outputs are reassembled from the devices' shards (partial ones
reduced, replicas checked to agree) and compared with onnxruntime on the original model.

Speed: the ops between two collectives run as one onnxruntime session, built from an ONNX
model of just those ops with the device's local shapes. Sessions are cached by structure and
shapes, so the devices of an even split share them: GPT-2 on 8 devices builds each session
once. Every local result is checked against the shape the partition gave it, so a wrong
rewrite fails loudly where it happens, not as a numerical difference at the end.

Errors: the max absolute error of an output is max|a - b|; the relative one divides it by
max(max|b|, tiny), b the reference, so near-zero elements do not blow it up. NaNs count as equal
where both sides have them. Default tolerance (relative): 1e-5 for float32, 1e-9 for float64,
1e-2 for 16-bit floats, exact for integers and booleans.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from autoshard.errors import AutoshardError
from autoshard.ir import dtypes
from autoshard.ir.graph import Graph, Op
from autoshard.passes.partition import DeviceProgram, LocalCollective, LocalCompute, Partitioned
from autoshard.reshard import Collective, CollectiveKind
from autoshard.sharding import Sharding
from autoshard.simulate import run_collective
from autoshard.weights import weight_array

TINY = 1e-30
TOLERANCES = {"float32": 1e-5, "float64": 1e-9, "float16": 1e-2, "bfloat16": 1e-2}
# Ops an id flows through unchanged on its way to a lookup (to bound random token ids).
_ID_PASSING = frozenset(
    {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast", "Identity", "Expand", "Transpose"}
)


class VerifyError(AutoshardError):
    """Inputs that do not fit the model, or a device program that cannot run as partitioned."""


@dataclass(frozen=True)
class OutputCheck:
    """How far one reassembled output is from the reference."""

    max_abs_err: float
    max_rel_err: float
    tolerance: float
    max_replica_err: float = 0.0

    @property
    def ok(self) -> bool:
        return self.max_rel_err <= self.tolerance and self.max_replica_err <= self.tolerance

    def to_json(self) -> dict[str, object]:
        return {
            "max_abs_err": self.max_abs_err,
            "max_rel_err": self.max_rel_err,
            "tolerance": self.tolerance,
            "max_replica_err": self.max_replica_err,
            "ok": self.ok,
        }


@dataclass(frozen=True)
class Report:
    outputs: Mapping[str, OutputCheck]
    devices: int
    sessions: int = 0

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.outputs.values())

    def to_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "outputs": {name: check.to_json() for name, check in self.outputs.items()},
            "devices": self.devices,
            "sessions": self.sessions,
        }


# ---- inputs -----------------------------------------------------------------------------------


def id_bound(graph: Graph, name: str) -> int | None:
    """The number of rows of the smallest table `name` indexes (through reshapes and casts),
    or None if it indexes none: random ids must stay below it."""
    bound: int | None = None
    frontier, seen = [name], {name}
    while frontier:
        value = frontier.pop()
        for op in graph.consumers(value):
            if op.type == "Gather" and len(op.inputs) > 1 and op.inputs[1] == value:
                data = graph.values[op.inputs[0]].shape
                axis = op.attr("axis", 0)
                assert isinstance(axis, int)
                rows = data[axis % len(data)]
                bound = rows if bound is None else min(bound, rows)
            elif op.type in _ID_PASSING and op.inputs[0] == value:
                for out in op.outputs:
                    if out and out not in seen:
                        seen.add(out)
                        frontier.append(out)
    return bound


def random_inputs(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs: floats standard normal, ids below the table they index, other integers
    and booleans 0 or 1 (masks)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in graph.inputs:
        value = graph.values[name]
        numpy_type = dtypes.numpy_dtype(value.dtype)
        if numpy_type.kind == "f":
            out[name] = rng.standard_normal(value.shape).astype(numpy_type)
        elif numpy_type.kind in "iu":
            high = id_bound(graph, name) or 2
            out[name] = rng.integers(0, high, value.shape).astype(numpy_type)
        elif numpy_type.kind == "b":
            out[name] = rng.integers(0, 2, value.shape).astype(bool)
        else:
            raise VerifyError(f"cannot make random values for input {name!r} of {value.dtype}")
    return out


def check_inputs(graph: Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The given inputs, checked against the graph's (bound) input shapes and dtypes."""
    missing = [n for n in graph.inputs if n not in inputs]
    if missing:
        raise VerifyError(
            f"inputs lack {', '.join(missing)}; the model's inputs: {', '.join(graph.inputs)}"
        )
    out = {}
    for name in graph.inputs:
        value, array = graph.values[name], np.asarray(inputs[name])
        if array.shape != value.shape:
            raise VerifyError(
                f"input {name!r} has shape {list(array.shape)}; the partition was made for "
                f"{list(value.shape)}"
            )
        if array.dtype != dtypes.numpy_dtype(value.dtype):
            raise VerifyError(f"input {name!r} is {array.dtype}; the model takes {value.dtype}")
        out[name] = array
    return out


def model_weights(graph: Graph, partitioned: Partitioned) -> Callable[[int], dict[str, np.ndarray]]:
    """Each device's weights cut from the model's own (views, no weight files): for checking
    a partition in memory."""

    def load(index: int) -> dict[str, np.ndarray]:
        return {
            name: weight_array(weight)[
                tuple(slice(a, b) for a, b in partitioned.slices(name, index))
            ]
            for name, weight in graph.weights.items()
        }

    return load


# ---- onnxruntime ------------------------------------------------------------------------------


def _session_options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return options


def reference_outputs(
    model: str | os.PathLike[str], inputs: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """onnxruntime on the original model file."""
    try:
        session = ort.InferenceSession(
            os.fspath(model), _session_options(), providers=["CPUExecutionProvider"]
        )
    except Exception as error:  # onnxruntime raises its own exception types
        # onnxruntime's message ends with the reason after its C++ location: keep that.
        reason = str(error).splitlines()[0].rpartition(" : ")[2].rpartition(") ")[2]
        raise VerifyError(f"onnxruntime cannot load {model}: {reason}") from None
    names = [o.name for o in session.get_outputs()]
    feed = {i.name: inputs[i.name] for i in session.get_inputs()}
    return dict(zip(names, session.run(names, feed), strict=True))


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


@dataclass
class _Segment:
    """The local ops of one device between two collectives, as one session's work."""

    ops: tuple[Op, ...]
    inputs: tuple[str, ...]  # fed at run time
    embedded: tuple[str, ...]  # program constants, built into the model
    outputs: tuple[str, ...]  # read after the segment
    collective: LocalCollective | None  # the collective that follows
    key: tuple[Any, ...] = field(default=())


class _Executor:
    def __init__(self, partitioned: Partitioned, opset: int) -> None:
        self.partitioned, self.opset = partitioned, opset
        self.program = partitioned.program
        self.sessions: dict[tuple[Any, ...], ort.InferenceSession] = {}

    def segments(self, device: DeviceProgram) -> list[_Segment]:
        steps = device.steps
        last_use: dict[str, int] = {}
        for i, step in enumerate(steps):
            for name in step.inputs:
                if name:
                    last_use[name] = i
        for name in self.program.outputs:
            last_use[name] = len(steps)
        out: list[_Segment] = []
        start = 0
        for end in range(len(steps) + 1):
            if end < len(steps) and isinstance(steps[end], LocalCompute):
                continue
            collective = steps[end] if end < len(steps) else None
            assert collective is None or isinstance(collective, LocalCollective)
            ops = tuple(s.op for s in steps[start:end] if isinstance(s, LocalCompute))
            out.append(self.segment(device, ops, end, last_use, collective))
            start = end + 1
        return out

    def segment(
        self,
        device: DeviceProgram,
        ops: tuple[Op, ...],
        end: int,
        last_use: Mapping[str, int],
        collective: LocalCollective | None,
    ) -> _Segment:
        produced: set[str] = set()
        reads: dict[str, None] = {}
        for op in ops:
            for name in op.inputs:
                if name and name not in produced:
                    reads[name] = None
            produced.update(n for n in op.outputs if n)
        constants = self.program.constants
        embedded = tuple(n for n in reads if n in constants and n not in device.constants)
        inputs = tuple(n for n in reads if n not in embedded)
        outputs = tuple(n for op in ops for n in op.outputs if n and last_use.get(n, -1) >= end)
        shapes, types = device.shapes, self.partitioned.dtypes
        key = (
            ops,
            tuple((n, shapes[n], types[n]) for n in inputs),
            embedded,
            tuple((n, shapes[n]) for n in outputs),
        )
        return _Segment(ops, inputs, embedded, outputs, collective, key)

    def session(self, device: DeviceProgram, segment: _Segment) -> ort.InferenceSession:
        cached = self.sessions.get(segment.key)
        if cached is not None:
            return cached
        shapes, types = device.shapes, self.partitioned.dtypes
        domains = {op.domain for op in segment.ops if op.domain not in ("", "ai.onnx")}
        graph = helper.make_graph(
            [_node(op, self.opset) for op in segment.ops],
            "segment",
            [_info(n, types[n], shapes[n]) for n in segment.inputs],
            [_info(n, types[n], shapes[n]) for n in segment.outputs],
            [numpy_helper.from_array(np.asarray(self.program.constants[n]), n)
             for n in segment.embedded],
        )  # fmt: skip
        opsets = [helper.make_opsetid("", self.opset)]
        opsets += [helper.make_opsetid(d, 1) for d in sorted(domains)]
        model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
        try:
            session = ort.InferenceSession(
                model.SerializeToString(), _session_options(), providers=["CPUExecutionProvider"]
            )
        except Exception as error:  # onnxruntime raises its own untyped errors
            first = segment.ops[0].name if segment.ops else "?"
            raise VerifyError(
                f"device {device.index}: onnxruntime rejects the local ops from '{first}': "
                f"{str(error).splitlines()[0]}"
            ) from None
        self.sessions[segment.key] = session
        return session

    def run(
        self,
        inputs: Mapping[str, np.ndarray],
        weights: Callable[[int], Mapping[str, np.ndarray]],
    ) -> list[dict[str, np.ndarray]]:
        """Every device's tensors after the program ran (those still live at the end)."""
        partitioned, program = self.partitioned, self.program
        mesh = partitioned.mesh
        envs: list[dict[str, np.ndarray]] = []
        for device in partitioned.devices:
            env: dict[str, np.ndarray] = dict(program.constants)
            env.update(device.constants)
            own = weights(device.index)
            for name in program.inputs:
                if name in inputs:
                    region = partitioned.slices(name, device.index)
                    env[name] = np.asarray(inputs[name][tuple(slice(a, b) for a, b in region)])
                elif name in own:
                    env[name] = np.asarray(own[name])
                else:
                    raise VerifyError(f"device {device.index} has no weight {name!r}")
                self.expect(device, name, env[name])
            envs.append(env)
        plans = [self.segments(d) for d in partitioned.devices]
        for k in range(len(plans[0])):
            for device, plan, env in zip(partitioned.devices, plans, envs, strict=True):
                segment = plan[k]
                if not segment.outputs:  # nothing, or nothing anyone reads
                    continue
                session = self.session(device, segment)
                feed = {n: env[n] for n in segment.inputs}
                try:
                    results = session.run(list(segment.outputs), feed)
                except Exception as error:  # onnxruntime's own error types
                    raise VerifyError(
                        f"device {device.index}: running the local ops from "
                        f"'{segment.ops[0].name}' failed: {str(error).splitlines()[0]}"
                    ) from None
                for name, array in zip(segment.outputs, results, strict=True):
                    self.expect(device, name, array)
                    env[name] = array
            step = plans[0][k].collective
            if step is None:
                continue
            local = {
                d.device: env[step.source] for d, env in zip(partitioned.devices, envs, strict=True)
            }
            moved = run_collective(step.collective, mesh, local)
            for device, env in zip(partitioned.devices, envs, strict=True):
                self.expect(device, step.target, moved[device.device])
                env[step.target] = moved[device.device]
        return envs

    def expect(self, device: DeviceProgram, name: str, array: np.ndarray) -> None:
        want = device.shapes[name]
        if tuple(array.shape) != tuple(want):
            raise VerifyError(
                f"device {device.index}: tensor {name!r} has local shape {list(array.shape)}; "
                f"the partition says {list(want)}"
            )


# ---- outputs ----------------------------------------------------------------------------------


def assemble(
    partitioned: Partitioned, name: str, local: Sequence[np.ndarray]
) -> tuple[np.ndarray, float]:
    """The global value of tensor `name` from every device's local array (partial values
    reduced over their axes first); also the largest difference between replicas."""
    mesh = partitioned.mesh
    tensor = partitioned.program.tensors[name]
    sharding = tensor.sharding
    arrays = list(local)
    if sharding.partial_axes:
        reduce = Collective(
            CollectiveKind.ALL_REDUCE,
            sharding.partial_axes,
            sharding,
            Sharding(sharding.split_axes),
            tensor.shape,
            0,
            reduction=sharding.partial_type,
        )
        devices = list(mesh.devices())
        reduced = run_collective(reduce, mesh, dict(zip(devices, arrays, strict=True)))
        arrays = [reduced[d] for d in devices]
    out = np.zeros(tensor.shape, arrays[0].dtype)
    seen: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
    replica = 0.0
    for index, array in enumerate(arrays):
        region = partitioned.slices(name, index)
        if region in seen:
            replica = max(replica, _max_abs(array, seen[region]))
            continue
        seen[region] = array
        out[tuple(slice(a, b) for a, b in region)] = array
    return out, replica


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    if a.size == 0:
        return 0.0
    if a.dtype.kind == "b":
        return float(np.count_nonzero(a != b))
    x, y = a.astype(np.float64), b.astype(np.float64)
    diff = np.abs(x - y)
    diff[np.isnan(x) & np.isnan(y)] = 0.0
    diff[np.isnan(diff)] = np.inf
    return float(diff.max())


def compare(
    actual: np.ndarray, expected: np.ndarray, tolerance: float, replica: float = 0.0
) -> OutputCheck:
    """Errors of `actual` against `expected`, relative to the largest finite |expected|;
    `replica` (the largest difference between devices holding the same shard) likewise."""
    if actual.shape != expected.shape:
        raise VerifyError(
            f"reassembled shape {list(actual.shape)} differs from the reference "
            f"{list(expected.shape)}"
        )
    absolute = _max_abs(actual, expected)
    scale = max(_scale(expected), TINY)
    return OutputCheck(absolute, absolute / scale, tolerance, replica / scale)


def tolerance_for(dtype: str, rtol: float | None) -> float:
    if rtol is not None:
        return rtol
    return TOLERANCES.get(dtype, 0.0)


def verify(
    partitioned: Partitioned,
    graph: Graph,
    model: str | os.PathLike[str],
    weights: Callable[[int], Mapping[str, np.ndarray]],
    inputs: Mapping[str, np.ndarray] | None = None,
    rtol: float | None = None,
    seed: int = 0,
    reference: Mapping[str, np.ndarray] | None = None,
) -> Report:
    """Run `partitioned` on all devices (device k's weights from `weights(k)`) and compare its
    outputs with onnxruntime on `model`, on `inputs` or seeded random ones (`reference`: the
    model's outputs on those, when already known)."""
    feed = check_inputs(graph, inputs) if inputs is not None else random_inputs(graph, seed)
    executor = _Executor(partitioned, graph.opset)
    envs = executor.run(feed, weights)
    if reference is None:
        reference = reference_outputs(model, feed)
    checks: dict[str, OutputCheck] = {}
    for value, name in zip(graph.outputs, partitioned.program.outputs, strict=True):
        actual, replica = assemble(partitioned, name, [env[name] for env in envs])
        tolerance = tolerance_for(graph.values[value].dtype, rtol)
        checks[value] = compare(actual, np.asarray(reference[value]), tolerance, replica)
    return Report(checks, len(partitioned.devices), len(executor.sessions))


def _scale(array: np.ndarray) -> float:
    """The largest finite |element| (0 for an empty or boolean array)."""
    if array.size == 0 or array.dtype.kind not in "fiu":
        return 0.0
    values = np.abs(array.astype(np.float64))
    values = values[np.isfinite(values)]
    return float(values.max()) if values.size else 0.0

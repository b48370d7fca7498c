"""Run a partitioned program on every device in one process and check it against the model.

Each device runs its own local program (`DeviceProgram`): local ops with onnxruntime,
collectives with `autoshard.execute.simulate` (the dialect's semantics, device groups in order), its
weights from its own file. The outputs are reassembled from the devices' shards (partial ones
reduced, replicas checked to agree) and compared with onnxruntime on the original model.

Speed: the ops between two collectives run as one onnxruntime session, built from an ONNX
model of just those ops with the device's local shapes. Sessions are cached by structure and
shapes, so the devices of an even split share them: GPT-2 on 8 devices builds each session
once. Every local result is checked against the shape the partition gave it, so a wrong
rewrite fails loudly where it happens, not as a numerical difference at the end.

Errors: the max absolute error of an output is max|a - b|; the relative one divides it by
max(max|b|, tiny), b the reference, so near-zero elements do not blow it up. NaNs, and
infinities of one sign (a masked attention score's -inf), count as equal where both sides have
them. Default tolerance (relative): 1e-5 for float32, 1e-9 for float64, 1e-2 for 16-bit floats,
exact for integers and booleans.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from autoshard.collectives import Collective, CollectiveKind
from autoshard.errors import AutoshardError
from autoshard.execute import segments
from autoshard.execute.segments import Segment
from autoshard.execute.simulate import run_collective
from autoshard.ir import dtypes
from autoshard.ir.graph import Graph
from autoshard.mesh import Mesh
from autoshard.passes.partition import DeviceProgram, Partitioned, device_slices
from autoshard.sharding import Sharding
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


@dataclass(frozen=True)
class InputSpec:
    """A graph input as a partition expects it; `high` bounds random ids (the rows of the
    table they index)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    high: int | None = None


def input_specs(graph: Graph) -> tuple[InputSpec, ...]:
    return tuple(
        InputSpec(n, graph.values[n].dtype, graph.values[n].shape, id_bound(graph, n))
        for n in graph.inputs
    )


def random_inputs(graph: Graph | Sequence[InputSpec], seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs: floats standard normal, ids below the table they index, other integers
    and booleans 0 or 1 (masks)."""
    specs = input_specs(graph) if isinstance(graph, Graph) else graph
    rng = np.random.default_rng(seed)
    out = {}
    for spec in specs:
        numpy_type = dtypes.numpy_dtype(spec.dtype)
        if numpy_type.kind == "f":
            out[spec.name] = rng.standard_normal(spec.shape).astype(numpy_type)
        elif numpy_type.kind in "iu":
            out[spec.name] = rng.integers(0, spec.high or 2, spec.shape).astype(numpy_type)
        elif numpy_type.kind == "b":
            out[spec.name] = rng.integers(0, 2, spec.shape).astype(bool)
        else:
            raise VerifyError(f"cannot make random values for input {spec.name!r} of {spec.dtype}")
    return out


def check_inputs(
    graph: Graph | Sequence[InputSpec], inputs: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The given inputs, checked against the graph's (bound) input shapes and dtypes."""
    specs = input_specs(graph) if isinstance(graph, Graph) else graph
    names = [s.name for s in specs]
    missing = [n for n in names if n not in inputs]
    if missing:
        raise VerifyError(
            f"inputs lack {', '.join(missing)}; the model's inputs: {', '.join(names)}"
        )
    out = {}
    for spec in specs:
        array = np.asarray(inputs[spec.name])
        if array.shape != tuple(spec.shape):
            raise VerifyError(
                f"input {spec.name!r} has shape {list(array.shape)}; the partition was made for "
                f"{list(spec.shape)}"
            )
        if array.dtype != dtypes.numpy_dtype(spec.dtype):
            raise VerifyError(f"input {spec.name!r} is {array.dtype}; the model takes {spec.dtype}")
        out[spec.name] = array
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


def session_options() -> ort.SessionOptions:
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
            os.fspath(model), session_options(), providers=["CPUExecutionProvider"]
        )
    except Exception as error:  # onnxruntime raises its own exception types
        # onnxruntime's message ends with the reason after its C++ location: keep that.
        reason = str(error).splitlines()[0].rpartition(" : ")[2].rpartition(") ")[2]
        raise VerifyError(f"onnxruntime cannot load {model}: {reason}") from None
    names = [o.name for o in session.get_outputs()]
    feed = {i.name: inputs[i.name] for i in session.get_inputs()}
    return dict(zip(names, session.run(names, feed), strict=True))


class _Executor:
    def __init__(self, partitioned: Partitioned, opset: int) -> None:
        self.partitioned, self.opset = partitioned, opset
        self.program = partitioned.program
        self.sessions: dict[tuple[Any, ...], ort.InferenceSession] = {}

    def session(self, device: DeviceProgram, segment: Segment) -> ort.InferenceSession:
        cached = self.sessions.get(segment.key)
        if cached is not None:
            return cached
        model = segments.model(self.partitioned, device, segment, self.opset)
        try:
            session = ort.InferenceSession(
                model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"]
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
        plans = [segments.cut(partitioned, d) for d in partitioned.devices]
        for k in range(len(plans[0])):
            for device, plan, env in zip(partitioned.devices, plans, envs, strict=True):
                segment = plan[k]
                if segment.empty:
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
    tensor = partitioned.program.tensors[name]
    return assemble_value(partitioned.mesh, tensor.sharding, tensor.shape, local)


def assemble_value(
    mesh: Mesh, sharding: Sharding, shape: tuple[int, ...], local: Sequence[np.ndarray]
) -> tuple[np.ndarray, float]:
    """A global tensor of `shape` held in `sharding` from every device's local array, in
    linear device order; also the largest difference between replicas."""
    arrays = list(local)
    devices = list(mesh.devices())
    if sharding.partial_axes:
        reduce = Collective(
            CollectiveKind.ALL_REDUCE,
            sharding.partial_axes,
            sharding,
            Sharding(sharding.split_axes),
            shape,
            0,
            reduction=sharding.partial_type,
        )
        reduced = run_collective(reduce, mesh, dict(zip(devices, arrays, strict=True)))
        arrays = [reduced[d] for d in devices]
    out = np.zeros(shape, arrays[0].dtype)
    seen: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
    replica = 0.0
    for region, array in zip(device_slices(sharding, shape, mesh), arrays, strict=True):
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
    x, y = np.atleast_1d(a.astype(np.float64)), np.atleast_1d(b.astype(np.float64))
    with np.errstate(invalid="ignore"):  # inf - inf: equal infinities are equal (below)
        diff = np.abs(x - y)
    diff[(np.isnan(x) & np.isnan(y)) | (x == y)] = 0.0
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

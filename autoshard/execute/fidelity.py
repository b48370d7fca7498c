"""Cost fidelity: every op of a plan's per-device program timed at its local shapes, against
the cost model's estimate of it (`bench/cost_fidelity.py` prints the table).

    measure(requested, probe) -> Fidelity      # requested: `pipeline.plan_request`'s answer
    recorded(requested, measured, dtype)       # times kept from an earlier measure, re-priced

Device 0's program of the partition, op by op: each local op runs alone on the probe's
runtime (`cost.probes`: onnxruntime on the CPU as a one-node model; torch eager kernels on
CUDA or the CPU, `torch_ops`) with the device's local shapes and constants; weights that are
one element and whose data the model holds (a Pow's exponent) with their data, every other
operand random (normal floats, zeros for integers: valid indices). A Cast to a floating type
casts to the timed one. The time is the probe's (`cost.probes`: the median of several runs
on CUDA, the fastest on a CPU), summed per program step (a masked lookup is several local ops
of one step).
Integer weights (shape operands, axes, index tables) are their data too, where the device
holds them whole.

The estimate is the roofline (`cost.compute.op_cost`) of the same op on the plan's cluster,
with every floating tensor at the dtype the probe runs (bfloat16 on CUDA, float32 on a CPU),
times the runs per step: the plan's own `ops[name].compute_s` when the model is already at
that dtype.

Classes: matmul (the ops the model prices as contractions at the matrix units' rate),
memory-bound (every other op with
a kernel) and views (no kernel: free in the model; a runtime may still spend its per-op work
on them). An op the probe cannot run (no torch kernel, a type the runtime refuses at the
re-typed dtype) is listed in `skipped` with its reason, in no class.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoshard.cost.compute import matmul_efficiency, op_cost, op_kind
from autoshard.cost.measure.probes import OnnxRuntimeProbe, TorchProbe
from autoshard.execute import segments
from autoshard.ir import dtypes
from autoshard.ir.graph import Attrs, Graph, Value
from autoshard.passes.partition import LocalCompute, Partitioned
from autoshard.pipeline import RequestedPlan
from autoshard.program import Compute
from autoshard.rules import rule_for

CLASSES = ("matmul", "memory-bound", "views")


@dataclass(frozen=True)
class OpTiming:
    """One op of the program: its class, measured and estimated seconds per step."""

    name: str
    type: str
    kind: str
    measured: float
    estimated: float


@dataclass(frozen=True)
class ClassTotal:
    kind: str
    ops: int
    measured: float
    estimated: float

    @property
    def ratio(self) -> float:
        """Estimate over measurement (1.00 is exact; nan when nothing was measured)."""
        return self.estimated / self.measured if self.measured else math.nan


@dataclass(frozen=True)
class Fidelity:
    """The timed ops of a device program, and those the probe could not run (name, reason)."""

    ops: tuple[OpTiming, ...]
    skipped: tuple[tuple[str, str], ...] = ()

    def classes(self) -> tuple[ClassTotal, ...]:
        """Per class (`CLASSES`) and then in total (kind "total")."""
        rows = []
        for kind in (*CLASSES, "total"):
            mine = [o for o in self.ops if kind in ("total", o.kind)]
            rows.append(ClassTotal(
                kind, len(mine), math.fsum(o.measured for o in mine),
                math.fsum(o.estimated for o in mine),
            ))  # fmt: skip
        return tuple(rows)


def retyped(graph: Graph, dtype: str) -> Graph:
    """The graph with every floating tensor of `dtype` (shapes unchanged)."""
    values = {
        name: Value(name, v.shape, dtype) if _floating(v.dtype) else v
        for name, v in graph.values.items()
    }
    return dataclasses.replace(graph, values=values)


def _floating(name: str) -> bool:
    return name != "bool" and dtypes.numpy_dtype(name).kind == "f"


def _as(array: np.ndarray, dtype: str) -> np.ndarray:
    """A constant at the timed dtype when it is floating."""
    array = np.asarray(array)
    return array.astype(dtypes.numpy_dtype(dtype)) if array.dtype.kind == "f" else array


class _Operands:
    """The data an op of device 0 reads: constants, small weights' data, random otherwise."""

    def __init__(self, requested: RequestedPlan, partitioned: Partitioned, dtype: str) -> None:
        self.graph, self.partitioned, self.dtype = requested.graph, partitioned, dtype
        self.device = partitioned.devices[0]
        self.rng = np.random.default_rng(0)

    def dtype_of(self, name: str) -> str:
        found = self.partitioned.dtypes[name]
        return self.dtype if _floating(found) else found

    def constant(self, name: str) -> np.ndarray | None:
        device, shared = self.device.constants, self.partitioned.program.constants
        if name in device:
            return _as(device[name], self.dtype)
        if name in shared:
            return _as(shared[name], self.dtype)
        weight = self.graph.weights.get(name)
        if weight is None or not weight.has_data or name not in self.device.shapes:
            return None
        small = math.prod(weight.shape) == 1
        if not small and dtypes.numpy_dtype(weight.dtype).kind == "f":
            return None
        found = np.asarray(weight.load())
        return _as(found, self.dtype) if found.shape == tuple(self.device.shapes[name]) else None

    def data(self, name: str) -> np.ndarray:
        known = self.constant(name)
        if known is not None:
            return known
        dtype = dtypes.numpy_dtype(self.dtype_of(name)) if name in self.partitioned.dtypes else None
        shape = self.device.shapes[name]
        if dtype is not None and dtype.kind == "f":
            return self.rng.standard_normal(shape).astype(np.float32).astype(dtype)
        return np.zeros(shape, dtype if dtype is not None else np.int64)


def _ort_time(
    probe: OnnxRuntimeProbe, op_step: LocalCompute, operands: _Operands, opset: int
) -> float:
    op, device, partitioned = op_step.op, operands.device, operands.partitioned
    reads = [n for n in dict.fromkeys(op.inputs) if n]
    embedded = tuple(n for n in reads if operands.constant(n) is not None)
    inputs = tuple(n for n in reads if n not in embedded)
    outputs = tuple(n for n in op.outputs if n)
    names = (*reads, *outputs)
    typed = dataclasses.replace(
        partitioned, dtypes={n: operands.dtype_of(n) for n in names},
        program=dataclasses.replace(partitioned.program, constants={}),
    )  # fmt: skip
    local = dataclasses.replace(device, constants={n: operands.data(n) for n in embedded})
    if op.type == "Cast" and _floating(dtypes.dtype_name(int(op.attr("to", 1)))):  # type: ignore[arg-type]
        op = dataclasses.replace(
            op, attrs=Attrs({**op.attrs, "to": dtypes.onnx_type(operands.dtype)})
        )
    one = segments.Segment((op,), inputs, embedded, outputs, None, ())
    proto = segments.model(typed, local, one, opset)
    return probe.run_model(proto, {n: operands.data(n) for n in inputs})


def _torch_time(probe: TorchProbe, op_step: LocalCompute, operands: _Operands) -> float:
    from autoshard.execute.torch_ops import kernel, torch_dtype

    torch, op, device = probe.torch, op_step.op, operands.device
    args: list[Any] = []
    for name in op.inputs:
        if not name:
            args.append(None)
            continue
        target = torch_dtype(operands.dtype_of(name), torch, probe.torch_dtype)
        known = operands.constant(name)
        if known is None:  # drawn where it is used: a GPU fills GBs in microseconds
            shape = tuple(device.shapes[name])
            floating = target.is_floating_point
            make = torch.randn if floating else torch.zeros
            args.append(make(shape, dtype=target, device=probe.device))
            continue
        array = np.array(known)  # a writable copy; torch reads no ml_dtypes (bfloat16)
        source = array.astype(np.float32) if target.is_floating_point else array
        args.append(torch.from_numpy(source).to(probe.device, target))
    shapes = [tuple(device.shapes[n]) for n in op.outputs if n]
    return probe.time(kernel(op, args, shapes, torch))


def op_class(requested: RequestedPlan, name: str) -> str:
    """matmul, memory-bound or views (the module's docstring)."""
    graph, cluster = requested.graph, requested.cluster
    op = graph.op_by_name[name]
    if op_kind(op).view:
        return "views"
    option = requested.planned.plan.options.get(name)
    rule = rule_for(op, graph) if option is not None else None
    if rule is None or option is None or op_kind(op).flops == 0:  # moves, lookups
        return "memory-bound"
    dtype = graph.values[op.outputs[0]].dtype
    efficiency = matmul_efficiency(rule, option, cluster.mesh, dtype, cluster.device, op.inputs)
    return "memory-bound" if efficiency is None else "matmul"


def measure(requested: RequestedPlan, probe: OnnxRuntimeProbe | TorchProbe) -> Fidelity:
    """Device 0's ops timed on `probe`, with their estimates (the module's docstring)."""
    graph, program = requested.graph, requested.planned.program
    partitioned = requested.partition()
    operands = _Operands(requested, partitioned, probe.dtype)
    measured: dict[str, float] = defaultdict(float)
    skipped: dict[str, str] = {}
    for step in partitioned.devices[0].steps:
        if not isinstance(step, LocalCompute):
            continue
        compute = program.steps[step.step]
        assert isinstance(compute, Compute)
        try:
            if isinstance(probe, TorchProbe):
                seconds = _torch_time(probe, step, operands)
            else:
                seconds = _ort_time(probe, step, operands, graph.opset)
        except Exception as error:  # a runtime's own error types: the op is reported, not run
            skipped[compute.op.name] = f"{step.op.type}: {type(error).__name__}: {error}"[:200]
            continue
        measured[compute.op.name] += seconds
    timed = {name: seconds for name, seconds in measured.items() if name not in skipped}
    return dataclasses.replace(
        recorded(requested, timed, probe.dtype), skipped=tuple(sorted(skipped.items()))
    )


def recorded(requested: RequestedPlan, measured: Mapping[str, float], dtype: str) -> Fidelity:
    """Times measured before (per op name, seconds a step, at `dtype`: a `measure` kept, on
    a machine this one need not be) against the estimates of `requested`'s cost model:
    how a cost model change fares on a GPU, priced without one (bench/data/h100)."""
    graph = requested.graph
    if unknown := sorted(set(measured) - set(graph.op_by_name)):
        raise ValueError(f"measured ops the plan's graph lacks: {unknown[:5]}")
    estimates = _estimates(requested, dtype, requested.planned.program.steps)
    ops = tuple(
        OpTiming(name, graph.op_by_name[name].type, op_class(requested, name), seconds,
                 estimates[name])
        for name, seconds in measured.items()
    )  # fmt: skip
    return Fidelity(ops)


def _estimates(requested: RequestedPlan, dtype: str, steps: Any) -> Mapping[str, float]:
    """Per op of the program: its roofline at `dtype`, times its runs per step."""
    graph = retyped(requested.graph, dtype)
    found: dict[str, float] = defaultdict(float)
    for step in steps:
        if not isinstance(step, Compute):
            continue
        op = graph.op_by_name[step.op.name]
        rule = rule_for(op, graph) if step.option is not None else None
        once = op_cost(op, rule, step.option, graph, requested.cluster)
        found[op.name] += graph.runs(op.name) * once.seconds
    return found

"""Cost fidelity: every op of a plan's per-device program timed at its local shapes, against
the cost model's estimate of it.

    python bench/cost_fidelity.py                            # CPU: calibrates first (--quick)
    python bench/cost_fidelity.py --cluster cluster.json     # a file `autoshard calibrate` wrote
    python bench/cost_fidelity.py --models gpt2 bert --mesh 2 --dim batch=4 --dim seq=256

For each model: `autoshard plan` on `--mesh` with the cluster (the CPU calibration: the
estimates are the roofline at this machine's measured float32 matmul curve, copy bandwidth
and per-op floor), then device 0's program of the partition. Each of its local ops is run
alone as a one-node ONNX model on onnxruntime (the device's local shapes and constants,
random data; all cores, as numpy had when calibrating), the median of several runs after a
warm-up, less onnxruntime's own cost of a run (the median run of a one-element Identity:
binding, Python to C++, ~10 us here, where numpy's per-op floor is ~0.6 us), summed per
program step; the estimate is the plan's `ops[name].compute_s`.
Classes: matmul (the ops the model prices as contractions), memory-bound (every other op
with a kernel) and views (no kernel: free in the model; onnxruntime still spends its
per-node work on them). Printed per class and in total: measured, estimated, and their
ratio (estimate / measured; 1.00 is exact).

Collectives are not in these sums (the links are `autoshard calibrate --ranks N`'s); a CUDA
timing path (torch bf16, CUDA events) is not written yet: on a GPU machine this times the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort

from autoshard import segments
from autoshard.cost.calibrate import calibrate
from autoshard.cost.model import matmul_efficiency, op_kind
from autoshard.ir import dtypes
from autoshard.ir.onnx_import import unbound_dims
from autoshard.passes.partition import DeviceProgram, LocalCompute, Partitioned
from autoshard.pipeline import PlanRequest, plan_request
from autoshard.program import Compute
from autoshard.rules import rule_for

MODELS = Path(__file__).resolve().parents[1] / "models"
DIMS = {"batch": 4, "seq": 128, "dec_seq": 64}
CLASSES = ("matmul", "memory-bound", "views")


def _feed(
    names: list[str], partitioned: Partitioned, device: DeviceProgram
) -> dict[str, np.ndarray]:
    """Random data at the local shapes: normal floats, zeros for integers (valid indices)."""
    rng = np.random.default_rng(0)
    feed = {}
    for name in names:
        dtype = dtypes.numpy_dtype(partitioned.dtypes[name])
        shape = device.shapes[name]
        if np.issubdtype(dtype, np.floating):
            feed[name] = rng.standard_normal(shape).astype(dtype)
        else:
            feed[name] = np.zeros(shape, dtype)
    return feed


def _median_time(session: ort.InferenceSession, feed: Mapping[str, np.ndarray]) -> float:
    """The median of at least 5 runs and of as many as fit in 50 ms, after one warm-up."""
    session.run(None, dict(feed))
    times: list[float] = []
    while len(times) < 5 or (sum(times) < 0.05 and len(times) < 200):
        started = time.perf_counter()
        session.run(None, dict(feed))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def session_overhead(options: ort.SessionOptions) -> float:
    """What onnxruntime spends on a run beyond its kernels (binding inputs, Python to C++):
    the median run of a one-element Identity, taken off every op's time."""
    from onnx import TensorProto, helper

    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in ("x", "y")]
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", info[:1], info[1:])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=10)
    session = ort.InferenceSession(proto.SerializeToString(), options)
    return _median_time(session, {"x": np.ones(1, np.float32)})


def measure(model: str, mesh: str, dims: Mapping[str, int], cluster: str) -> dict[str, list]:
    """Per class, (op name, measured s, estimated s) of every op of device 0's program."""
    path = MODELS / f"{model}.onnx"
    wanted = unbound_dims(path)
    request = PlanRequest(
        model_path=path, mesh=mesh, dims={k: v for k, v in dims.items() if k in wanted},
        cluster_file=cluster, time_limit=30.0,
    )  # fmt: skip
    planned = plan_request(request)
    graph, program = planned.graph, planned.planned.program
    partitioned = planned.partition()
    device = partitioned.devices[0]
    options = ort.SessionOptions()
    options.log_severity_level = 3
    overhead = session_overhead(options)
    measured: dict[str, float] = defaultdict(float)
    for step in device.steps:
        if not isinstance(step, LocalCompute):
            continue
        op = step.op
        constants = partitioned.program.constants
        reads = [n for n in dict.fromkeys(op.inputs) if n]
        embedded = tuple(n for n in reads if n in constants or n in device.constants)
        inputs = tuple(n for n in reads if n not in embedded)
        outputs = tuple(n for n in op.outputs if n)
        one = segments.Segment((op,), inputs, embedded, outputs, None, ())
        proto = segments.model(partitioned, device, one, graph.opset)
        session = ort.InferenceSession(proto.SerializeToString(), options)
        compute = program.steps[step.step]
        assert isinstance(compute, Compute)
        seconds = _median_time(session, _feed(list(inputs), partitioned, device))
        measured[compute.op.name] += max(0.0, seconds - overhead)
    cost = planned.planned.cost
    rows: dict[str, list] = {c: [] for c in CLASSES}
    for name, seconds in measured.items():
        op = graph.op_by_name[name]
        option = planned.planned.plan.options[name]
        rule = rule_for(op, graph) if option is not None else None
        dtype = graph.values[op.outputs[0]].dtype
        contraction = (
            rule is not None
            and option is not None
            and matmul_efficiency(rule, option, planned.cluster.mesh, dtype,
                                  planned.cluster.device, op.inputs) is not None
        )  # fmt: skip
        kind = "views" if op_kind(op).view else "matmul" if contraction else "memory-bound"
        rows[kind].append((name, seconds, cost.ops[name].seconds))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", help="a cluster file (default: calibrate this CPU now)")
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt2", "bert"])
    parser.add_argument("--mesh", default="2")
    parser.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE")
    parser.add_argument("--worst", type=int, default=0, metavar="N",
                        help="also list each model's N ops the estimate misses most")  # fmt: skip
    args = parser.parse_args()
    dims = DIMS | {k: int(v) for k, v in (d.split("=") for d in args.dim)}
    cluster = args.cluster
    if cluster is None:
        calibration = calibrate(quick=True, progress=lambda m: print(m, file=sys.stderr))
        folder = tempfile.mkdtemp(prefix="autoshard-fidelity-")
        cluster = str(Path(folder) / "cluster.json")
        Path(cluster).write_text(json.dumps(calibration.to_json()))
    head = ["model", "class", "ops", "measured ms", "estimated ms", "est/meas"]
    table = []
    for model in args.models:
        rows = measure(model, args.mesh, dims, cluster)
        total_m = total_e = 0.0
        for kind in CLASSES:
            m = sum(r[1] for r in rows[kind])
            e = sum(r[2] for r in rows[kind])
            total_m, total_e = total_m + m, total_e + e
            ratio = f"{e / m:.2f}" if m else "-"
            table.append([model, kind, str(len(rows[kind])), f"{m * 1e3:.3f}", f"{e * 1e3:.3f}",
                          ratio])  # fmt: skip
        misses = sorted((abs(m - e), n, m, e) for r in rows.values() for n, m, e in r)
        for _, name, m, e in reversed(misses[-args.worst :] if args.worst else []):
            op = name.rsplit("/", 1)[-1]
            print(f"{model}: {op} measured {m * 1e6:.1f} us, estimated {e * 1e6:.1f} us")
        count = str(sum(len(r) for r in rows.values()))
        table.append([model, "total", count, f"{total_m * 1e3:.3f}", f"{total_e * 1e3:.3f}",
                      f"{total_e / total_m:.2f}"])  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *table]) for i in range(len(head))]
    for r in [head, *table]:
        print("  ".join(c.rjust(w) if i >= 2 else c.ljust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=True))))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

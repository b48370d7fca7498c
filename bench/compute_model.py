"""Compute per op family: the roofline model against the FLOPs/peak estimate it replaced.

    python bench/compute_model.py                       # bundled models, one H100, as stored
    python bench/compute_model.py --dtype bfloat16      # floating tensors re-typed to bf16
    python bench/compute_model.py --device a100 --mesh 8

Each op of each bundled model is priced on one device of `--mesh` replicated (the whole
forward on every device: no plan, so both models price the same work) twice: `previous`, the
formula before the roofline (iterations · (2 with a reduction loop, else 1) / peak of the
result dtype, views and gathers included), and `roofline`, `cost.compute.op_cost`. Families:
matmul (contractions), norm/softmax, gather (lookups), move (transposes, slices, concats, ...),
elementwise (the rest with a kernel) and view (no kernel). Estimates only: `autoshard
calibrate`-style measurements on the device are what either should be checked against.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path

from autoshard.cost.cluster import make_cluster
from autoshard.cost.compute import matmul_efficiency, op_cost, op_kind
from autoshard.execute.fidelity import retyped
from autoshard.ir.graph import Graph, Op
from autoshard.ir.onnx_import import import_onnx, unbound_dims
from autoshard.rules import IteratorType, OpRule, rule_for
from autoshard.sharding import ShardingOption

MODELS = Path(__file__).resolve().parents[1] / "models"
RUNS = {  # the CI plan set's dims (bench/baselines/plan_all.sh)
    "mlp": {"batch": 8},
    "cnn": {"batch": 8},
    "gpt2": {"batch": 8, "seq": 128},
    "gpt2_dynamo": {"batch": 8, "seq": 128},
    "bert": {"batch": 8, "seq": 128},
    "decoder_32l_shape_only": {"batch": 8, "seq": 2048},
}
FAMILIES = ("matmul", "norm/softmax", "elementwise", "move", "gather", "view")


def previous_seconds(op: Op, rule: OpRule | None, graph: Graph, peak: float) -> float:
    """The estimate before the roofline, for the whole op on one device."""
    if rule is None:
        return sum(math.prod(graph.values[o].shape) for o in op.outputs if o) / peak
    per_device = math.prod(loop.size for loop in rule.loops)
    multiply_add = any(loop.kind is IteratorType.REDUCTION for loop in rule.loops)
    return per_device * (2 if multiply_add else 1) / peak


def family(op: Op, rule: OpRule | None, option: ShardingOption | None, cluster) -> str:
    kind = op_kind(op)
    if kind.view:
        return "view"
    if kind.lookup:
        return "gather"
    if "Softmax" in op.type or "Normalization" in op.type:
        return "norm/softmax"
    if kind.flops == 0:
        return "move"
    contraction = (
        rule is not None
        and option is not None
        and matmul_efficiency(rule, option, cluster.mesh, "float32", cluster.device) is not None
    )
    return "matmul" if contraction else "elementwise"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(RUNS))
    parser.add_argument("--device", default="h100")
    parser.add_argument("--mesh", default="1")
    parser.add_argument("--dtype", default=None, help="re-type floating tensors, e.g. bfloat16")
    args = parser.parse_args()
    cluster = make_cluster(mesh=args.mesh, device=args.device)
    head = ["model", "family", "ops", "previous ms", "roofline ms", "x", "share"]
    print(f"one {cluster.device.name}, dtype {args.dtype or 'as stored'}")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for name in args.models:
        path = MODELS / f"{name}.onnx"
        wanted = unbound_dims(path)
        dims = {k: v for k, v in RUNS.get(name, {}).items() if k in wanted}
        graph = import_onnx(path, dims)
        graph = retyped(graph, args.dtype) if args.dtype else graph
        rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        for op in graph.ops:
            rule = rule_for(op, graph)
            option = ShardingOption(((),) * len(rule.loops)) if rule is not None else None
            dtype = graph.values[op.outputs[0]].dtype if op.outputs[0] else "float32"
            row = rows[family(op, rule, option, cluster)]
            row[0] += 1
            row[1] += previous_seconds(op, rule, graph, cluster.device.peak(dtype))
            row[2] += op_cost(op, rule, option, graph, cluster).seconds
        total = [sum(r[i] for r in rows.values()) for i in range(3)]
        for fam in (*FAMILIES, "total"):
            count, before, after = total if fam == "total" else rows.get(fam, (0, 0.0, 0.0))
            if not count:
                continue
            ratio = f"{after / before:.1f}" if before else "-"
            print(
                f"{name} | {fam} | {int(count)} | {before * 1e3:.4f} | {after * 1e3:.4f} | "
                f"{ratio} | {after / total[2]:.0%}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Partition and verify the bundled models (and, with --zoo, the export zoo): seconds per stage.

    python bench/partition_verify.py                 # models/ on meshes 2x4 (dp_tp, megatron)
    python bench/partition_verify.py --zoo /tmp/autoshard-zoo

For each model and plan: import, propagate, materialize, the CCL passes, partition, the
MLIR print of the SPMD program, and the all-devices verification against onnxruntime (local
sessions built, the number of distinct sessions, max relative error). The shape-only 32-layer
decoder (hidden 4096, 6.7 B parameters) is partitioned and printed but not run (it has no
weights). Exit status 1 if any verification fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from autoshard.execute.verify import model_weights, verify
from autoshard.ir.onnx_import import import_onnx, unbound_dims
from autoshard.mesh import Mesh
from autoshard.pipeline import build, print_spmd
from autoshard.propagate import propagate
from autoshard.search.baselines import dp_tp, megatron

MODELS = Path(__file__).resolve().parents[1] / "models"
DIMS = {"batch": 4, "seq": 8, "dec_seq": 4}
LARGE = {"batch": 8, "seq": 256}


def row(path: Path, mesh: Mesh, plan: str, dims: dict[str, int]) -> tuple[list[str], bool]:
    started = time.perf_counter()
    wanted = unbound_dims(path)
    graph = import_onnx(path, {k: v for k, v in dims.items() if k in wanted})
    annotations = dp_tp(graph, mesh) if plan == "dp_tp" else megatron(graph, mesh, mesh.ndim - 1)
    ended = [time.perf_counter()]  # import
    decided = propagate(graph, mesh, annotations)
    ended.append(time.perf_counter())
    built = build(graph, decided, lambda stage, result: ended.append(time.perf_counter()))
    print_spmd(built.partitioned, "mesh")
    ended.append(time.perf_counter())
    times = [b - a for a, b in zip([started, *ended], ended, strict=False)]
    program, partitioned = built.program, built.partitioned
    ok = True
    verified = ["-", "-", "-"]
    if all(w.has_data for w in graph.weights.values()):
        start = time.perf_counter()
        report = verify(partitioned, graph, path, model_weights(graph, partitioned))
        worst = max(c.max_rel_err for c in report.outputs.values())
        verified = [f"{time.perf_counter() - start:.2f}", str(report.sessions), f"{worst:.1e}"]
        ok = report.ok
    collectives = sum(1 for _ in program.communications)
    cells = [path.stem, str(mesh), plan, str(len(graph.ops)), str(collectives)]
    return cells + [f"{t:.2f}" for t in times] + verified, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=Path, help="also the zoo folder of models/make_zoo.py")
    parser.add_argument("--mesh", default="2x4")
    args = parser.parse_args()
    mesh = Mesh.parse(args.mesh)
    paths = [MODELS / f"{n}.onnx" for n in ("mlp", "cnn", "gpt2", "gpt2_dynamo", "bert")]
    if args.zoo:
        paths += sorted(args.zoo.glob("*.onnx"))
    head = ["model", "mesh", "plan", "ops", "colls", "import", "propagate", "materialize",
            "ccl", "partition", "print", "verify", "sessions", "rel err"]  # fmt: skip
    rows, failed = [], 0
    for path in paths:
        for plan in ("dp_tp", "megatron"):
            cells, ok = row(path, mesh, plan, DIMS)
            rows.append(cells)
            failed += not ok
    rows.append(row(MODELS / "decoder_32l_shape_only.onnx", mesh, "dp_tp", LARGE)[0])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in
                        enumerate(zip(r, widths, strict=True))))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

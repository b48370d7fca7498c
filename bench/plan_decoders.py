"""Time `autoshard plan` on shape-only Llama-7B-sized decoders of growing depth.

    python bench/plan_decoders.py [--layers 2 12 32 96] [--meshes 8 4x8 2x4x8] [--seq 2048]

Each decoder (hidden 4096, 32 heads, SwiGLU 11008, float16, weights absent) is written to a
temporary folder by models/make_models.py, then planned as the command does: import with batch
8, build the search problem, solve it (`solver.solve`), lower and price the plan. The table gives
the wall time end to end (import included), the coarsened problem (groups and choices: repeated
layers share one set), the objective (ms per step under the cost model), the solver's status
and gap. Targets (2 cores): 32 layers on 4x8 in <= 5 s; 96 layers in <= 1.5x that.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import onnx

from autoshard.cost.cluster import make_cluster
from autoshard.ir.onnx_import import import_onnx
from autoshard.search.budget import auto_plan
from autoshard.search.options import SolverOptions

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "models"))

from make_models import build_decoder_shape_only  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 12, 32, 96])
    parser.add_argument("--meshes", nargs="+", default=["8", "4x8", "2x4x8"])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args(argv)
    print(f"{'layers':>6} {'mesh':>6} {'wall s':>7} {'groups':>6} {'choices':>7} "
          f"{'objective ms':>12} {'status':>8} {'gap':>6}")  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        for layers in args.layers:
            path = Path(folder) / f"decoder_{layers}l.onnx"
            onnx.save(build_decoder_shape_only(layers).proto, path)
            for mesh in args.meshes:
                started = time.perf_counter()
                graph = import_onnx(path, {"batch": 8, "seq": args.seq})
                options = SolverOptions(time_limit=args.time_limit)
                planned = auto_plan(graph, make_cluster(mesh=mesh), options=options)
                wall = time.perf_counter() - started
                problem, solution = planned.search.problem, planned.solution
                print(
                    f"{layers:>6} {mesh:>6} {wall:>7.2f} {len(problem.sizes):>6} "
                    f"{problem.variables:>7} {planned.cost.objective * 1e3:>12.3f} "
                    f"{solution.status:>8} {solution.gap:>6.2%}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

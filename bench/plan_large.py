"""Time `autoshard plan` on shape-only decoders the size of Llama-3 70B and 405B.

    python bench/plan_large.py [--models 70b 405b] [--budgets free device 0.6 0.3 0.01 lowest]

Each decoder (float16, weights absent; grouped-query attention with 8 KV heads) is written to
a temporary folder by models/make_models.py, then planned as `autoshard plan` does
(`pipeline.plan_request`: import with batch 8, build the search problem, solve it, lower the
plan to its program, price it, write the plan document), under each budget: `free` (memory
no object: 1 TB per device), `device` (the H100's 80 GB, which binds for both), a fraction
of the free plan's peak (binding; below the least any plan needs, "infeasible": the search
proves it and names the lowest feasible budget, solved for by its own ILP), or `lowest` (that
lowest budget, from the infeasible row before it).
`wall s` is all of that, end to end, and `cpu s` its process time (on a shared machine
the closer to a quiet machine's wall time); `build s` is the search problem's building,
`solve s` the solver's part (every solve, wall); `lower s` one lowering of the chosen plan,
timed again afterwards. Target (2 cores): each <= 10 s end to end.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import onnx

from autoshard.cost.cluster import make_cluster
from autoshard.passes.lower import lower
from autoshard.pipeline import PlanRequest, plan_request
from autoshard.search.budget import NoPlanFits

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "models"))

from make_models import build_decoder_shape_only  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """A decoder's size and the mesh it is planned on."""

    mesh: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int


SHAPES = {
    "70b": Shape("8x8", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256),
    "405b": Shape("16x8", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--budgets", nargs="+", default=["free", "device", "0.6", "0.3", "0.01",
                                                         "lowest"])  # fmt: skip
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args(argv)
    print(f"{'model':>5} {'mesh':>5} {'layers':>6} {'hidden':>6} {'budget':>14} {'wall s':>7} "
          f"{'cpu s':>7} {'build s':>7} {'solve s':>7} {'lower s':>7} {'status':>8} {'gap':>6} "
          f"{'peak/budget':>11}")  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            shape = SHAPES[name]
            path = Path(folder) / f"decoder_{name}.onnx"
            built = build_decoder_shape_only(
                shape.layers, hidden=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads,
                ffn=shape.ffn, vocab=shape.vocab,
            )  # fmt: skip
            onnx.save(built.proto, path)
            free_peak, lowest = 0, 0
            for budget in args.budgets:
                memory = {"free": "1TB", "device": None, "lowest": str(lowest)}.get(budget)
                if budget == "lowest" and not lowest:
                    raise SystemExit("budget lowest: it needs an infeasible budget before it")
                if memory is None and budget != "device":
                    if not free_peak:
                        raise SystemExit(f"budget {budget}: a fraction needs 'free' before it")
                    memory = str(int(float(budget) * free_peak))
                request = PlanRequest(
                    model_path=path, cluster=make_cluster(shape.mesh, memory=memory),
                    dims={"batch": 8, "seq": args.seq}, time_limit=args.time_limit,
                )  # fmt: skip
                head = f"{name:>5} {shape.mesh:>5} {shape.layers:>6} {shape.hidden:>6} "
                started, cpu = time.perf_counter(), time.process_time()
                try:
                    requested = plan_request(request)
                except NoPlanFits as error:
                    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
                    lowest = error.lowest.peak
                    print(f"{head}{memory or budget:>14} {wall:>7.2f} {cpu:>7.2f} infeasible: "
                          f"the lowest feasible budget is {lowest} ({error.lowest.status}, "
                          f"bound {error.lowest.bound})", flush=True)  # fmt: skip
                    continue
                wall, cpu = time.perf_counter() - started, time.process_time() - cpu
                planned, graph = requested.planned, requested.graph
                lowering = time.perf_counter()
                lower(graph, planned.plan)
                lowered = time.perf_counter() - lowering
                solution, peak = planned.solution, planned.cost.memory_bytes_per_device
                budget_bytes = requested.cluster.memory
                free_peak = peak if budget == "free" else free_peak
                print(
                    f"{head}{budget_bytes:>14} {wall:>7.2f} {cpu:>7.2f} {planned.build_s:>7.2f} "
                    f"{planned.solve_s:>7.2f} {lowered:>7.2f} {solution.status:>8} "
                    f"{solution.gap:>6.2%} {peak / budget_bytes:>11.1%}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

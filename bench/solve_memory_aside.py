"""The memory-aside solve: exact elimination (`solver.factors.minimize`) against CP-SAT.

    python bench/solve_memory_aside.py [--cases decoder-2x4x8 ...] [--cp-sat]

For each case the search problem is built as `autoshard plan` builds it, then solved with
memory aside by exact min-sum elimination: its order's largest table (entries, against the
cap), its work (the sum over steps of a table's entries times the eliminated group's
choices) and its seconds. With `--cp-sat`, also as `solve` did before it: the groups of
degree <= 2 eliminated, CP-SAT on the rest, its seconds and whether the objectives agree.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from autoshard.cost.cluster import make_cluster
from autoshard.pipeline import PlanRequest, plan_inputs
from autoshard.search.problem import build_search
from autoshard.search.solver.cp_sat import solve_cp_sat
from autoshard.search.solver.eliminate import _expand, eliminate
from autoshard.search.solver.factors import (
    additions,
    elimination_order,
    minimize,
    problem_factors,
)
from autoshard.search.solver.outcome import Limit
from autoshard.search.solver.tuning import MAX_ENTRIES
from autoshard.training import Training

MODELS = Path(__file__).resolve().parents[1] / "models"
DECODER = "decoder_32l_shape_only.onnx"
CASES = {  # name: (model, mesh, dims, training)
    "gpt2-2x4": ("gpt2.onnx", "2x4", {"batch": 8, "seq": 128}, False),
    "gpt2-2x4-training": ("gpt2.onnx", "2x4", {"batch": 8, "seq": 128}, True),
    "bert-2x4": ("bert.onnx", "2x4", {"batch": 8, "seq": 128}, False),
    "decoder-4x8": (DECODER, "4x8", {"batch": 8, "seq": 2048}, False),
    "decoder-4x8-training": (DECODER, "4x8", {"batch": 32, "seq": 2048}, True),
    "decoder-2x4x8": (DECODER, "2x4x8", {"batch": 8, "seq": 2048}, False),
    "decoder-2x4x8-training": (DECODER, "2x4x8", {"batch": 8, "seq": 2048}, True),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--cp-sat", action="store_true", help="also solve with CP-SAT")
    args = parser.parse_args(argv)
    print(f"{'case':>24} {'groups':>6} {'choices':>7} {'largest':>12} {'work':>15} "
          f"{'exact s':>8} {'cp-sat s':>8} {'agree':>5}")  # fmt: skip
    for name in args.cases:
        model, mesh, dims, training = CASES[name]
        request = PlanRequest(model_path=MODELS / model, cluster=make_cluster(mesh), dims=dims,
                              training=Training() if training else None)  # fmt: skip
        problem = build_search(*plan_inputs(request)).problem
        factors = problem_factors(problem)
        order, largest = elimination_order(problem.sizes, [f.scope for f in factors])
        work = additions(problem.sizes, order)
        started = time.perf_counter()
        exact = minimize(problem.sizes, factors)
        exact_s = f"{time.perf_counter() - started:.3f}" if exact else f"> cap {MAX_ENTRIES}"
        cp_sat_s = agree = "-"
        if args.cp_sat:
            reduced, kept, steps = eliminate(problem)
            started = time.perf_counter()
            limit = Limit(600.0, 600.0, "memory-aside")
            solution, _ = solve_cp_sat(reduced, limit, memory=False)
            cp_sat_s = f"{time.perf_counter() - started:.3f}"
            choice = _expand(solution.choice, kept, steps, len(problem.sizes))
            if exact is not None:
                agree = "yes" if problem.objective(choice) == exact.value else "NO"
        print(f"{name:>24} {len(problem.sizes):>6} {problem.variables:>7} {largest:>12,} "
              f"{work:>15,} {exact_s:>8} {cp_sat_s:>8} {agree:>5}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

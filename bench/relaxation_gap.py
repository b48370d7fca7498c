"""How far the memory-bound solve's relaxation is from the LP and from the optimum.

    python bench/relaxation_gap.py                                   # bert on 2x4 and 4x8
    python bench/relaxation_gap.py --models gpt2 --meshes 4x8 --budgets 0.6 lowest

For each model, mesh and budget (a fraction of the unconstrained plan's peak, or `lowest`,
the least feasible budget): the Lagrangian bound (`solver.dual.dual`, its 20 steps), the
bound of the LP relaxation of the very model CP-SAT solves (`solver.cp_sat.ilp_model`, solved
by HiGHS through scipy, a dev dependency), the relaxation's value at the LP's multipliers of
the memory rows, and the optimum (`solver.solve.solve`), all in the problem's integer cost
units. The Lagrangian subproblem is solved exactly, so at the LP's multipliers it should be
at least the LP's bound: where it is far below, an indicator's bound in `solver.bounds` is
weaker than the LP's linearization (this table found the AND bound that priced every reshard
buffer not made at minus its bytes). Where the LP too is far under the optimum, the gap is
the integer problem's, for CP-SAT to close.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix, vstack

from autoshard.cost.cluster import make_cluster
from autoshard.ir.onnx_import import import_onnx, unbound_dims
from autoshard.search.budget import auto_plan
from autoshard.search.problem import Problem, build_search
from autoshard.search.solver.cp_sat import ilp_model, rows_over
from autoshard.search.solver.dual import dual
from autoshard.search.solver.lowest import lowest_budget
from autoshard.search.solver.outcome import InfeasibleError
from autoshard.search.solver.relaxation import Relaxation
from autoshard.search.solver.solve import solve

MODELS = Path(__file__).resolve().parents[1] / "models"
DIMS = {"batch": 8, "seq": 128, "dec_seq": 16}
LARGE = {"batch": 8, "seq": 2048}
INFINITE = 2**62  # CP-SAT's domains end near 2^63


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["bert"])
    parser.add_argument("--meshes", nargs="+", default=["2x4", "4x8"])
    parser.add_argument("--budgets", nargs="+", default=["0.6", "0.3", "lowest"])
    args = parser.parse_args()
    head = ["model", "mesh", "budget", "Lagrangian", "LP", "at the LP's multipliers", "optimum"]
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for name in args.models:
        path = MODELS / f"{name}.onnx"
        dims = LARGE if "shape_only" in name else DIMS
        graph = import_onnx(path, {k: v for k, v in dims.items() if k in unbound_dims(path)})
        for mesh in args.meshes:
            peak = auto_plan(graph, make_cluster(mesh=mesh)).cost.memory_bytes_per_device
            for budget in args.budgets:
                if budget == "lowest":
                    unbounded = build_search(graph, make_cluster(mesh=mesh)).problem
                    memory = lowest_budget(unbounded).peak
                else:
                    memory = int(float(budget) * peak)
                problem = build_search(graph, make_cluster(mesh=mesh, memory=memory)).problem
                print(" | ".join([name, mesh, budget, *gaps(problem)]), flush=True)
    return 0


def gaps(problem: Problem) -> list[str]:
    """The Lagrangian bound, the LP's, the relaxation at the LP's multipliers, the optimum."""
    relaxation = Relaxation(problem)
    found = dual(problem, relaxation=relaxation)
    lp, multipliers = lp_bound(problem)
    at = relaxation.solve(multipliers)
    try:
        optimum = f"{solve(problem).objective:.4g}"
    except InfeasibleError:
        optimum = "infeasible"
    return [
        "-" if found is None else f"{found.bound:.4g}",
        f"{lp:.4g}",
        "-" if at is None else f"{at.value:.4g}",
        optimum,
    ]


def lp_bound(problem: Problem) -> tuple[float, np.ndarray]:
    """The LP relaxation of CP-SAT's model: its bound, and the duals of the memory rows (the
    model's last constraints, in the problem's order; 0 for rows left out as unable to bind).
    """
    model, _ = ilp_model(problem, memory=True)
    proto = model.proto
    lows = [list(v.domain)[0] for v in proto.variables]
    highs = [list(v.domain)[-1] for v in proto.variables]
    rows, columns, values, below, above = [], [], [], [], []
    for c in proto.constraints:
        if c.has_exactly_one():
            terms, low, high = [(v, 1) for v in c.exactly_one.literals], 1, 1
        else:
            domain = list(c.linear.domain)
            terms = list(zip(c.linear.vars, c.linear.coeffs, strict=True))
            low, high = domain[0], domain[-1]
        for v, a in terms:
            rows.append(len(below))
            columns.append(v)
            values.append(float(a))
        below.append(low if low > -INFINITE else -np.inf)
        above.append(high if high < INFINITE else np.inf)
    matrix = coo_matrix((values, (rows, columns)), shape=(len(below), len(lows))).tocsr()
    low, high = np.array(below, float), np.array(above, float)
    equal = low == high
    upper, lower = ~equal & np.isfinite(high), ~equal & np.isfinite(low)
    cost = np.zeros(len(lows))
    for v, a in zip(proto.objective.vars, proto.objective.coeffs, strict=True):
        cost[v] += a
    found = linprog(
        cost, A_ub=vstack([matrix[upper], -matrix[lower]]),
        b_ub=np.concatenate([high[upper], -low[lower]]), A_eq=matrix[equal], b_eq=low[equal],
        bounds=list(zip(lows, highs, strict=True)), method="highs",
    )  # fmt: skip
    duals = np.zeros(len(problem.memory))
    kept = rows_over(problem, problem.budget)
    memory_rows = np.flatnonzero(upper)[-len(kept) :] if len(kept) else []
    position = {row: i for i, row in enumerate(np.flatnonzero(upper))}
    for r, row in zip(kept, memory_rows, strict=True):
        duals[r] = -found.ineqlin.marginals[position[row]]
    return float(found.fun), duals


if __name__ == "__main__":
    sys.exit(main())

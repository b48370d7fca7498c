"""Memory-bound planning: seconds, status and gap under budgets that bind.

    python bench/plan_memory.py                          # models/ on 2x4 and 4x8
    python bench/plan_memory.py --models decoder_32l_shape_only --meshes 4x8 2x4x8

For each model and mesh: the unconstrained plan's peak memory per device, then `autoshard plan`
(import, search, lower, price: end to end in one process) with a budget of 100%, 60% and 30% of
that peak and at the lowest feasible budget, which is solved for first (its own ILP: least peak
memory, with its proof). A budget below the lowest feasible one answers "infeasible" (the
search proves it and names the lowest budget). Columns: wall seconds, solver status and gap,
the plan's peak memory over the budget, and whether the ILP's peak is the program's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from autoshard.cost.cluster import make_cluster
from autoshard.cost.model import memory
from autoshard.ir.onnx_import import import_onnx, unbound_dims
from autoshard.search.budget import auto_plan
from autoshard.search.ilp import InfeasibleError, lowest_budget
from autoshard.search.options import SolverOptions
from autoshard.search.problem import build_search

MODELS = Path(__file__).resolve().parents[1] / "models"
DIMS = {"batch": 8, "seq": 128, "dec_seq": 16}
LARGE = {"batch": 8, "seq": 2048}
FRACTIONS = (1.0, 0.6, 0.3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "cnn", "gpt2", "gpt2_dynamo", "bert"]
    )
    parser.add_argument("--meshes", nargs="+", default=["2x4", "4x8"])
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()
    options = SolverOptions(time_limit=args.time_limit)
    head = ["model", "mesh", "budget", "bytes", "wall s", "status", "gap", "peak/budget", "exact"]
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for name in args.models:
        path = MODELS / f"{name}.onnx"
        dims = LARGE if "shape_only" in name else DIMS
        for mesh in args.meshes:
            wanted = unbound_dims(path)
            graph = import_onnx(path, {k: v for k, v in dims.items() if k in wanted})
            free = auto_plan(graph, make_cluster(mesh=mesh), options=options)
            top = free.cost.memory_bytes_per_device
            started = time.perf_counter()
            search = build_search(graph, make_cluster(mesh=mesh))
            least = lowest_budget(search.problem, args.time_limit)
            seconds = time.perf_counter() - started
            cells = [
                name,
                mesh,
                "lowest (solved)",
                str(least.peak),
                f"{seconds:.2f}",
                str(least.status),
                f"{(least.peak - least.bound) / least.peak:.2%}",
                "",
                "",
            ]
            print(" | ".join(cells), flush=True)  # fmt: skip
            budgets = [(f"{f:.0%}", int(top * f)) for f in FRACTIONS] + [("lowest", least.peak)]
            for label, budget in budgets:
                print(" | ".join(row(path, dims, mesh, label, budget, options)), flush=True)
    return 0


def row(
    path: Path, dims: dict[str, int], mesh: str, label: str, budget: int, options: SolverOptions
) -> list[str]:
    started = time.perf_counter()
    wanted = unbound_dims(path)
    graph = import_onnx(path, {k: v for k, v in dims.items() if k in wanted})
    cluster = make_cluster(mesh=mesh, memory=str(budget))
    try:
        planned = auto_plan(graph, cluster, options=options)
    except InfeasibleError:
        wall = time.perf_counter() - started
        return [path.stem, mesh, label, str(budget), f"{wall:.2f}", "infeasible", "", "", ""]
    wall = time.perf_counter() - started
    peak = memory(planned.program).peak
    exact = planned.search.problem.peak(planned.solution.choice) == peak
    solution = planned.solution
    return [path.stem, mesh, label, str(budget), f"{wall:.2f}", str(solution.status),
            f"{solution.gap:.2%}", f"{peak / budget:.1%}", "yes" if exact else "NO"]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

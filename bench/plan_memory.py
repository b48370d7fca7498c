"""Memory-bound planning: seconds, status and gap under budgets that bind.

    python bench/plan_memory.py                          # models/ on 2x4 and 4x8
    python bench/plan_memory.py --models decoder_32l_shape_only --meshes 4x8 2x4x8
    python bench/plan_memory.py --models /tmp/autoshard-zoo/t5_ts.onnx --budgets 0.6 lowest+5
    python bench/plan_memory.py --models /tmp/autoshard-zoo/*_ts.onnx --training --budgets 0.45

For each model and mesh: the unconstrained plan's peak memory per device, then `autoshard plan`
(import, search, lower, price: end to end in one process) with a budget of 100%, 60% and 30% of
that peak and at the lowest feasible budget, which is solved for first (its own ILP: least peak
memory, with its proof); `--budgets` chooses (fractions of the peak, `lowest`, `lowest+5`: 5 %
over it). A budget below the lowest feasible one answers "infeasible" (the search proves it
and names the lowest budget). Columns: wall seconds, solver status and gap, the plan's peak
memory over the budget, and whether the ILP's peak is the program's. A model is a name in
models/ or an ONNX file (the zoo's, `models/make_zoo.py`); `--training` plans its training
step (`autoshard plan --mode training`'s defaults: Adam, bf16 mixed precision).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from autoshard.cost.cluster import make_cluster
from autoshard.cost.liveness import memory
from autoshard.ir.graph import Graph
from autoshard.ir.onnx_import import unbound_dims
from autoshard.pipeline import load_graph
from autoshard.search.budget import auto_plan
from autoshard.search.options import SolverOptions
from autoshard.search.problem import build_search
from autoshard.search.solver.lowest import lowest_budget
from autoshard.search.solver.outcome import InfeasibleError
from autoshard.training import Training

MODELS = Path(__file__).resolve().parents[1] / "models"
DIMS = {"batch": 8, "seq": 128, "dec_seq": 16}
LARGE = {"batch": 8, "seq": 2048}
BUDGETS = ("1.0", "0.6", "0.3", "lowest")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "cnn", "gpt2", "gpt2_dynamo", "bert"]
    )
    parser.add_argument("--meshes", nargs="+", default=["2x4", "4x8"])
    parser.add_argument("--budgets", nargs="+", default=list(BUDGETS))
    parser.add_argument("--training", action="store_true", help="plan the training step")
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()
    options = SolverOptions(time_limit=args.time_limit)
    training = Training() if args.training else None
    head = ["model", "mesh", "budget", "bytes", "wall s", "status", "gap", "peak/budget", "exact"]
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for name in args.models:
        path = Path(name) if name.endswith(".onnx") else MODELS / f"{name}.onnx"
        wanted = unbound_dims(path)
        dims = {k: v for k, v in (LARGE if "shape_only" in name else DIMS).items() if k in wanted}

        def graph(path: Path = path, dims: dict[str, int] = dims) -> Graph:
            return load_graph(path, dims, training)

        for mesh in args.meshes:
            top = auto_plan(graph(), make_cluster(mesh=mesh), options=options)
            peak = top.cost.memory_bytes_per_device
            least = None
            if any(budget.startswith("lowest") for budget in args.budgets):
                started = time.perf_counter()
                search = build_search(graph(), make_cluster(mesh=mesh))
                least = lowest_budget(search.problem, args.time_limit)
                seconds = time.perf_counter() - started
                gap = (least.peak - least.bound) / least.peak
                cells = [path.stem, mesh, "lowest (solved)", str(least.peak), f"{seconds:.2f}",
                         str(least.status), f"{gap:.2%}", "", ""]  # fmt: skip
                print(" | ".join(cells), flush=True)
            for label in args.budgets:
                budget = _budget(label, peak, least.peak if least else 0)
                cells = row(graph, path.stem, mesh, label, budget, options)
                print(" | ".join(cells), flush=True)
    return 0


def _budget(label: str, peak: int, lowest: int) -> int:
    """`lowest`, `lowest+P` (P % over it) or a fraction of the unconstrained plan's `peak`."""
    if label.startswith("lowest"):
        over = float(label.removeprefix("lowest") or 0)
        return int(lowest * (1 + over / 100))
    return int(peak * float(label))


def row(
    graph: Callable[[], Graph],
    name: str,
    mesh: str,
    label: str,
    budget: int,
    options: SolverOptions,
) -> list[str]:
    label = f"{float(label):.0%}" if label[0].isdigit() else label
    started = time.perf_counter()
    cluster = make_cluster(mesh=mesh, memory=str(budget))
    try:
        planned = auto_plan(graph(), cluster, options=options)
    except InfeasibleError:
        wall = time.perf_counter() - started
        return [name, mesh, label, str(budget), f"{wall:.2f}", "infeasible", "", "", ""]
    wall = time.perf_counter() - started
    peak = memory(planned.program).peak
    exact = planned.search.problem.peak(planned.solution.choice) == peak
    solution = planned.solution
    return [name, mesh, label, str(budget), f"{wall:.2f}", str(solution.status),
            f"{solution.gap:.2%}", f"{peak / budget:.1%}", "yes" if exact else "NO"]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

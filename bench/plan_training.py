"""Training plans: seconds, status, memory by kind and the strategy the search picks.

    python bench/plan_training.py                       # the default table (below)
    python bench/plan_training.py --models gpt2 --meshes 2x4 --memory 6MiB

For each model and mesh, `autoshard plan --mode training` end to end in one process (import,
the training step's graph, search, lower, price) on H100s with the given memory per device:
wall seconds, solver status and gap, the step's time (compute + communication), the peak per
device and what it holds (weights, gradients, optimizer state, activations, collective
buffers), and how many weights each strategy holds (ddp, zero, fsdp, tp and their mixes).
For the 32-layer decoder, two hand recipes priced by the same model follow: FSDP over all
devices (the batch split over every axis, every weight held split over every axis), and
TP=8 within a node x data parallel across nodes (the batch over axis 0, Megatron's splits over
axis 1 as the ops read the weights; how they are held is left to the search: FSDP or
replicated across nodes).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from autoshard.annotations import Annotation
from autoshard.cost.cluster import make_cluster
from autoshard.ir.onnx_import import import_onnx
from autoshard.pipeline import load_graph
from autoshard.search.baselines import data_parallel, megatron
from autoshard.search.budget import auto_plan
from autoshard.search.problem import SearchError
from autoshard.search.solver.outcome import InfeasibleError
from autoshard.sharding import Sharding
from autoshard.training import Training
from autoshard.training.step import gradient_name, state_name
from autoshard.training.strategy import strategy_counts, weight_strategies
from autoshard.units import format_bytes

MODELS = Path(__file__).resolve().parents[1] / "models"
DIMS = {"batch": 8, "seq": 128}
LARGE = {"batch": 32, "seq": 2048}
DEFAULT = [("gpt2", "2x4"), ("gpt2", "4x8"), ("bert", "2x4"), ("bert", "4x8"),
           ("decoder_32l_shape_only", "4x8"), ("decoder_32l_shape_only", "2x4x8")]  # fmt: skip
KINDS = ("weights", "gradients", "optimizer_state", "activations", "buffers")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+")
    parser.add_argument("--meshes", nargs="+", default=["2x4", "4x8"])
    parser.add_argument("--memory", default="80GB", help="per device (default 80GB)")
    parser.add_argument("--recipes", action="store_true", help="only the decoder's recipes")
    args = parser.parse_args()
    cases = [(m, mesh) for m in args.models for mesh in args.meshes] if args.models else DEFAULT
    head = ["model", "mesh", "plan", "wall s", "status", "gap", "step ms", "peak",
            *KINDS, "strategy"]  # fmt: skip
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    if not args.recipes:
        for model, mesh in cases:
            print(" | ".join(row(model, mesh, args.memory, "searched")), flush=True)
    for recipe in ("fsdp", "tp8 x dp"):
        print(" | ".join(row("decoder_32l_shape_only", "4x8", args.memory, recipe)), flush=True)
    return 0


def recipe_annotations(graph, mesh, recipe: str) -> list[Annotation]:
    if recipe == "fsdp":
        everywhere = tuple(range(mesh.ndim))
        found = data_parallel(graph, mesh, everywhere)
        found += [Annotation(a.value, a.sharding, for_users=True) for a in found]
        for name, weight in graph.weights.items():
            if name in graph.values and weight.size > 1 and graph.consumers(name):
                dims = [d for d, n in enumerate(weight.shape) if n % mesh.size == 0]
                if dims:
                    split = [everywhere if d == dims[0] else () for d in range(len(weight.shape))]
                    found.append(Annotation(name, Sharding(tuple(split))))
                    found.append(Annotation(gradient_name(name), Sharding(tuple(split))))
                    found.append(Annotation(state_name(name), Sharding(((), *split))))
        return found
    dp = data_parallel(graph, mesh, (0,))
    return dp + [Annotation(a.value, a.sharding, for_users=True) for a in megatron(graph, mesh, 1)]


def row(model: str, mesh_text: str, budget: str, recipe: str) -> list[str]:
    dims = LARGE if "shape_only" in model else DIMS
    started = time.perf_counter()
    path = MODELS / f"{model}.onnx"
    graph = load_graph(path, dims, Training())
    cluster = make_cluster(mesh=mesh_text, memory=budget)
    forward = import_onnx(path, dims)
    annotations = [] if recipe == "searched" else recipe_annotations(forward, cluster.mesh, recipe)
    try:
        planned = auto_plan(graph, cluster, annotations)
    except (InfeasibleError, SearchError) as error:
        wall = time.perf_counter() - started
        return [model, mesh_text, recipe, f"{wall:.1f}", f"no plan: {error}"[:120]]
    wall = time.perf_counter() - started
    cost, solution = planned.cost, planned.solution
    counts = strategy_counts(weight_strategies(graph, planned.plan))
    return [
        model, mesh_text, recipe, f"{wall:.1f}", str(solution.status), f"{solution.gap:.2%}",
        f"{cost.objective * 1e3:.2f}", format_bytes(cost.memory_bytes_per_device),
        *(format_bytes(cost.memory_by_kind.get(k, 0)) for k in KINDS),
        ", ".join(f"{n} {kind}" for kind, n in counts.items()),
    ]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

"""What pricing the standard recipes adds to `autoshard plan`: the CI set's plans and the
quickstart's 7B training step, each planned end to end in one process (`plan_request`, the
recipes included), then its recipes priced again alone (`price_recipes`) in the same search.

    python bench/recipe_prices.py             # the CI set and the 7B training step
    python bench/recipe_prices.py --only 7b   # the 7B training step alone

Prints, per plan, the wall seconds of the whole plan (the recipes included), of the recipes
alone (as a plan first prices them, the best of three runs: the machine's noise aside) and what
they add to the plan without them, then each recipe's step time, memory and whether it fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from autoshard.cost.cluster import make_cluster
from autoshard.pipeline import PlanRequest, load_graphs, plan_request
from autoshard.search.options import Objective
from autoshard.search.problem import Search
from autoshard.search.recipe_prices import price_recipes
from autoshard.training import Training
from autoshard.units import format_bytes, format_seconds

MODELS = Path(__file__).resolve().parents[1] / "models"
SMALL = {"batch": 8, "seq": 128}
LARGE_TRAIN = {"batch": 32, "seq": 2048}
CASES = [  # bench/baselines/plan_all.sh's set, named alike
    ("mlp-2x2-100KB", "mlp", "2x2", {"batch": 8}, "100KB", False),
    ("mlp-4x8", "mlp", "4x8", {"batch": 8}, "80GB", False),
    ("cnn-2x2", "cnn", "2x2", {"batch": 8}, "80GB", False),
    ("gpt2-2x4-1MiB", "gpt2", "2x4", SMALL, "1MiB", False),
    ("gpt2-4x8", "gpt2", "4x8", SMALL, "80GB", False),
    ("gpt2_dynamo-4x8", "gpt2_dynamo", "4x8", SMALL, "80GB", False),
    ("bert-2x4-900KB", "bert", "2x4", SMALL, "900KB", False),
    ("decoder_32l-4x8", "decoder_32l_shape_only", "4x8", {"batch": 8, "seq": 2048}, "80GB", False),
    ("gpt2-2x4-training", "gpt2", "2x4", SMALL, "80GB", True),
    ("7b", "decoder_32l_shape_only", "4x8", LARGE_TRAIN, "80GB", True),
]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="case names (default: all)")
    args = parser.parse_args()
    print("plan | plan s | recipes s | added | recipes (step time, memory, fits)")
    print("--- | --- | --- | --- | ---")
    total_plan = total_recipes = 0.0
    for name, model, mesh, dims, memory, training in CASES:
        if args.only and name not in args.only:
            continue
        path = MODELS / f"{model}.onnx"
        cluster = make_cluster(mesh=mesh, memory=memory)
        step = Training() if training else None
        started = time.perf_counter()
        requested = plan_request(PlanRequest(model_path=path, cluster=cluster, dims=dims,
                                             training=step))  # fmt: skip
        whole = time.perf_counter() - started
        forward = load_graphs(path, dims, None)[0]
        best = float("inf")
        for _ in range(3):
            search = _fresh(requested.planned.search)
            started = time.perf_counter()
            prices = price_recipes(requested.graph, forward, cluster, search, Objective.TIME)
            best = min(best, time.perf_counter() - started)
        total_plan, total_recipes = total_plan + whole, total_recipes + best
        shown = "; ".join(
            f"{p.recipe} n/a" if p.refused else
            f"{p.recipe} {format_seconds(p.step_time_s)} {format_bytes(p.memory_bytes_per_device)}"
            f"{'' if p.fits else ' (no fit)' if p.fits is False else ' (may fit)'}"
            for p in prices
        )  # fmt: skip
        added = best / (whole - best)
        print(f"{name} | {whole:.2f} | {best:.3f} | {added:.1%} | {shown}", flush=True)
    added = total_recipes / (total_plan - total_recipes)
    print(f"all | {total_plan:.2f} | {total_recipes:.3f} | {added:.1%} |")
    return 0


def _fresh(search: Search) -> Search:
    """The search with its traffic's reshards not yet planned, as a plan first prices them."""
    assert search.prices is not None
    traffic = dataclasses.replace(search.prices.traffic)
    return dataclasses.replace(search, prices=dataclasses.replace(search.prices, traffic=traffic))


if __name__ == "__main__":
    sys.exit(main())

"""The search's objective beside its program's cost, on the CI set (bench/baselines/plan_all.sh).

    python bench/search_objective.py                  # every plan of the CI set
    python bench/search_objective.py gpt2-2x4-1MiB    # some of them, by name
    python bench/search_objective.py --405b 405b-8l   # and 8 layers of the 405B width

`--405b` adds `405b-8l`: 8 layers of the 405B-class shape-only decoder (models/make_models.py,
bench/plan_large.py's widths) trained on 16x8, batch 8, seq 2048, memory free, where SwiGLU's
gradient sums are partial sums the plan adds before reducing once (`search.partials`).

For each plan: the solver's objective (its integer cost times the unit: the scaled costs and
one unit per reshard), the search's unscaled objective of the plan it chose
(`Search.priced`), the materialized program's cost (compute plus collectives, `cost.price`)
and the lowered one's (after the CCL passes: the plan document's `cost.objective`), with the
relative differences, the problem's size and the seconds spent building and solving. The
unscaled objective and the materialized program's cost should agree to float rounding: a
reshard several readers need is priced once, as the program makes it (`search.reads`).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

import onnx

from autoshard.cost.cluster import make_cluster
from autoshard.cost.price import price
from autoshard.passes.materialize import materialize
from autoshard.pipeline import PlanRequest, plan_request
from autoshard.training import Training

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "models"))
from make_models import build_decoder_shape_only  # noqa: E402


def requests() -> dict[str, PlanRequest]:
    """The CI set's plans, read from plan_all.sh's `plan NAME MODEL ARGS...` lines."""
    found = {}
    for line in (ROOT / "bench/baselines/plan_all.sh").read_text().splitlines():
        if not line.startswith("plan "):
            continue
        name, model, *args = shlex.split(line)[1:]
        flags: dict[str, list[str]] = {}
        for flag, value in zip(args[::2], args[1::2], strict=True):
            flags.setdefault(flag, []).append(value)
        dims = dict(d.split("=") for d in flags.get("--dim", []))
        found[name] = PlanRequest(
            model_path=ROOT / f"models/{model}.onnx",
            cluster=make_cluster(mesh=flags["--mesh"][0], memory=flags.get("--memory", [None])[0]),
            dims={k: int(v) for k, v in dims.items()},
            training=Training() if flags.get("--mode") == ["training"] else None,
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="plans of the CI set (default: all)")
    parser.add_argument("--405b", dest="large", action="store_true", help="add 405b-8l")
    args = parser.parse_args()
    folder = tempfile.TemporaryDirectory()
    found = requests()
    if args.large:
        path = Path(folder.name) / "decoder_405b_8l.onnx"
        built = build_decoder_shape_only(
            8, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256
        )
        onnx.save(built.proto, path)
        found["405b-8l"] = PlanRequest(
            model_path=path, cluster=make_cluster("16x8", memory="1TB"),
            dims={"batch": 8, "seq": 2048}, training=Training(),
        )  # fmt: skip
    head = ["plan", "solver", "searched", "materialized", "lowered", "searched/made - 1",
            "groups", "choices", "build s", "solve s", "total s"]  # fmt: skip
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for name, request in found.items():
        if args.names and name not in args.names:
            continue
        started = time.perf_counter()
        answer = plan_request(request)
        total = time.perf_counter() - started
        planned, problem = answer.planned, answer.planned.search.problem
        solver = planned.solution.objective * problem.unit
        searched = planned.search.priced.objective(planned.solution.choice)
        made = price(materialize(answer.graph, planned.plan), answer.graph, answer.cluster)
        row = [name, f"{solver:.9e}", f"{searched:.12e}", f"{made.objective:.12e}",
               f"{planned.cost.objective:.12e}", f"{searched / made.objective - 1:+.1e}",
               str(len(problem.sizes)), str(problem.variables), f"{planned.build_s:.1f}",
               f"{planned.solve_s:.1f}", f"{total:.1f}"]  # fmt: skip
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()

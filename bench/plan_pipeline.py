"""Price pipelined training plans of a shape-only Llama-3.1-405B-class decoder.

    python bench/plan_pipeline.py [--mesh pp=8,dp=8,tp=8] [--micro-batches 32] [--seq 2048]
        [--recompute none|layers]

The decoder (126 layers, hidden 16384, 128 heads, 8 KV heads, SwiGLU 53248, vocab 128256;
bf16-mixed Adam, weights absent) is written to a temporary folder by models/make_models.py and
planned as `autoshard plan --mode training --mesh pp=8,dp=8,tp=8 --cluster dgx-h100` does
(`pipeline.plan_request`): the intra-stage plan searched once on the mesh without the pipeline
axis, at the micro-batch the model is given (`--batch`, split over the stage's devices), then
priced under each schedule (`search.pipelined.price_pipeline`: the same intra-stage plan, so
only the first row's `solve s` and `wall s` are a search). Columns: the predicted step time,
the bubble, the largest stage memory per device against the budget, the first stage's memory
(what it holds besides activations, its activations per micro-batch) and the last's, the p2p
bytes a stage sends per micro-batch, and the times.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import onnx

from autoshard.cost.cluster import make_cluster
from autoshard.cost.schedule import Schedule
from autoshard.errors import PipelineError
from autoshard.pipeline import PlanRequest, plan_request
from autoshard.search.pipelined import pipeline_ask, price_pipeline
from autoshard.training import Training
from autoshard.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "models"))

from make_models import build_decoder_shape_only  # noqa: E402

SCHEDULES = ("1f1b", "gpipe", "interleaved:2", "interleaved:4")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", default="pp=8,dp=8,tp=8")
    parser.add_argument("--layers", type=int, default=126)
    parser.add_argument("--micro-batches", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--recompute", choices=("none", "layers"), default="none")
    parser.add_argument("--time-limit", type=float, default=600.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "decoder_405b.onnx"
        built = build_decoder_shape_only(
            args.layers, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256
        )
        onnx.save(built.proto, path)
        cluster = make_cluster(args.mesh, file="dgx-h100")
        ask = pipeline_ask(cluster.mesh, None, SCHEDULES[0])
        assert ask is not None, f"mesh {args.mesh} has no axis named pp"
        request = PlanRequest(
            model_path=path, cluster=cluster, dims={"batch": args.batch, "seq": args.seq},
            training=Training.parse(micro_batches=args.micro_batches, recompute=args.recompute),
            pipeline=ask,
            time_limit=args.time_limit,
        )  # fmt: skip
        started, cpu = time.perf_counter(), time.process_time()
        requested = plan_request(request)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    planned = requested.planned
    print(f"{args.layers}-layer decoder, mesh {args.mesh}, batch {args.batch} x "
          f"{args.micro_batches} micro-batches, seq {args.seq}, budget "
          f"{format_bytes(cluster.memory)}; one stage: {requested.document.story}")  # fmt: skip
    print(f"{'schedule':>14} {'step s':>8} {'bubble':>7} {'stage max':>10} {'fits':>5} "
          f"{'first':>10} {'held':>10} {'act/mb':>10} "
          f"{'last':>10} {'p2p/mb':>9} {'wall s':>7} {'cpu s':>7} {'solve s':>7}")  # fmt: skip
    for i, name in enumerate(SCHEDULES):
        schedule_ask = type(ask)(ask.axis, Schedule.parse(name))
        try:
            priced = price_pipeline(
                requested.graph, planned.plan, planned.program, planned.cost, cluster,
                schedule_ask, args.layers,
            )  # fmt: skip
        except PipelineError as error:
            print(f"{name:>14} refused: {error}")
            continue
        stages = priced.stages
        times = (f"{wall:>7.2f} {cpu:>7.2f} {planned.solve_s:>7.2f}" if i == 0
                 else f"{'-':>7} {'-':>7} {'-':>7}")  # fmt: skip
        print(
            f"{name:>14} {priced.step_s:>8.3f} {priced.bubble:>7.1%} "
            f"{format_bytes(priced.memory_bytes):>10} "
            f"{'yes' if priced.memory_bytes <= cluster.memory else 'no':>5} "
            f"{format_bytes(stages[0].memory_bytes):>10} {format_bytes(stages[0].held_bytes):>10} "
            f"{format_bytes(stages[0].activation_bytes):>10} "
            f"{format_bytes(stages[-1].memory_bytes):>10} "
            f"{format_bytes(priced.send_bytes):>9} {times}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

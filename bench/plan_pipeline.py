"""Plan shape-only Llama-3-70B and Llama-3.1-405B-class decoders for training with and without
pipelining, and the published hand layout priced beside them.

    python bench/plan_pipeline.py [--rows 405b-pp8,405b-hand,...] [--micro-batches 32]

Rows (`--rows`, default all):

- `70b-none`, `70b-auto`: Llama-3-70B shapes (80 layers, hidden 8192, 64 heads, 8 KV heads,
  SwiGLU 28672, vocab 128256) on 8x8 dgx-h100 (64 H100), without a pipeline and with
  `--pipeline auto` (the search tries no pipeline and 2, 4, 8 stages over the outermost axis).
- `405b-pp8`: the 405B class (126 layers, hidden 16384, 128 heads, 8 KV heads, SwiGLU 53248)
  on `--mesh pp=8,dp=8,tp=8` (512 H100): the search plans the stages and picks the schedule.
- `405b-hand`: the same pipeline with each stage's plan pinned to TorchTitan's FSDP 8 x TP 8
  (the `tp-fsdp` recipe on the stage's dp=8,tp=8, as annotations naming the whole mesh).
- `405b-none`, `405b-auto`: 8x8x8 without a pipeline, and with pipelining allowed.
- `405b32-pp8`: the 405B's width at 32 layers on pp=8,dp=8,tp=8 (the depth's share of the
  solve time: compare with `405b-pp8`).

Every row is `autoshard plan --mode training --cluster dgx-h100 --dim batch=8 --dim seq=2048
--micro-batches 32 --recompute none` at the preset's budget (80 GB less the reserve), bf16-mixed
Adam, fused attention; weights absent. Columns: the predicted step, the largest stage's memory
per device (the plan's own where none), the bubble, the pipeline (stages, schedule), the solve
seconds (CP-SAT, every solve of the row), the row's wall and CPU seconds end to end (import,
search, document); under an auto row, each candidate the search tried.

Measured on the shared 2-core machine (branch ppsearch; wall seconds at load 2-3 where given,
else under load 10-27, CPU seconds comparable):

    row            mesh   step s     memory bubble           pipeline solve s  wall s   cpu s
    405b-pp8  pp=8,dp=8,tp=8  5.935  70.14 GiB  20.0%           8 x 1f1b     7.3    12.8    11.8
    405b32-pp8 pp=8,dp=8,tp=8 1.544  28.95 GiB  18.4%  8 x interleaved:4     0.1     2.3     1.6
    405b-hand pp=8,dp=8,tp=8 12.906  51.51 GiB   3.1%  8 x interleaved:8     0.1    31.6     9.4
    405b-none          8x8x8 84.193  70.13 GiB      -               none   754.8  1210.1   387.7
    70b-none             8x8  8.439  66.44 GiB      -               none   208.3   333.5    43.7
    70b-auto             8x8  7.079  68.75 GiB   2.1%  4 x interleaved:8   267.3  1010.6   140.1
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import onnx

from autoshard.annotations import Annotation
from autoshard.cost.cluster import make_cluster
from autoshard.mesh import Mesh
from autoshard.pipeline import PlanRequest, load_graphs, plan_request
from autoshard.search.pipelined import pipeline_ask
from autoshard.search.pipesearch import stage_depth
from autoshard.search.recipes import Recipe, megatron_splits, recipe_layout
from autoshard.sharding import Sharding
from autoshard.training import Training
from autoshard.training.stages import stage_steps
from autoshard.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "models"))

from make_models import build_decoder_shape_only  # noqa: E402

MODELS = {
    "70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256),
    "405b": dict(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256),
    "405b32": dict(layers=32, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256),
}
ROWS = {  # row -> (model, mesh, pipeline: none | auto | axis | hand)
    "70b-none": ("70b", "8x8", "none"),
    "70b-auto": ("70b", "8x8", "auto"),
    "405b-pp8": ("405b", "pp=8,dp=8,tp=8", "axis"),
    "405b-hand": ("405b", "pp=8,dp=8,tp=8", "hand"),
    "405b32-pp8": ("405b32", "pp=8,dp=8,tp=8", "axis"),
    "405b-none": ("405b", "8x8x8", "none"),
    "405b-auto": ("405b", "8x8x8", "auto"),
}


def hand_annotations(path: Path, dims: dict[str, int], training: Training, mesh: Mesh,
                     layers: int) -> tuple[Annotation, ...]:  # fmt: skip
    """TP x FSDP (`tp-fsdp`) on each stage's devices of a pipeline over axis 0 of `mesh`,
    as annotations naming the whole mesh (the stage's axes one higher)."""
    forward, _ = load_graphs(path, dims, None)
    steps = stage_steps(forward, training)
    depth = stage_depth(layers, mesh.shape[0])
    sub = Mesh(mesh.shape[1:], mesh.axis_names[1:])
    layout = recipe_layout(
        steps.step(depth), megatron_splits(steps.forward(depth), sub), sub, Recipe.TP_FSDP
    )
    assert not layout.refused, layout.refused
    return tuple(
        dataclasses.replace(
            a,
            sharding=dataclasses.replace(
                a.sharding,
                split_axes=tuple(tuple(x + 1 for x in axes) for axes in a.sharding.split_axes),
                partial_axes=tuple(x + 1 for x in a.sharding.partial_axes),
            ),
        )  # fmt: skip
        for a in layout.annotations
        if isinstance(a.sharding, Sharding)
    )


def run_row(name: str, folder: Path, micro_batches: int) -> str:
    model, mesh, how = ROWS[name]
    path = folder / f"{model}.onnx"
    if not path.exists():
        shape = MODELS[model]
        onnx.save(
            build_decoder_shape_only(
                shape["layers"], **{k: v for k, v in shape.items() if k != "layers"}
            ).proto,
            path,
        )
    cluster = make_cluster(mesh, file="dgx-h100")
    dims = {"batch": 8, "seq": 2048}
    training = Training.parse(micro_batches=micro_batches, recompute="none")
    training = training.for_device(cluster.device.flash_attention)
    started, cpu = time.perf_counter(), time.process_time()
    annotations: tuple[Annotation, ...] = ()
    if how == "hand":
        annotations = hand_annotations(path, dims, training, cluster.mesh, MODELS[model]["layers"])
    ask = None if how == "none" else pipeline_ask(cluster.mesh, None, None, how == "auto")
    request = PlanRequest(model_path=path, cluster=cluster, dims=dims, training=training,
                          pipeline=ask, annotations=annotations, time_limit=1200)  # fmt: skip
    try:
        requested = plan_request(request)
    except Exception as error:  # a row that has no plan says why, the others still run
        return f"{name:>11} {mesh:>15}  no plan: {str(error).splitlines()[0][:90]}"
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    document, planned = requested.document, requested.planned
    block = document.pipeline
    if block:
        step, bubble = block["step_time_s"], f"{block['bubble']:.1%}"
        memory = max(s["memory"]["bytes_per_device"] for s in block["stages"])
        pipe = f"{len(block['stages'])} x {block['schedule']}"
    else:
        step, bubble, pipe = planned.cost.objective, "-", "none"
        memory = planned.cost.memory_bytes_per_device
    considered = "".join(f"\n{'':>28}{c['words']}" for c in (block or {}).get("considered", ()))
    if how == "auto" and not block:  # no pipeline chosen: the story says why
        considered = f"\n{'':>28}{document.story.split('.')[0]}"
    return (f"{name:>11} {mesh:>15} {step:>8.3f} {format_bytes(memory):>10} {bubble:>6} "
            f"{pipe:>18} {planned.solve_s:>7.1f} {wall:>7.1f} {cpu:>7.1f}{considered}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--micro-batches", type=int, default=32)
    args = parser.parse_args(argv)
    print(f"{'row':>11} {'mesh':>15} {'step s':>8} {'memory':>10} {'bubble':>6} "
          f"{'pipeline':>18} {'solve s':>7} {'wall s':>7} {'cpu s':>7}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        for name in args.rows.split(","):
            print(run_row(name, Path(folder), args.micro_batches), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

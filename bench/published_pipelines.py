"""[K22] Table 5's pipelined rows (Megatron-LM 175B, 530B and 1T on Selene) planned with the
published layout pinned: tensor parallelism 8 inside each stage, a pipeline over the rest.

    python bench/published_pipelines.py [--rows 175B 530B 1T]

Each run is a shape-only decoder of the published dims (`build_decoder_shape_only`, the GPT
4h GeLU MLP given the SwiGLU width 8h/3 rounded to a multiple of 128: the same parameters and
FLOPs within 0.1 %), global batch and sequence of [K22] Table 3 (sequence 2048, vocabulary
51200; micro-batches of one sequence, so the global batch is the micro-batch count: DP 1),
on `pp=P,dp=1,tp=8` of the `selene` preset (DGX A100 80GB), attention as exported (Megatron
of 2022 ran no flash attention), bf16-mixed Adam. Pinned as `bench/published.py` pins the 22B
rows, on every stage's devices: Megatron's `tp-dp` recipe (weights split over TP,
replicated over DP), each weight's tensor-parallel reads, and with sequence parallelism the
residual stream split on the sequence over TP. Two rows per model: full recompute
(`--recompute layers`) and selective recompute with sequence parallelism (`selective`).

The pipelined plan prices one stage of each depth and the schedule's critical path over the
micro-batches (docs/concepts/pipeline.md): the step is the pipeline's `step_time_s`. Each row
is planned twice, the layout pinned both times: with 1F1B pinned (`--schedule 1f1b`,
Megatron-LM's schedule without virtual stages), and with the schedule the search picks (it
may interleave virtual stages, as Megatron-LM's `--num-layers-per-virtual-pipeline-stage`
does). The layout's free search is not run (a stage of 12 layers on 8 devices per depth).

Source: [K22] Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", MLSys 2023 (arXiv:2205.05198), Tables 3 and 5.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections.abc import Sequence
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
from autoshard.training import Attention, Recompute, Training
from autoshard.training.stages import stage_steps
from autoshard.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "models"))
sys.path.insert(0, str(ROOT / "bench"))

from make_models import build_decoder_shape_only  # noqa: E402
from published import K22, Shape  # noqa: E402


def _swiglu(hidden: int) -> int:
    """A 4h GeLU MLP's SwiGLU width of the same parameters, 8h/3, to a multiple of 128."""
    return round(8 * hidden / 3 / 128) * 128


GPT_175B = Shape("gpt-175b", 96, 12288, 96, 96, _swiglu(12288), 51200)
GPT_530B = Shape("gpt-530b", 105, 20480, 128, 128, _swiglu(20480), 51200)
GPT_1T = Shape("gpt-1t", 128, 25600, 160, 160, _swiglu(25600), 51200)


@dataclasses.dataclass(frozen=True)
class PipelinedRun:
    """A pipelined [K22] run: its shape, global batch (one sequence a micro-batch), pipeline
    stages (TP 8 in each), and the measured seconds per step with full recompute and with
    selective recompute plus sequence parallelism."""

    name: str
    shape: Shape
    batch: int
    stages: int
    full_s: float
    selective_s: float


RUNS = (
    PipelinedRun("175B", GPT_175B, 64, 8, 18.13, 13.75),
    PipelinedRun("530B", GPT_530B, 280, 35, 49.05, 37.83),
    PipelinedRun("1T", GPT_1T, 512, 64, 94.42, 71.49),
)
SEQ = 2048
TP = 8


def _shifted(annotation: Annotation) -> Annotation:
    """`annotation` of a stage's `dp,tp` mesh on the whole `pp,dp,tp` mesh (axes one higher)."""
    sharding = annotation.sharding
    assert isinstance(sharding, Sharding)
    return dataclasses.replace(
        annotation,
        sharding=dataclasses.replace(
            sharding,
            split_axes=tuple(tuple(x + 1 for x in axes) for axes in sharding.split_axes),
            partial_axes=tuple(x + 1 for x in sharding.partial_axes),
        ),
    )


def pins(path: Path, dims: dict[str, int], training: Training, mesh: Mesh, run: PipelinedRun,
         sequence_parallel: bool) -> tuple[Annotation, ...]:  # fmt: skip
    """Megatron's layout on each stage's devices (the module's docstring), as annotations
    naming the whole mesh."""
    forward, _ = load_graphs(path, dims, None)
    steps = stage_steps(forward, training)
    depth = stage_depth(run.shape.layers, run.stages)
    sub = Mesh(mesh.shape[1:], mesh.axis_names[1:])
    tensor = megatron_splits(steps.forward(depth), sub)
    layout = recipe_layout(steps.step(depth), tensor, sub, Recipe.TP_DP)
    if layout.refused:
        raise SystemExit(f"{run.name}: {layout.refused}")
    found = [a for a in layout.annotations if isinstance(a.sharding, Sharding)]
    if not isinstance(tensor, str):
        found += [Annotation(w, s, for_users=True) for w, s in tensor.items()]
    if sequence_parallel:
        stream = [f"layers.{i}.{part}_residual" for i in range(depth) for part in ("attn", "mlp")]
        found += [Annotation(n, Sharding(((0,), (1,), ()))) for n in stream]
    return tuple(_shifted(a) for a in found)


@dataclasses.dataclass(frozen=True)
class Pipelined:
    """A pinned pipelined plan: its step (the schedule's critical path), schedule and bubble,
    the largest stage's memory per device, and the CPU seconds it took."""

    step_s: float
    schedule: str
    bubble: float
    memory: int
    cpu_s: float

    def words(self) -> str:
        return f"{self.step_s:.2f} s ({self.schedule}, bubble {self.bubble:.1%})"


def predict(run: PipelinedRun, path: Path, selective: bool, schedule: str | None) -> Pipelined:
    """`run` with full recompute, or selective recompute and SP, its layout pinned; the
    schedule `schedule`, or the search's choice (None)."""
    mesh_text = f"pp={run.stages},dp=1,tp={TP}"
    cluster = make_cluster(mesh_text, file="selene", memory="100TB")
    dims = {"batch": 1, "seq": SEQ}  # one micro-batch: a sequence
    recompute = Recompute.SELECTIVE if selective else Recompute.LAYERS
    training = Training(recompute=recompute, attention=Attention.AS_EXPORTED,
                        micro_batches=run.batch)  # fmt: skip
    started = time.process_time()
    annotations = pins(path, dims, training, cluster.mesh, run, selective)
    ask = pipeline_ask(cluster.mesh, None, schedule)
    request = PlanRequest(model_path=path, cluster=cluster, dims=dims, training=training,
                          pipeline=ask, annotations=annotations, time_limit=1800)  # fmt: skip
    block = plan_request(request).document.pipeline
    assert block is not None
    memory = max(s["memory"]["bytes_per_device"] for s in block["stages"])
    return Pipelined(float(block["step_time_s"]), str(block["schedule"]), float(block["bubble"]),
                     int(memory), time.process_time() - started)  # fmt: skip


def rows(names: Sequence[str], folder: Path) -> list[str]:
    """The table's rows (`published.py`'s columns) of the runs named: 1F1B pinned (Megatron's
    default schedule), and in the last column the schedule the search picks, layout pinned."""
    usable = make_cluster("8", file="selene").memory
    found = []
    for run in RUNS:
        if run.name not in names:
            continue
        s = run.shape
        path = folder / f"{s.name}.onnx"
        proto = build_decoder_shape_only(
            s.layers, hidden=s.hidden, heads=s.heads, kv_heads=s.kv_heads, ffn=s.ffn,
            vocab=s.vocab,
        ).proto  # fmt: skip
        onnx.save(proto, path)
        for selective, measured in ((False, run.full_s), (True, run.selective_s)):
            pinned = predict(run, path, selective, "1f1b")
            searched = predict(run, path, selective, None)
            ratio = pinned.step_s / measured
            layout = "selective + SP" if selective else "full recompute"
            found.append(
                f"| Megatron {run.name}, TP 8 x PP {run.stages}, {layout} | {K22} "
                f"| {measured:.2f} s | {pinned.words()} | {ratio:.2f} "
                f"| {'yes' if abs(ratio - 1) <= 0.10 else 'no'} | {format_bytes(pinned.memory)} "
                f"| {'yes' if pinned.memory <= usable else 'no'} (usable {format_bytes(usable)}) "
                f"| schedule searched: {searched.words()}, {searched.step_s / measured:.2f}; "
                f"layout not searched ({pinned.cpu_s + searched.cpu_s:.0f} CPU s) |"
            )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=[r.name for r in RUNS])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        for row in rows(args.rows, Path(folder)):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

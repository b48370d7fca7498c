"""Published measured training step times against autoshard's predictions: the published
layout pinned (required annotations and training flags), and the free search.

    python bench/published.py [--quick] [--rows NAME ...] [--time-limit 120]

Each run is a shape-only decoder of the published dims (models/make_models.py's
`build_decoder_shape_only`: Llama-style, RMSNorm and SwiGLU; a GPT's 4h GeLU MLP is given the
SwiGLU width 8h/3 of the same parameters and FLOPs), planned for training as `autoshard plan
--training` does (`pipeline.plan_request`) on the published cluster preset. The Llama rows'
decoder has Llama's float32 islands (`Shape.float32`) and trains on the float32
cross-entropy loss; rows measured with torch.compile are priced with `--kernels compiled`.
The measured step is the published seconds per iteration, or tokens per step over the
published tokens per second. Pinned: the published layout's weights, batch and optimizer state
(`search.recipes`), Megatron's tensor-parallel reads of each weight (annotations for users),
and with sequence parallelism the residual stream (each layer's two residual Adds) held split
on the sequence over the TP axis; planned under an unbounded budget so its memory is reported
even where it does not fit, "fits" comparing it with the device's usable memory (less the
preset's reserve). Free: no annotation, recomputation chosen by the search under the device's
memory.

Sources (docs/concepts/published-runs.md has the table and the analysis):

- [K22] Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
  MLSys 2023 (arXiv:2205.05198): Table 3 (configurations; sequence 2048, vocabulary 51200),
  Table 5 (seconds per iteration, full recompute and selective recompute + sequence
  parallelism), on Selene (DGX A100 80GB).
- [TT24] TorchTitan, benchmarks/llama3_h100_202412_torchtitan.md (pytorch/torchtitan,
  measured 2024-12 at torchtitan 9dec370): Table 1 (Llama 3.1 8B, FSDP on 8 H100, local
  batch 2, selective activation checkpointing) and Table 4 (Llama 3.1 70B, FSDP 32 x TP 8 on
  256 H100, local batch 16, full activation checkpointing, torch.compile, Float8), on Grand
  Teton hosts (H100 96GB HBM2e at 500 W); sequence 8192 (the Llama 3 configs' default).

The 175B, 530B and 1T rows of [K22] Table 5 pipeline over 8, 35 and 64 stages: planned by
`bench/published_pipelines.py` (the layout pinned on every stage; `--no-pipelines` leaves them
out).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx

from autoshard.annotations import Annotation
from autoshard.cost.cluster import make_cluster
from autoshard.pipeline import PlanRequest, load_graph, plan_request
from autoshard.search.recipes import Recipe, megatron_splits, recipe_layout
from autoshard.sharding import Sharding
from autoshard.training import Attention, Precision, Recompute, Training
from autoshard.training.options import Kernels, Loss

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "models"))

from make_models import build_decoder_shape_only  # noqa: E402

K22 = "[K22] Table 5"
TT24 = "[TT24]"


@dataclass(frozen=True)
class Shape:
    """A decoder's dims (`build_decoder_shape_only`)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    float32: bool = False
    """Llama's float32 islands (`build_decoder_shape_only(float32=True)`: RMSNorm and rotary
    embeddings upcast, float32 logits) and its float32 cross-entropy loss over the vocabulary,
    as TorchTitan's Llama runs them; Megatron's GPT normalizes in fused kernels that read and
    write 16-bit and has no rotary embeddings."""


GPT_22B = Shape("gpt-22b", 48, 6144, 64, 64, 16384, 51200)
LLAMA_8B = Shape("llama3.1-8b", 32, 4096, 32, 8, 14336, 128256, float32=True)
LLAMA_70B = Shape("llama3.1-70b", 80, 8192, 64, 8, 28672, 128256, float32=True)


@dataclass(frozen=True)
class Run:
    """A published run: its shape, batch (global) and sequence, mesh (data axes, then the TP
    axis for a TP recipe) on a cluster preset, the layout (a recipe, sequence parallel or not)
    and training flags, and the measured seconds per step with its source."""

    name: str
    shape: Shape
    batch: int
    seq: int
    mesh: str
    cluster: str
    recipe: Recipe
    sequence_parallel: bool
    training: Training
    measured_s: float
    source: str
    quick: bool = False


def _tokens_per_gpu_s(batch: int, seq: int, gpus: int, tps_per_gpu: float) -> float:
    """A step's seconds from tokens per second per GPU."""
    return batch * seq / (gpus * tps_per_gpu)


RUNS = (
    Run("Megatron 22B, TP 8, full recompute", GPT_22B, 4, 2048, "1x8", "selene",
        Recipe.TP_DP, False,
        Training(recompute=Recompute.LAYERS, attention=Attention.AS_EXPORTED),
        1.42, K22, quick=True),
    Run("Megatron 22B, TP 8, selective + SP", GPT_22B, 4, 2048, "1x8", "selene",
        Recipe.TP_DP, True,
        Training(recompute=Recompute.SELECTIVE, attention=Attention.AS_EXPORTED),
        1.10, K22, quick=True),
    Run("TorchTitan 8B, FSDP 8, selective AC", LLAMA_8B, 16, 8192, "8", "grand-teton-h100",
        Recipe.FSDP, False, Training(recompute=Recompute.SELECTIVE_OP),
        _tokens_per_gpu_s(16, 8192, 8, 5762), f"{TT24} Table 1", quick=True),
    Run("TorchTitan 8B, FSDP 8, selective AC, compile", LLAMA_8B, 16, 8192, "8",
        "grand-teton-h100", Recipe.FSDP, False,
        Training(recompute=Recompute.SELECTIVE_OP, kernels=Kernels.COMPILED),
        _tokens_per_gpu_s(16, 8192, 8, 6667), f"{TT24} Table 1", quick=True),
    Run("TorchTitan 8B, FSDP 8, compile + Float8", LLAMA_8B, 16, 8192, "8", "grand-teton-h100",
        Recipe.FSDP, False,
        Training(recompute=Recompute.SELECTIVE_OP, precision=Precision.FP8_MIXED,
                 kernels=Kernels.COMPILED),
        _tokens_per_gpu_s(16, 8192, 8, 8532), f"{TT24} Table 1"),
    Run("TorchTitan 70B, FSDP 32 x TP 8, full AC, compile + Float8", LLAMA_70B, 512, 8192,
        "32x8", "grand-teton-h100", Recipe.TP_FSDP, True,
        Training(recompute=Recompute.LAYERS, precision=Precision.FP8_MIXED,
                 kernels=Kernels.COMPILED),
        _tokens_per_gpu_s(512, 8192, 256, 829), f"{TT24} Table 4"),
)  # fmt: skip


@dataclass(frozen=True)
class Predicted:
    step_s: float
    """The step's critical path: communication overlapped with compute (`cost.overlap`)."""
    compute_s: float
    comm_s: float
    exposed_s: float
    memory: int
    usable: int
    recompute: str
    solve_s: float
    story: str

    @property
    def fits(self) -> bool:
        return self.memory <= self.usable


def _training(run: Run) -> Training:
    """The run's training flags, with the float32 cross-entropy loss where its shape has it."""
    if not run.shape.float32:
        return run.training
    return dataclasses.replace(run.training, loss=Loss.CROSS_ENTROPY)


def pins(run: Run, path: Path) -> list[Annotation]:
    """The published layout as required annotations (the module docstring)."""
    dims = {"batch": run.batch, "seq": run.seq}
    graph = load_graph(path, dims, _training(run))
    forward = load_graph(path, dims, None)
    mesh = make_cluster(run.mesh, file=run.cluster).mesh
    tensor = megatron_splits(forward, mesh)
    layout = recipe_layout(graph, tensor, mesh, run.recipe)
    if layout.refused:
        raise SystemExit(f"{run.name}: {layout.refused}")
    found = list(layout.annotations)
    if not isinstance(tensor, str) and run.recipe in (Recipe.TP_DP, Recipe.TP_FSDP):
        found += [Annotation(w, s, for_users=True) for w, s in tensor.items()]
    if run.sequence_parallel:
        tp, data = mesh.ndim - 1, tuple(range(mesh.ndim - 1))
        stream = [
            f"layers.{i}.{part}_residual"
            for i in range(run.shape.layers) for part in ("attn", "mlp")
        ]  # fmt: skip
        found += [Annotation(n, Sharding((data, (tp,), ()))) for n in stream]
    return found


def predict(run: Run, path: Path, pinned: bool, time_limit: float) -> Predicted:
    cluster = make_cluster(run.mesh, file=run.cluster)
    training = _training(run)
    annotations: Sequence[Annotation] = ()
    if pinned:
        annotations = pins(run, path)
        # Unbounded: the pinned layout's memory is reported, fitting or not.
        cluster = make_cluster(run.mesh, file=run.cluster, memory="100TB")
    else:
        training = Training(
            recompute=Recompute.AUTO, attention=training.attention,
            precision=training.precision, loss=training.loss, kernels=training.kernels,
        )  # fmt: skip
    usable = make_cluster(run.mesh, file=run.cluster).memory
    request = PlanRequest(
        model_path=path, cluster=cluster, dims={"batch": run.batch, "seq": run.seq},
        annotations=annotations, time_limit=time_limit, training=training,
    )  # fmt: skip
    started = time.perf_counter()
    answer = plan_request(request)
    cost = answer.planned.cost
    chosen = answer.document.training
    exposed = cost.schedule.exposed_s if cost.schedule is not None else cost.comm_time_s
    return Predicted(
        cost.step_time_s, cost.compute_time_s, cost.comm_time_s, exposed,
        cost.memory_bytes_per_device, usable,
        _recompute_text(chosen), time.perf_counter() - started,
        answer.document.story or "",
    )  # fmt: skip


def _recompute_text(training: Training | None) -> str:
    """`--recompute` as written (`layers:2`)."""
    if training is None:
        return ""
    every = f":{training.every}" if training.every > 1 else ""
    return f"{training.recompute}{every}"


def _row(run: Run, pinned: Predicted, free: Predicted | None) -> str:
    ratio = pinned.step_s / run.measured_s
    within = "yes" if abs(ratio - 1) <= 0.10 else "no"
    free_text = (
        f"{free.step_s:.2f} s ({free.recompute}, {free.memory / 2**30:.1f} GiB)"
        if free is not None else "-"
    )  # fmt: skip
    return (
        f"| {run.name} | {run.source} | {run.measured_s:.2f} s | {pinned.step_s:.2f} s "
        f"(compute {pinned.compute_s:.2f}, comm {pinned.comm_s:.2f}, exposed "
        f"{pinned.exposed_s:.2f}) | {ratio:.2f} | {within} "
        f"| {pinned.memory / 2**30:.1f} GiB | {'yes' if pinned.fits else 'no'} "
        f"(usable {pinned.usable / 2**30:.1f} GiB) | {free_text} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="22B, 8B, pipelined rows")
    parser.add_argument("--no-free", action="store_true", help="the pinned layouts only")
    parser.add_argument("--rows", nargs="+", metavar="WORD", help="only the rows whose name "
                        "has one of these words (70B, 22B, Float8)")  # fmt: skip
    parser.add_argument("--no-pipelines", action="store_true", help="leave out [K22]'s "
                        "pipelined rows (175B, 530B, 1T)")  # fmt: skip
    parser.add_argument("--time-limit", type=float, default=900.0)
    args = parser.parse_args(argv)
    runs = [r for r in RUNS if r.quick or not args.quick]
    if args.rows:
        runs = [r for r in runs if any(word in r.name for word in args.rows)]
    print(
        "| published run | source | measured | autoshard, layout pinned | ratio | within 10 % "
        "| memory (pinned) | fits | free search (recompute, memory) |\n"
        "| --- | --- | ---: | ---: | ---: | --- | ---: | --- | --- |"
    )
    with tempfile.TemporaryDirectory() as folder:
        built: dict[str, Path] = {}
        free_plans: dict[tuple, Predicted] = {}
        pinned_plans: dict[tuple, Predicted] = {}
        for run in runs:
            s = run.shape
            if s.name not in built:
                built[s.name] = Path(folder) / f"{s.name}.onnx"
                proto = build_decoder_shape_only(
                    s.layers, hidden=s.hidden, heads=s.heads, kv_heads=s.kv_heads, ffn=s.ffn,
                    vocab=s.vocab, float32=s.float32,
                ).proto  # fmt: skip
                onnx.save(proto, built[s.name])
            # Runs alike but for their measurement are one plan.
            layout = (s, run.batch, run.seq, run.mesh, run.cluster, run.recipe,
                      run.sequence_parallel, run.training)  # fmt: skip
            if layout not in pinned_plans:
                pinned_plans[layout] = predict(run, built[s.name], True, args.time_limit)
            pinned = pinned_plans[layout]
            # The free search of runs alike but for the recomputation is one plan.
            key = (s, run.batch, run.seq, run.mesh, run.cluster, run.training.precision,
                   run.training.attention, run.training.kernels)  # fmt: skip
            if not args.no_free and key not in free_plans:
                free_plans[key] = predict(run, built[s.name], False, args.time_limit)
            free = free_plans.get(key)
            print(_row(run, pinned, free), flush=True)
        if not args.no_pipelines:
            from published_pipelines import RUNS as PIPELINED
            from published_pipelines import rows

            names = [r.name for r in PIPELINED]
            if args.rows:
                names = [n for n in names if any(word in n for word in args.rows)]
            for row in rows(names, Path(folder)):
                print(row, flush=True)
    print("\nThe free searches' plans, as their stories tell them:")
    for key, free in free_plans.items():
        print(f"\n{key[0].name} on {key[3]} ({key[4]}), planned in {free.solve_s:.0f} s: "
              f"{free.story}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

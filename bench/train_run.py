"""A training step under `autoshard run` against the single-process step: per model and plan,
the partition trained 3 steps as one process per device on gloo (`run.train.run_training`,
checked against autograd as the tests check it), and the same steps on one process (PyTorch
autograd and torch.optim on the ONNX graph run as torch ops, float32).

    python bench/train_run.py                 # the MLP, GPT-2 and a tiny Llama, 2x2
    python bench/train_run.py --only mlp      # one model

Prints per case: the devices, the run's step (the slowest rank's mean over steps 2..3: the
first pays torch's warm-up), rank 0's compute in it (torch ops) and the rest (collectives and
waiting for peers), the single-process step (best of steps 2..3, once per model), their ratio,
and the run's worst relative error against the exact step (float32 rounding; the tests' bound
is 1e-5). On a CPU host the ranks share its cores, so the ratio says what the step lists, the
collectives and the host's contention cost, not what a GPU cluster would see.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from autoshard.cli.main import main
from autoshard.execute.train_check import Checked, ReferenceRun
from autoshard.execute.train_verify import training_feeds
from autoshard.mesh import Mesh
from autoshard.pipeline import load_graphs
from autoshard.run.train import run_training
from autoshard.search.recipes import megatron_splits, parse_recipe, recipe_layout
from autoshard.training.options import Optimizer, Precision, Training

MODELS = Path(__file__).resolve().parents[1] / "models"
DIMS = {"mlp": {"batch": 8}, "gpt2": {"batch": 4, "seq": 8}, "llama": {}}
CASES = [  # (model, mesh, plan, optimizer)
    ("mlp", "2x2", "dp", "adam"),
    ("mlp", "2x2", "zero", "adam"),
    ("mlp", "2x2", "fsdp", "adam"),
    ("mlp", "2x2", "tp-dp", "adam"),
    ("gpt2", "2x2", "dp", "sgd"),
    ("gpt2", "2x2", "zero", "sgd"),
    ("gpt2", "2x2", "tp-dp", "sgd"),
    ("llama", "2x2", "dp", "adam"),
    ("llama", "2x2", "tp-dp", "adam"),
]


def llama(folder: Path) -> Path:
    """A tiny Hugging Face Llama (2 layers, GQA) exported at opset 23, batch 4 x 8 tokens."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from make_models import export_tiny_llama

    return export_tiny_llama(folder / "llama.onnx", 64, 32, 4, 8)


def partition(folder: Path, model: Path, name: str, mesh: str, recipe: str, optimizer: str) -> Path:
    training = Training(optimizer=Optimizer(optimizer), precision=Precision.FP32)
    forward, graph = load_graphs(model, DIMS[name], training)
    grid = Mesh.parse(mesh)
    layout = recipe_layout(graph, megatron_splits(forward, grid), grid, parse_recipe(recipe, True))
    annotations = folder / f"{name}-{recipe}.json"
    annotations.write_text(json.dumps({"annotations": [a.to_json() for a in layout.annotations]}))
    out = folder / f"{name}-{mesh}-{recipe}"
    dims = [f for k, v in DIMS[name].items() for f in ("--dim", f"{k}={v}")]
    args = ["partition", str(model), "--mesh", mesh, *dims, "-q", "--mode", "training",
            "--precision", "fp32", "--optimizer", optimizer, "--annotations", str(annotations),
            "-o", str(out)]  # fmt: skip
    if main(args) != 0:
        raise SystemExit(f"partition of {name} {recipe} failed")
    return out


def single_step(model: Path, name: str, optimizer: str) -> float:
    """The single-process step in float32: the best of steps 2 and 3 (the host's noise
    aside)."""
    training = Training(optimizer=Optimizer(optimizer), precision=Precision.FP32)
    graph = load_graphs(model, DIMS[name], training)[1]
    run = ReferenceRun(model, Checked.of(graph).trained, optimizer, np.float32)
    times = []
    for feed in training_feeds(graph, 3):
        started = time.perf_counter()
        run.step(feed)
        times.append(time.perf_counter() - started)
    return min(times[1:])


def bench(folder: Path, only: str | None) -> None:
    models = {"mlp": MODELS / "mlp.onnx", "gpt2": MODELS / "gpt2.onnx"}
    single: dict[tuple[str, str], float] = {}
    print("| model | mesh | plan | devices | run step | compute | the rest | one process "
          "| ratio | worst rel err |")  # fmt: skip
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, mesh, recipe, optimizer in CASES:
        if only is not None and name != only:
            continue
        if name not in models:
            models[name] = llama(folder)
        model = models[name]
        out = partition(folder, model, name, mesh, recipe, optimizer)
        report = run_training(out, model, steps=3, timeout_s=300)
        assert report.timing is not None
        ranks = report.timing["ranks"]
        step = max(float(np.mean(r["step_s"][1:])) for r in ranks)  # type: ignore[index]
        first = ranks[0]  # type: ignore[index]
        compute = float(np.mean(first["step_compute_s"][1:]))
        if (name, optimizer) not in single:  # one per model: the plan does not change it
            single[name, optimizer] = single_step(model, name, optimizer)
        one = single[name, optimizer]
        worst = max(c.max_rel_err for c in report.checks)
        print(f"| {name} | {mesh} | {recipe} | {report.devices} | {step * 1e3:.1f} ms "
              f"| {compute * 1e3:.1f} ms | {(step - compute) * 1e3:.1f} ms "
              f"| {one * 1e3:.1f} ms | {step / one:.1f}x | {worst:.2g} |",
              flush=True)  # fmt: skip


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(DIMS), help="one model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        bench(Path(folder), args.only)
    return 0


if __name__ == "__main__":
    sys.exit(cli())

"""What the tests and bench/export_dtensor_train.py that train a DTensor export share: the
plan of a case, its export, and one start of gloo ranks training many cases, each rank's result
saved beside its case (`rank{N}.pt`: the largest errors against one process, the bytes counted
per phase and kind, our and CommDebugMode's calls). torch is imported inside.

A Hugging Face case is planned for a standard recipe (`search.recipes`: the annotations
`explain --why-not RECIPE` pins, found straight from the recipe's layout, with no plan to explain
and none it writes), with every weight read as the recipe holds it (dp, tp-dp) or whole (zero,
fsdp: the weights gathered for their readers, as DDP, ZeRO and FSDP run), or by the search alone
under a memory budget (`searched`)."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autoshard.cli.main import main
from autoshard.export import Target, export_plan
from autoshard.mesh import Mesh
from autoshard.pipeline import load_graphs
from autoshard.search.recipes import megatron_splits, parse_recipe, recipe_layout
from autoshard.training.options import Optimizer, Precision, Training

STEPS = 3
HF_SCALE = 0.01  # SGD at lr 5e-4 on the HF models: the summed logits' gradients are large
RECIPES = ("dp", "zero", "fsdp", "tp-dp", "searched")
# A recipe's plan's wall-clock ceiling: the limit counts from the command's start, and building
# a 2x2x2 training problem (pricing its reads) took more than the default 60 s on a loaded host;
# with the recipe pinned the search itself proves its optimum well within it.
PINNED_S = 300


def notes(written: Sequence[str]) -> dict[str, Any]:
    """An annotations file of `value=sharding` lines, `@users` for how readers read it."""
    found = []
    for note in written:
        users = note.endswith("@users")
        value, _, sharding = note.removesuffix("@users").partition("=")
        found.append({"value": value, "sharding": sharding, "required": True,
                      "for": "users" if users else "result"})  # fmt: skip
    return {"annotations": found}


def plan_mlp(
    folder: Path, model: Path, mesh: str, batch: int, optimizer: str, flags: Sequence[str],
    written: Sequence[str],
) -> None:  # fmt: skip
    """Plan and export the MLP (`model`, already in `folder`) trained on `mesh` with these
    flags and `written` annotations: `plan.json`, `apply.py`, `export.json` in `folder`."""
    (folder / "notes.json").write_text(json.dumps(notes(written)))
    argv = ["plan", str(model), "--mesh", mesh, "--dim", f"batch={batch}", "--mode", "training",
            "--precision", "fp32", "--optimizer", optimizer, *flags, "--annotations",
            str(folder / "notes.json"), "-q", "-o", str(folder / "plan.json")]  # fmt: skip
    assert main(argv) == 0, folder.name
    export_case(folder, model)


def export_case(folder: Path, model: str | Path) -> dict[str, Any]:
    """Export `folder/plan.json` to DTensor: `apply.py` and `export.json` beside it."""
    exported = export_plan(folder / "plan.json", Target.DTENSOR, str(model))
    (folder / "apply.py").write_bytes(exported.payload)
    (folder / "export.json").write_text(json.dumps(exported.document))
    return exported.document


def plan_hf(
    folder: Path, model: Path, mesh: str, recipe: str, optimizer: str, budget: str = ""
) -> None:
    """`folder/plan.json`: the training plan of `recipe` for `model` on `mesh` (see above; a
    search's under `budget`)."""
    common = ["--mesh", mesh, "--mode", "training", "--precision", "fp32", "--optimizer",
              optimizer, "-q"]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):  # the plans' summaries
        if recipe == "searched":
            argv = ["plan", str(model), *common, "--memory", budget]
            assert main([*argv, "-o", str(folder / "plan.json")]) == 0, folder
            return
        pinned = recipe_pins(model, mesh, recipe, optimizer)
        read = {a["value"] for a in pinned if a["for"] == "users"}
        as_held = recipe in ("dp", "tp-dp")
        reads = [
            {**a, "for": "users", "sharding": a["sharding"] if as_held else "[]"}
            for a in pinned
            if a["for"] == "result" and not a["value"].endswith("@state") and a["value"] not in read
        ]
        (folder / "notes.json").write_text(json.dumps({"annotations": pinned + reads}))
        argv = ["plan", str(model), *common, "--annotations", str(folder / "notes.json"),
                "--time-limit", str(PINNED_S)]  # fmt: skip
        assert main([*argv, "-o", str(folder / "plan.json")]) == 0, folder


def recipe_pins(model: Path, mesh: str, recipe: str, optimizer: str) -> list[dict[str, Any]]:
    """The annotations `explain --why-not RECIPE` pins on a training plan of `model` on `mesh`
    (fp32, `optimizer`), as its `-o` plan's search block lists them: the recipe's layout
    (`search.recipes`, Megatron's splits found on the forward), with no plan searched."""
    training = Training(optimizer=Optimizer(optimizer), precision=Precision.FP32)
    forward, graph = load_graphs(model, {}, training)
    grid = Mesh.parse(mesh)
    layout = recipe_layout(graph, megatron_splits(forward, grid), grid, parse_recipe(recipe, True))
    assert not layout.refused, (recipe, layout.refused)
    return [a.to_json() for a in layout.annotations]


def batch_of(name: str) -> tuple[str, int | None]:
    """A case's model name and its batch: `gpt2@8` is GPT-2 at batch 8 (data parallelism
    over 8 devices), `gpt2` at test_hf_models' BATCH (None)."""
    model, _, batch = name.partition("@")
    return model, int(batch) if batch else None


def build(name: str) -> Any:
    """A fresh torch module of `name` (`mlp`: the one models/mlp.onnx came from; `gpt2`,
    `llama`: test_hf_models', at any batch: `batch_of`), the same in every process."""
    import torch

    name = batch_of(name)[0]

    if name == "mlp":
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)
        )
    from tests.export.test_hf_models import build as build_hf

    return build_hf(name)


def batches(name: str) -> list[Any]:
    """The `STEPS` batches a case of model `name` trains on (its input's name: `feed`)."""
    import torch

    if name == "mlp":
        generator = torch.Generator().manual_seed(1)
        return [torch.randn(8, 64, generator=generator) for _ in range(STEPS)]
    from tests.export.test_hf_models import BATCH, SEQ, VOCAB

    batch = batch_of(name)[1] or BATCH
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=generator) for _ in range(STEPS)]


def feed(name: str) -> str:
    return "x" if name == "mlp" else "input_ids"


def train_worker(rank: int, folder: str, cases: dict[str, tuple[str, str, float]]) -> None:
    """On one gloo rank, train each case (its folder under `folder` -> model, optimizer,
    learning-rate scale) by its `apply.py` and in one process; save `rank{rank}.pt`."""
    import torch

    from tests.export.train_step import STEPS as CHECKED
    from tests.export.train_step import distributed, reference, worst

    for case, (name, optimizer, scale) in cases.items():
        path = Path(folder) / case
        got, traffic, _ = distributed(
            path / "apply.py", lambda n=name: build(n), batches(name), optimizer, feed(name), scale
        )
        starts = {step: g["start"] for step, g in zip(CHECKED, got, strict=True) if g["start"]}
        want = reference(build(name), batches(name), optimizer, scale, starts)
        torch.save(
            {"errors": worst(got, want), "bytes": traffic.by_kind(), "calls": traffic.calls(),
             "debug": traffic.debug_calls(),
             "ops": {p: dict(c) for p, c in traffic.seen.items()},
             "debug_ops": {p: dict(c) for p, c in traffic.debug.items()}},
            path / f"rank{rank}.pt",
        )  # fmt: skip

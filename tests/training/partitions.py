"""What the tests that run a training step's partition share: the partition of a standard
recipe's layout (`search.recipes`: its annotations, the rest searched), written by
`autoshard partition` with the step's flags."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from autoshard.cli.main import main
from autoshard.mesh import Mesh
from autoshard.pipeline import load_graphs
from autoshard.search.recipes import megatron_splits, parse_recipe, recipe_layout
from autoshard.training.options import Training


def step_flags(dims: Mapping[str, int], training: Training) -> list[str]:
    """The CLI flags of bound `dims` and of the training step `training`."""
    return [*(f for k, v in dims.items() for f in ("--dim", f"{k}={v}")), "--mode", "training",
            "--precision", training.precision, "--optimizer", training.optimizer,
            "--loss", training.loss, "--micro-batches", str(training.micro_batches)]  # fmt: skip


def recipe_partition(
    folder: Path, model: Path, dims: Mapping[str, int], mesh: str, recipe: str, training: Training
) -> Path:
    """The partition of `recipe`'s layout of `model`'s training step on `mesh`, written under
    `folder` (named by the model and the recipe)."""
    forward, graph = load_graphs(model, dims, training)
    grid = Mesh.parse(mesh)
    layout = recipe_layout(graph, megatron_splits(forward, grid), grid, parse_recipe(recipe, True))
    assert not layout.refused, layout.refused
    annotations = folder / f"{recipe}.json"
    annotations.write_text(json.dumps({"annotations": [a.to_json() for a in layout.annotations]}))
    out = folder / f"{model.stem}-{recipe}"
    args = ["partition", model, "--mesh", mesh, *step_flags(dims, training), "-q",
            "--annotations", annotations, "-o", out]  # fmt: skip
    assert main([str(a) for a in args]) == 0
    return out

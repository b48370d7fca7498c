"""What the tests that run a training step's partition share: the partition of a standard
recipe's layout (`search.recipes`: its annotations, the rest searched), written as `autoshard
partition` writes it, with the partition built for it: a run given it (`run_training`'s
`built`) does not build it again from the model."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from autoshard.execute.artifacts import write_built
from autoshard.mesh import Mesh
from autoshard.pipeline import Built, Setup, build_setup, load_graphs
from autoshard.search.recipes import megatron_splits, parse_recipe, recipe_layout
from autoshard.training.options import Training


def step_flags(dims: Mapping[str, int], training: Training) -> list[str]:
    """The CLI flags of bound `dims` and of the training step `training`."""
    return [*(f for k, v in dims.items() for f in ("--dim", f"{k}={v}")), "--mode", "training",
            "--precision", training.precision, "--optimizer", training.optimizer,
            "--loss", training.loss, "--micro-batches", str(training.micro_batches)]  # fmt: skip


def recipe_partition(
    folder: Path, model: Path, dims: Mapping[str, int], mesh: str, recipe: str, training: Training
) -> tuple[Path, Built]:
    """The partition of `recipe`'s layout of `model`'s training step on `mesh`, written under
    `folder` (named by the model and the recipe), and the partition built."""
    forward, graph = load_graphs(model, dims, training)
    grid = Mesh.parse(mesh)
    layout = recipe_layout(graph, megatron_splits(forward, grid), grid, parse_recipe(recipe, True))
    assert not layout.refused, layout.refused
    setup = Setup(model=Path(model), mesh=grid, dims=dict(dims),
                  annotations=tuple(layout.annotations), training=training)  # fmt: skip
    built = build_setup(setup)
    out = folder / f"{Path(model).stem}-{recipe}"
    write_built(setup, built, out)
    return out, built

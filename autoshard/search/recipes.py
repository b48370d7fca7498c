"""The standard layouts a performance engineer would write by hand, as required annotations:
the recipes every plan is priced beside (`recipe_prices`), and `explain --why-not` pins.

A recipe says how the batch is held and read (it stays split: free to gather it, a search
would compute a small model replicated and call that data parallel), how every weight is
held and, for a training step, how each trained weight's optimizer state (`W@state`) is held.
The ops between, gradients included, are left to the search, as `autoshard plan` with these
annotations leaves them. With D the data-parallel mesh axes and T the tensor-parallel axis
(the last one, a node's fast links in a cluster's mesh):

    recipe   batch   weight held                optimizer state
    dp       all     replicated                 replicated        (DDP)
    zero     all     replicated                 split over all    (ZeRO-1/2)
    fsdp     all     split over all             split over all    (FSDP, ZeRO-3)
    tp-dp    D       Megatron on T              as held           (Megatron TP x DP)
    tp-fsdp  D       Megatron on T, split on D  as held           (TP x FSDP)

ZeRO-1 and ZeRO-2 send the same (the gradient reduce-scattered to the state's shards, the
updated weight all-gathered) and differ in a gradient buffer: the search keeps the gradient
as it likes, so one recipe stands for both. "Split over" axes: added to the first dim of the
weight (after its Megatron split, if any) whose size they divide, as the search's own FSDP
candidates are (`problem._split_further`); a weight no such dim fits stays as read.
Megatron's splits are `baselines.megatron`'s, found on the forward graph (a training step's
backward hides its patterns). Inference plans are priced beside dp and tp-dp only: the others
differ from them in training state alone. TP x PP waits for pipelines.

Worked example, the MLP (x [8, 64] -> Gemm 0.weight [256, 64] -> Relu -> Gemm 2.weight
[64, 256], transB) on mesh 2x2, inference: dp holds and reads x as [[0, 1]] and every weight
replicated; tp-dp holds x as [[0]], 0.weight and 0.bias as [[1]] (output features) and
2.weight as [[], [1]] (input features).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoshard.annotations import Annotation
from autoshard.errors import AutoshardError
from autoshard.ir.graph import Graph
from autoshard.mesh import Mesh
from autoshard.search.baselines import BaselineError, data_parallel, megatron
from autoshard.sharding import Sharding
from autoshard.training.step import state_name


class Recipe(enum.StrEnum):
    """A standard layout, by the name `explain --why-not` takes (the module docstring)."""

    DP = "dp"
    ZERO = "zero"
    FSDP = "fsdp"
    TP_DP = "tp-dp"
    TP_FSDP = "tp-fsdp"

    @property
    def label(self) -> str:
        """What users call it."""
        return _LABELS[self]

    @property
    def training_only(self) -> bool:
        return self in (Recipe.ZERO, Recipe.FSDP, Recipe.TP_FSDP)


_LABELS = {
    Recipe.DP: "DDP",
    Recipe.ZERO: "ZeRO-1/2",
    Recipe.FSDP: "FSDP, ZeRO-3",
    Recipe.TP_DP: "Megatron TP x DP",
    Recipe.TP_FSDP: "TP x FSDP",
}


class RecipeError(AutoshardError):
    """A recipe name that is not one of the recipes."""


def recipes_for(training: bool) -> tuple[Recipe, ...]:
    """The recipes a plan is priced beside: all for a training step, dp and tp-dp else."""
    return tuple(r for r in Recipe if training or not r.training_only)


ALIASES = {"ddp": Recipe.DP, "zero1": Recipe.ZERO, "zero2": Recipe.ZERO, "zero3": Recipe.FSDP}
"""Other names users give: ZeRO-1 and ZeRO-2 send the same (a gradient reduce-scatter, then
the updated weights' all-gather), so one recipe stands for both."""


def parse_recipe(text: str, training: bool, what: str = "recipe") -> Recipe:
    """A recipe by name (or `ALIASES`), or one line naming the valid ones (those of the
    plan's mode); `what` names the text in the error."""
    valid = ", ".join(recipes_for(training))
    key = text.strip().lower()
    try:
        recipe = ALIASES.get(key) or Recipe(key)
    except ValueError:
        raise RecipeError(f"{what}: unknown recipe {text!r}; choose one of: {valid}") from None
    if recipe.training_only and not training:
        raise RecipeError(
            f"{what}: recipe {recipe} is a training layout and this plan is inference; choose "
            f"one of: {valid}"
        )
    return recipe


@dataclass(frozen=True)
class Layout:
    """A recipe on one graph and mesh: its annotations, or why it does not apply (`refused`)."""

    recipe: Recipe
    annotations: tuple[Annotation, ...] = ()
    refused: str = ""


def recipe_layouts(graph: Graph, forward: Graph, mesh: Mesh) -> tuple[Layout, ...]:
    """The layouts of the recipes of the plan's mode (`recipes_for`), Megatron's splits
    found once."""
    tensor = megatron_splits(forward, mesh)
    return tuple(recipe_layout(graph, tensor, mesh, r) for r in recipes_for(bool(graph.updates)))


def megatron_splits(forward: Graph, mesh: Mesh) -> dict[str, Sharding] | str:
    """How Megatron over the last mesh axis reads each weight it splits, or why it cannot."""
    if mesh.ndim < 2:
        return f"needs two mesh axes (TP and DP); mesh {mesh} has one"
    try:
        found = {a.value: a.sharding for a in megatron(forward, mesh, mesh.ndim - 1)}
    except BaselineError as error:
        return str(error)
    return found or "no Megatron pattern in the model to split"


def recipe_layout(
    graph: Graph, tensor: Mapping[str, Sharding] | str, mesh: Mesh, recipe: Recipe
) -> Layout:
    """The required annotations of `recipe` for `graph` (a forward, or a training step) on
    `mesh` (see the module docstring); `tensor`: `megatron_splits` of the forward."""
    tp = recipe in (Recipe.TP_DP, Recipe.TP_FSDP)
    if tp and isinstance(tensor, str):
        return Layout(recipe, refused=tensor)
    used = tensor if tp and not isinstance(tensor, str) else {}
    data = tuple(range(mesh.ndim - 1)) if tp else tuple(range(mesh.ndim))
    try:
        batch = data_parallel(graph, mesh, data)
    except BaselineError as error:
        return Layout(recipe, refused=str(error))
    split_held = recipe in (Recipe.FSDP, Recipe.TP_FSDP)
    split_state = split_held or recipe is Recipe.ZERO
    # Read as held, too: a recipe's batch stays split, where a search free to gather it would
    # compute a small model replicated and call that data parallel.
    found = [*batch, *(Annotation(a.value, a.sharding, for_users=True) for a in batch)]
    for name in _weights(graph):
        shape = graph.values[name].shape
        read = used.get(name, Sharding())
        split = _further(read, shape, data, mesh)
        found.append(Annotation(name, split if split_held else read))
        if name in graph.replaced:
            state = split if split_state else read
            found.append(Annotation(state_name(name), Sharding(((), *state.split_axes))))
    return Layout(recipe, tuple(found))


def _weights(graph: Graph) -> list[str]:
    """The weights ops read, in graph order."""
    return [n for n in graph.weights if n in graph.values and graph.consumers(n)]


def _further(read: Sharding, shape: tuple[int, ...], axes: Sequence[int], mesh: Mesh) -> Sharding:
    """`read` split further over those of `axes` it leaves unused, on the first dim they
    divide (after its own axes there); `read` itself when none does."""
    used = {a for dim_axes in read.split_axes for a in dim_axes}
    extra = tuple(a for a in axes if a not in used)
    if not extra:
        return read
    for dim, size in enumerate(shape):
        split = (*read.axes_of(dim), *extra)
        if size % mesh.group_size(split) == 0:
            dims = [read.axes_of(d) for d in range(len(shape))]
            dims[dim] = split
            return Sharding(tuple(dims))
    return read

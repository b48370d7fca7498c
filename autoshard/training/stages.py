"""A pipeline stage's training step: the model cut to a stage's repeated layers
(`analysis.shorten`), attention fused as in the whole model's, its recomputation, and the
training step built around it, as `pipeline.load_graphs` builds the whole model's."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

from autoshard.analysis.attention import find_attention
from autoshard.analysis.shorten import layer_run, shortened
from autoshard.ir.graph import Graph
from autoshard.training.options import Training
from autoshard.training.replay import replays
from autoshard.training.step import training_graph


@dataclass(frozen=True)
class StageSteps:
    """A forward graph's repeated `layers` (0: none) and, for a count `k` of them, the forward
    cut to `k` (`forward`) and its training step (`step`), each made once."""

    layers: int
    forward: Callable[[int], Graph]
    step: Callable[[int], Graph]


def stage_steps(forward: Graph, training: Training) -> StageSteps:
    """`StageSteps` of `forward` under `training`."""
    run = layer_run(forward)

    @functools.cache
    def cut(layers: int) -> Graph:
        found = shortened(forward, layers, run)
        if training.fused_attention:
            found = dataclasses.replace(found, fused=find_attention(found))
        return found

    @functools.cache
    def step(layers: int) -> Graph:
        return training_graph(cut(layers), training, replays(cut(layers), training))

    return StageSteps(run.count if run is not None else 0, cut, step)

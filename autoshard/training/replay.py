"""What a training step's backward recomputes (`Replay`s, from `Training.recompute`); what
that buys and costs in a plan is `cost.replay`'s.

- `layers`: each repeated layer (`find_repeats`' first run) runs again at the start of its
  backward; of its activations only its inputs are kept. `layers:K` so recomputes every K-th
  layer (the first of each K), the others keeping everything: between none and all.
- `selective` (Korthikanti et al., *Reducing Activation Recomputation in Large Transformer
  Models*): each attention core's ops from the scores' MatMul to the probabilities
  (`find_attention`) run again just before the backward of the MatMul reading the
  probabilities, so the S x S scores and probabilities are not kept: the tensors that grow
  with the square of the sequence, for the core's few FLOPs. Under fused attention the
  kernel keeps no S x S tensor and its backward already recomputes the core (flash
  attention), so selective recomputes nothing there.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.analysis.attention import find_attention
from autoshard.analysis.repeats import find_repeats
from autoshard.ir.graph import Graph
from autoshard.training.options import Recompute, Training


@dataclass(frozen=True)
class Replay:
    """Forward ops (positions in the forward graph) run again in the backward, just before
    the backward of the op at position `before` (the last op of a layer; the MatMul that
    reads a core's probabilities)."""

    ops: tuple[int, ...]
    before: int


def replays(graph: Graph, training: Training) -> tuple[Replay, ...]:
    """The recomputations `training` asks for in forward `graph` (module docstring); none for
    `none` and `auto` (the pipeline decides `auto` first)."""
    if training.recompute is Recompute.LAYERS:
        spans = [r.span(j) for r in find_repeats(graph).runs[:1] for j in range(r.count)]
        return tuple(
            Replay(tuple(span), span[-1]) for j, span in enumerate(spans)
            if span and j % training.every == 0
        )  # fmt: skip
    if training.recompute is Recompute.SELECTIVE and not training.fused_attention:
        position = {op.name: i for i, op in enumerate(graph.ops)}
        found = []
        for region in find_attention(graph).regions:
            places = sorted(position[name] for name in region.ops)
            found.append(Replay(tuple(places[:-1]), places[-1]))
        return tuple(found)
    return ()

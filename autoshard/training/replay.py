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
- `selective-op` (TorchTitan's op-level selective activation checkpointing, `apply_ac`'s
  policy in `torchtitan/.../activation_checkpoint.py`): in each repeated layer every op runs
  again at the start of its backward but every other linear matmul (the 1st, 3rd, ... of
  the layer's, in program order: TorchTitan counts the layer's `aten.mm` calls and saves the
  odd ones) and the fused attention kernels (SDPA is on its save list), whose results are
  kept. What it frees is the layer's cheap elementwise results (norms, activations, rotary,
  residual adds) and half its matmul results, for the compute of those ops and of the other
  half of its matmuls. Under attention as exported the core's ops are recomputed like the
  rest, as TorchTitan's policy does with an unfused core.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from autoshard.analysis.attention import find_attention
from autoshard.analysis.repeats import find_repeats
from autoshard.ir.graph import Graph, Op
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
    spans = [r.span(j) for r in find_repeats(graph).runs[:1] for j in range(r.count)]
    if training.recompute is Recompute.LAYERS:
        return tuple(
            Replay(tuple(span), span[-1]) for j, span in enumerate(spans)
            if span and j % training.every == 0
        )  # fmt: skip
    if training.recompute is Recompute.SELECTIVE_OP:
        kept = _saved_ops(graph)
        found = [
            Replay(tuple(i for i in span if graph.ops[i].name not in kept), span[-1])
            for span in spans if span
        ]  # fmt: skip
        return tuple(replay for replay in found if replay.ops)
    if training.recompute is Recompute.SELECTIVE and not training.fused_attention:
        position = {op.name: i for i, op in enumerate(graph.ops)}
        found = []
        for region in find_attention(graph).regions:
            places = sorted(position[name] for name in region.ops)
            found.append(Replay(tuple(places[:-1]), places[-1]))
        return tuple(found)
    return ()


LINEAR = frozenset({"MatMul", "Gemm"})
WEIGHT_VIEWS = frozenset({"Transpose", "Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze"})
"""Ops that hand a weight on as a weight: a linear layer reads its weight through them."""


def linear_ops(graph: Graph, trained: Iterable[str]) -> list[Op]:
    """The linear layers' matmuls of `graph`, in program order: a MatMul or Gemm of an
    activation by a `trained` weight (read as is or through views and casts: a transposed
    weight)."""
    weights = set(trained)
    for op in graph.ops:
        if op.type in WEIGHT_VIEWS and op.inputs and op.inputs[0] in weights:
            weights.update(o for o in op.outputs if o)
    return [
        op for op in graph.ops
        if op.type in LINEAR and len([n for n in op.inputs[:2] if n in weights]) == 1
    ]  # fmt: skip


def _saved_ops(graph: Graph) -> set[str]:
    """The ops whose results `selective-op` keeps (module docstring): every other linear
    matmul of each repeated layer, counted from its first, and every op of a fused region
    (the flash kernel's output and row statistics are what it keeps anyway); the ops making
    a causal mask only fused kernels read, which run nowhere."""
    saved = {name for region in graph.fused.regions for name in region.ops}
    saved |= graph.fused.masks
    runs = find_repeats(graph).runs[:1]
    linear = {op.name for op in linear_ops(graph, graph.weights)}
    for run in runs:
        for j in range(run.count):
            matmuls = [graph.ops[i].name for i in run.span(j) if graph.ops[i].name in linear]
            saved.update(matmuls[::2])
    return saved

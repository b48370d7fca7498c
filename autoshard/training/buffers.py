"""Which weights a training step trains: the parameters, told apart from buffers by the graph.

An export stripped of dynamo's metadata (or any exporter that writes none) keeps a torch buffer
as a plain initializer: Llama's rotary `inv_freq` reads like a parameter, yet the model only
computes constant tables from it (the cos/sin of the positions times the frequencies). The rule
below recognises such buffers from the graph alone, whatever the exporter wrote.

- A value is *constant* when no graph input is in its cone: a weight, a constant the importer
  folded, or a result of an op that reads constants only. The ops reading only constants form
  the *constant subgraph*; an op reading any other value reads an *activation*.
- A *table* is a float constant of more than one element that is not a weight and is computed
  from no parameter (positions computed from the sequence length, a mask), or any result of a
  constant op that reads a table as float data.
- Inside the constant subgraph a weight stays a parameter through ops that re-lay it out or
  combine it with other weights, scalars and integer operands (Transpose, Cast, Reshape,
  Concat, `1 + w`, `a @ b`): their float results *carry* it. A result that is a table carries
  none: the weight went into a table computed from constants, as a buffer does.
- A float weight of more than one element, read as data and not marked a buffer by the export
  (`Graph.buffers`), is *trained* when an op outside the constant subgraph reads, as float
  data, a value carrying it, and a float result of that op reaches a model output through
  float data (a differentiable path to the loss). Every other weight is a buffer.

    inv_freq ─Mul(positions)→ table ─Concat→ Cos, Sin ─Mul(q, ·)      inv_freq: a buffer
    W ─Transpose→ Wᵀ (carries W) ─MatMul(x, Wᵀ)                        W: trained
    E ─Gather(·, positions) (integer operand) ─Add(x, ·)              E: trained

A weight multiplied by a float constant table of its own (a pruning mask folded to a constant)
would count as a buffer; exporters keep such masks as initializers (weights), which are no
tables.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from autoshard.ir import dtypes
from autoshard.ir.graph import Graph, Op

IsData = Callable[[Op, int], bool]
"""Whether operand `index` of an op is data (not a shape, axes or other parameter)."""


def trained_weights(graph: Graph, is_data: IsData) -> list[str]:
    """The weights a training step trains (see the module docstring), in the order the
    forward first reads them."""
    maybe = candidates(graph, is_data)
    live = _reaching_outputs(graph, is_data)
    carried: dict[str, frozenset[str]] = {w: frozenset({w}) for w in maybe}
    constant = set(graph.weights) | set(graph.constants)
    tables = {
        name
        for name, array in graph.constants.items()
        if name not in graph.weights and array.size > 1 and _is_float(graph, name)
    }
    trained: set[str] = set()
    for op in graph.ops:
        data = [
            name
            for i, name in enumerate(op.inputs)
            if name and is_data(op, i) and _is_float(graph, name)
        ]
        if not all(name in constant for name in op.inputs if name):
            if any(name in live for name in op.outputs if name):
                trained.update(*(carried.get(name, ()) for name in data))
            continue
        outputs = [name for name in op.outputs if name]
        constant.update(outputs)
        floats = [name for name in outputs if _is_float(graph, name)]
        if any(name in tables for name in data):
            tables.update(floats)
            continue
        made = frozenset().union(*(carried.get(name, ()) for name in data))
        for name in floats:
            if made:
                carried[name] = made
            elif graph.values[name].size > 1:
                tables.add(name)
    return [w for w in maybe if w in trained]


def candidates(graph: Graph, is_data: IsData) -> list[str]:
    """The weights that may be parameters, in first-read order: float weights of more than one
    element read as data (a scalar is a constant of the model: an epsilon, a scale), less the
    buffers the export marks."""
    found: dict[str, None] = {}
    for op in graph.ops:
        for i, name in enumerate(op.inputs):
            weight = graph.weights.get(name)
            if (
                weight
                and weight.size > 1
                and name not in graph.buffers
                and _is_float(graph, name)
                and is_data(op, i)
            ):
                found[name] = None
    return list(found)


def _reaching_outputs(graph: Graph, is_data: IsData) -> set[str]:
    """The float values a model output is computed from through float data operands."""
    live = {name for name in graph.outputs if _is_float(graph, name)}
    for op in reversed(graph.ops):
        if any(name in live for name in op.outputs if name):
            live.update(
                name
                for i, name in enumerate(op.inputs)
                if name and is_data(op, i) and _is_float(graph, name)
            )
    return live


def _is_float(graph: Graph, name: str) -> bool:
    return graph.values[name].dtype in dtypes.FLOAT_DTYPES


NAMED = 3
"""How many buffers (or patterns of a repeated layer's buffers) a page names: a 70B decoder
has one rotary table per layer, told as one pattern."""


def buffer_names(graph: Graph) -> list[str]:
    """A training step's buffers (`Graph.buffers`: the export's and those found here) among
    its weights, in the weights' order."""
    return [name for name in graph.weights if name in graph.buffers]


def buffers_text(names: Sequence[str], sources: Mapping[str, str] | None = None) -> str:
    """`2 buffers (inv_freq, M)`; the buffers of repeated layers as one pattern with their
    count, a layer's index as `*`: `80 buffers (layers.*.rotary_emb.inv_freq (80))`; at most
    `NAMED` told, then how many more. `sources` names them by their source parameters."""
    groups: dict[str, list[str]] = {}
    for name in names:
        told = (sources or {}).get(name, name)
        groups.setdefault(re.sub(r"\d+", "*", told), []).append(told)
    shown = [f"{key} ({len(g)})" if len(g) > 1 else g[0] for key, g in groups.items()]
    more = f", and {len(shown) - NAMED} more" if len(shown) > NAMED else ""
    plural = "s" if len(names) != 1 else ""
    return f"{len(names)} buffer{plural} ({', '.join(shown[:NAMED])}{more})"

"""Attention cores found by structure, whatever the exporter wrote (`find_attention`).

An attention core is softmax(mask(scale · Q·Kᵀ))·V over the last axis:

    scores = MatMul(Q, Kᵀ)             Q [..., s_q, d], Kᵀ [..., d, s_kv]: both activations
    s      = scale, mask: Mul, Div, Add, Sub, Where, Cast ... of scores and a non-scores value
    p      = Softmax(s, axis=-1)       then Cast or Dropout, maybe
    out    = MatMul(p, V)              V [..., s_kv, d_v]: an activation

TorchScript and dynamo exports spell it so (dynamo may scale Q and K apart, before the
MatMul: outside the core). Each value between the two MatMuls must be read inside the core
alone (a kernel that keeps them on chip cannot hand them to another op). Kᵀ and V are traced
back through the Transpose that turns K and the Expand/Tile/Unsqueeze/Reshape that repeat
grouped key/value heads for the query heads (GQA), to the K and V the kernel reads, whose
size gives the key/value heads. The mask is causal when a Trilu makes it, or it is a constant
triangle (through Slice, Cast, views, comparisons).

A MatMul–Softmax–MatMul whose MatMuls multiply by weights (a softmax between projections) is
no attention: both MatMuls must multiply two activations.
"""

from __future__ import annotations

import math

import numpy as np

from autoshard.analysis.patterns import shape_of, weight_source
from autoshard.ir.fused import AttentionRegion, Fused
from autoshard.ir.graph import Graph, Op

_ON_SCORES = frozenset({"Mul", "Div", "Add", "Sub", "Where", "Cast", "Max", "Min"})
"""Ops that may scale, mask or cast the scores between the MatMul and the Softmax."""

_AFTER_SOFTMAX = frozenset({"Cast", "Dropout", "Identity"})

_REPEAT_HEADS = frozenset({"Transpose", "Expand", "Tile", "Unsqueeze", "Reshape", "Squeeze",
                           "Identity", "Cast"})  # fmt: skip
"""Ops between K (V) and the MatMul reading it: the transpose of K and GQA's repeat of heads."""

_MASK_WAY = frozenset({"Slice", "Cast", "Reshape", "Unsqueeze", "Squeeze", "Expand", "Not", "And",
                       "Equal", "Where", "Sub", "Mul", "Identity", "Less", "Greater"})  # fmt: skip
"""Ops through which a causal triangle reaches the scores as a mask."""


def find_attention(graph: Graph) -> Fused:
    """The attention cores of `graph`, each as one fused region, and the ops making the
    causal masks only their kernels read (the module's docstring)."""
    fused = Fused.of(r for op in graph.ops if (r := _region(graph, op)) is not None)
    return fused.with_masks(*_kernel_masks(graph, fused))


_MAKES_MASK = _MASK_WAY | {"Trilu", "ConstantOfShape"}


def _kernel_masks(graph: Graph, fused: Fused) -> tuple[set[str], set[str]]:
    """The ops (and their values) that make a causal mask read by causal cores alone: a
    causal flash kernel masks its tiles itself, so it needs none of them. An op counts when
    its type is a mask's (`_MAKES_MASK`), each value it makes is read by a causal core's
    scale-and-mask ops or by ops that count, and it reads no tensor of two dims or more but
    constants and values of ops that count (never a padding mask made from the inputs)."""
    chain = {
        name for r in fused.regions if r.causal
        for name in r.ops[1 : r.ops.index(r.softmax)]
    }  # fmt: skip
    if not chain:
        return set(), set()
    position = {op.name: i for i, op in enumerate(graph.ops)}
    candidates: dict[str, Op] = {}
    stack = [n for name in chain for n in graph.op_by_name[name].inputs if n]
    while stack:
        op = graph.producer(stack.pop())
        if op is not None and op.type in _MAKES_MASK and op.name not in {*candidates, *chain}:
            candidates[op.name] = op
            stack += [n for n in op.inputs if n]
    accepted, before = set(candidates), None
    while accepted != before:  # drop what a kept reader or a data input rules out, to a fixpoint
        before = set(accepted)
        made = {n for name in accepted for n in candidates[name].outputs if n}
        for name in sorted(before, key=position.__getitem__):
            op = candidates[name]
            readers = {r.name for n in op.outputs if n for r in graph.consumers(n)}
            data = [n for n in op.inputs if n and len(shape_of(graph, n)) >= 2]
            if (
                any(n in graph.outputs for n in op.outputs)
                or not readers <= chain | accepted
                or any(n not in graph.constants and n not in made for n in data)
            ):  # fmt: skip
                accepted.discard(name)
    values = {n for name in accepted for n in candidates[name].outputs if n}
    # Constants (folded masks) read by the causal cores and counted ops alone, and those the
    # folder left read by nothing (the full matrix a triangle was cut from).
    for name, array in graph.constants.items():
        readers = {r.name for r in graph.consumers(name)}
        if (
            name in graph.values and name not in graph.outputs and array.ndim >= 2
            and readers <= chain | accepted
        ):  # fmt: skip
            values.add(name)
    return accepted, values


def _only_reader(graph: Graph, value: str) -> Op | None:
    readers = graph.consumers(value)
    return readers[0] if len(readers) == 1 and value not in graph.outputs else None


def _is_activation(graph: Graph, name: str) -> bool:
    return bool(name) and name not in graph.constants and weight_source(graph, name) is None


def _region(graph: Graph, softmax: Op) -> AttentionRegion | None:
    if softmax.type != "Softmax" or not softmax.outputs[0]:
        return None
    shape = shape_of(graph, softmax.inputs[0])
    # Before opset 13 the default axis is 1 and the input is coerced to 2-D there: over the
    # last axis alone only when the axis is the last.
    axis = softmax.attr("axis", 1 if 0 < graph.opset < 13 else -1)
    if len(shape) < 3 or axis not in (-1, len(shape) - 1):
        return None
    before = _back_to_scores(graph, softmax)
    if before is None:
        return None
    scores_op, chain = before
    after = _on_to_output(graph, softmax)
    if after is None:
        return None
    output_op, tail = after
    q, k_t = scores_op.inputs[0], scores_op.inputs[1]
    v_in = output_op.inputs[1]
    if not all(_is_activation(graph, n) for n in (q, k_t, v_in)):
        return None
    q_shape, v_shape = shape_of(graph, q), shape_of(graph, v_in)
    if (
        len(q_shape) != len(shape)
        or q_shape[-2] != shape[-2]
        or shape_of(graph, k_t)[-2:] != (q_shape[-1], shape[-1])
        or v_shape[-2] != shape[-1]
    ):
        return None  # fmt: skip
    ops = (scores_op, *chain, softmax, *tail, output_op)
    heads = shape[-3]
    k, v = _source(graph, k_t), _source(graph, v_in)
    kv_heads = heads * math.prod(shape_of(graph, k)) // math.prod(shape_of(graph, k_t))
    return AttentionRegion(
        ops=tuple(op.name for op in ops),
        inside=tuple(op.outputs[0] for op in ops[:-1]),
        softmax=softmax.name,
        probabilities=softmax.outputs[0],
        q=q,
        k=k,
        v=v,
        output=output_op.outputs[0],
        heads=heads,
        kv_heads=max(1, kv_heads),
        head_dim=q_shape[-1],
        causal=any(_causal(graph, n) for op in chain for n in op.inputs if n),
    )


def _back_to_scores(graph: Graph, softmax: Op) -> tuple[Op, list[Op]] | None:
    """The MatMul making the scores and the ops from it to the softmax, each the only reader of
    the value before it."""
    chain: list[Op] = []
    value = softmax.inputs[0]
    shape = shape_of(graph, value)
    while True:
        op = graph.producer(value)
        if op is None or _only_reader(graph, value) is None:
            return None
        if op.type == "MatMul":
            return op, chain[::-1]
        if op.type not in _ON_SCORES or len(chain) > 6:
            return None
        scored = [n for n in op.inputs if n and shape_of(graph, n) == shape and
                  _is_activation(graph, n)]  # fmt: skip
        if op.type == "Where":
            scored = [n for n in op.inputs[1:] if n in scored]
        if len(scored) != 1:
            return None
        chain.append(op)
        value = scored[0]


def _on_to_output(graph: Graph, softmax: Op) -> tuple[Op, list[Op]] | None:
    """The MatMul multiplying the probabilities by V and the ops between."""
    tail: list[Op] = []
    value = softmax.outputs[0]
    while (op := _only_reader(graph, value)) is not None:
        if op.type == "MatMul" and op.inputs[0] == value:
            return op, tail
        if op.type not in _AFTER_SOFTMAX or len(tail) > 2 or op.inputs[0] != value:
            return None
        tail.append(op)
        value = op.outputs[0]
    return None


def _source(graph: Graph, name: str) -> str:
    """K or V as the kernel reads them: back through the transpose of K and GQA's repeat."""
    while (op := graph.producer(name)) is not None and op.type in _REPEAT_HEADS:
        data = op.inputs[0]
        if not _is_activation(graph, data) or math.prod(shape_of(graph, data)) > math.prod(
            shape_of(graph, name)
        ):
            break
        name = data
    return name


def _causal(graph: Graph, mask: str) -> bool:
    """Whether `mask` is a causal triangle: made by a Trilu, or a constant triangle, reached
    back through the ops a mask takes (`_MASK_WAY`), a few at most."""
    stack, seen = [(mask, 0)], set()
    while stack:
        name, depth = stack.pop()
        if name in seen or depth > 8:
            continue
        seen.add(name)
        if _triangle(graph, name):
            return True
        op = graph.producer(name)
        if op is not None and op.type == "Trilu":
            return True
        if op is not None and op.type in _MASK_WAY:
            stack += [(n, depth + 1) for n in op.inputs if n]
    return False


def _triangle(graph: Graph, name: str) -> bool:
    """Whether constant `name`'s last two dims hold a triangle: true (or 0) on and below the
    diagonal, false (or -inf) above it, or the reverse, the same in every leading index."""
    array = graph.constants.get(name)
    if array is None and (weight := graph.weights.get(name)) is not None and weight.has_data:
        array = weight.load()
    if array is None or array.ndim < 2 or min(array.shape[-2:]) < 2:
        return False
    rows, cols = array.shape[-2:]
    flat = np.asarray(array).reshape(-1, rows, cols)
    above = np.triu(np.ones((rows, cols), dtype=bool), k=cols - rows + 1)
    first = flat[0] != flat[0][-1, 0]  # where it differs from the allowed corner
    return bool(np.array_equal(first, above) and (flat == flat[:1]).all())

"""Fused attention: the cores found by structure in both exporters' graphs (and nothing else),
priced as one flash kernel (time and memory, by hand), held as the kernel holds them by the
program and the search alike."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from onnx import helper, numpy_helper

from autoshard.analysis.attention import find_attention
from autoshard.cli.main import main
from autoshard.cost.attention import attention_cost
from autoshard.cost.cluster import make_cluster
from autoshard.cost.compute import OpCost, op_cost
from autoshard.cost.devices import DEVICES
from autoshard.cost.liveness import memory_timeline
from autoshard.ir.fused import Held, Kernel
from autoshard.ir.onnx_import import import_onnx
from autoshard.passes.materialize import materialize
from autoshard.pipeline import load_graph
from autoshard.propagate import propagate
from autoshard.rules import rule_for
from autoshard.training import Attention, Recompute, Training, training_graph
from autoshard.training.replay import Replay
from tests.unit.onnx_factory import F32, model, rng_weight, save, tensor

MODELS = Path(__file__).resolve().parents[2] / "models"
H100 = DEVICES["h100"]
B, S, HEADS, D = 2, 8, 4, 4  # the small block's batch, sequence, heads, head dim
HIDDEN = HEADS * D


def block(kv_heads: int = HEADS, causal: bool = True, softmax_out: bool = False, opset=17):
    """x[B, S, 16] -> q, k, v projections -> heads -> softmax(q·kᵀ / 2 + mask)·v -> o
    projection, as a TorchScript export spells it; `kv_heads` < HEADS repeats k and v's heads
    (GQA: Unsqueeze, Expand, Reshape); the mask a constant triangle (Trilu of a Constant,
    folded), or a model input; with
    `softmax_out` the probabilities are an output too (read outside the core). Its Softmax
    names no axis: -1 from opset 13 on, 1 before."""
    group = HEADS // kv_heads
    nodes, inits = [], {}
    for name, width in (("q", HIDDEN), ("k", kv_heads * D), ("v", kv_heads * D)):
        heads = HEADS if name == "q" else kv_heads
        inits[f"W{name}"] = rng_weight((HIDDEN, width), len(inits))
        inits[f"{name}_shape"] = np.array([B, S, heads, D])
        nodes += [
            helper.make_node("MatMul", ["x", f"W{name}"], [f"{name}_p"], name=f"{name}_proj"),
            helper.make_node("Reshape", [f"{name}_p", f"{name}_shape"], [f"{name}_h"]),
            helper.make_node("Transpose", [f"{name}_h"], [f"{name}_t"], perm=[0, 2, 1, 3]),
        ]
        if name != "q" and group > 1:
            inits["axis2"] = np.array([2])
            inits["expand"] = np.array([B, kv_heads, group, S, D])
            inits["merged"] = np.array([B, HEADS, S, D])
            nodes += [
                helper.make_node("Unsqueeze", [f"{name}_t", "axis2"], [f"{name}_u"]),
                helper.make_node("Expand", [f"{name}_u", "expand"], [f"{name}_e"]),
                helper.make_node("Reshape", [f"{name}_e", "merged"], [f"{name}_r"]),
            ]
    k, v = ("k_r", "v_r") if group > 1 else ("k_t", "v_t")
    inits |= {"scale": np.array(2.0, np.float32), "out_shape": np.array([B, S, HIDDEN])}
    inits |= {"Wo": rng_weight((HIDDEN, HIDDEN), 9), "one": np.array(1)}
    nodes += [
        helper.make_node("Transpose", [k], ["kT"], perm=[0, 1, 3, 2], name="k_transpose"),
        helper.make_node("MatMul", ["q_t", "kT"], ["scores"], name="scores"),
        helper.make_node("Div", ["scores", "scale"], ["scaled"], name="scale"),
    ]
    inputs = [tensor("x", F32, [B, S, HIDDEN])]
    if causal:
        ninf = numpy_helper.from_array(np.full((S, S), -1e9, np.float32))
        nodes += [  # a constant, not a weight: no gradient of its own
            helper.make_node("Constant", [], ["ninf"], value=ninf),
            helper.make_node("Trilu", ["ninf", "one"], ["mask"], upper=1, name="triangle"),
        ]
    else:
        inputs.append(tensor("mask", F32, [B, 1, S, S]))
    nodes += [
        helper.make_node("Add", ["scaled", "mask"], ["masked"], name="mask"),
        helper.make_node("Softmax", ["masked"], ["probs"], name="softmax"),
        helper.make_node("MatMul", ["probs", v], ["ctx"], name="context"),
        helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctx_t", "out_shape"], ["merged_heads"]),
        helper.make_node("MatMul", ["merged_heads", "Wo"], ["y"], name="o_proj"),
    ]
    outputs = [tensor("y", F32, [B, S, HIDDEN])]
    if softmax_out:
        outputs.append(tensor("probs", F32, [B, HEADS, S, S]))
    return model(nodes, inputs, outputs, inits, opset=opset)


def not_attention():
    """x[B, S, 16] @ W1 -> Softmax -> @ W2: a MatMul–Softmax–MatMul of projections."""
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
        helper.make_node("Softmax", ["h"], ["p"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["p", "W2"], ["y"], name="mm2"),
    ]
    inits = {"W1": rng_weight((HIDDEN, HIDDEN), 1), "W2": rng_weight((HIDDEN, HIDDEN), 2)}
    x, y = tensor("x", F32, [B, S, HIDDEN]), tensor("y", F32, [B, S, HIDDEN])
    return model(nodes, [x], [y], inits)


# ---- the pattern, by structure -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "ops"),
    [
        ("gpt2", ["/lm/transformer/h.0/attn/MatMul", "/lm/transformer/h.0/attn/Mul",
                  "/lm/transformer/h.0/attn/Add", "/lm/transformer/h.0/attn/Softmax",
                  "/lm/transformer/h.0/attn/Cast", "/lm/transformer/h.0/attn/MatMul_1"]),
        ("gpt2_dynamo", ["node_matmul", "node_mul_111", "node_add_169", "node_softmax",
                         "node_matmul_1"]),
    ],
)  # fmt: skip
def test_both_exporters_attention_is_found(name, ops):
    """TorchScript's and dynamo's GPT-2: a core per layer, scale and mask inside, causal (the
    mask a folded constant triangle; at 128 tokens one And-ed with the padding mask), 4 heads
    of 16."""
    long = import_onnx(MODELS / f"{name}.onnx", {"batch": 8, "seq": 128})
    assert find_attention(long).regions[0].causal
    graph = import_onnx(MODELS / f"{name}.onnx", {"batch": 2, "seq": 16})
    fused = find_attention(graph)
    assert len(fused.regions) == 2
    first = fused.regions[0]
    assert list(first.ops) == ops
    assert (first.heads, first.kv_heads, first.head_dim, first.causal) == (4, 4, 16, True)
    assert fused.kernel(ops[3]) is Kernel.FORWARD
    assert {fused.kernel(op) for op in ops if op != ops[3]} == {Kernel.INSIDE}
    assert fused.held(first.probabilities) is Held.STATISTICS
    assert fused.held(graph.ops[0].outputs[0]) is Held.WHOLE


def test_bert_attention_is_not_causal():
    """BERT's mask comes from the attention mask input: a full (not causal) core."""
    fused = find_attention(import_onnx(MODELS / "bert.onnx", {"batch": 2, "seq": 16}))
    assert len(fused.regions) == 2
    assert not fused.regions[0].causal


def test_grouped_query_attention_reads_the_unrepeated_heads(tmp_path):
    """GQA: k and v repeated from 2 heads to 4; the kernel reads them before the repeat."""
    graph = import_onnx(save(block(kv_heads=2), tmp_path), {})
    (region,) = find_attention(graph).regions
    assert (region.heads, region.kv_heads, region.head_dim, region.causal) == (4, 2, 4, True)
    assert (region.q, region.k, region.v) == ("q_t", "k_p", "v_p")
    assert region.ops == ("scores", "scale", "mask", "softmax", "context")
    assert region.inside == ("scores", "scaled", "masked", "probs")


@pytest.mark.parametrize(
    "proto",
    [not_attention(), block(softmax_out=True), block(opset=12)],
    ids=["projections", "probs-read-outside", "opset-12-softmax-over-heads"],
)
def test_no_attention_where_none_is(tmp_path, proto):
    """A MatMul–Softmax–MatMul of weights is no attention; nor a core whose probabilities are
    read outside it (a kernel keeping them on chip could not hand them out), nor an opset-12
    Softmax without an axis (over heads and both sequences: axis 1, coerced to 2-D)."""
    assert not find_attention(import_onnx(save(proto, tmp_path), {}))


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--mode", "training", "--attention", "flash"],
      "autoshard: error: unknown attention 'flash'; choose one of: fused, as-exported\n"),
     (["--attention", "fused"],
      "autoshard: error: --attention plans a training step: add --mode training\n")],
    ids=["unknown", "inference"],
)  # fmt: skip
def test_a_bad_attention_flag_is_one_line(capsys, flags, message):
    model = str(MODELS / "gpt2.onnx")
    assert main(["plan", model, "--mesh", "2", "--dim", "batch=2", "--dim", "seq=16", *flags]) == 2
    assert capsys.readouterr().err == message


# ---- time ----------------------------------------------------------------------------------------


def test_attention_cost_by_hand():
    """Llama-7B-like GQA shape on an H100: 32 query heads, 8 kv heads, 2048 tokens, head dim
    128, causal, bf16. Pairs on and below the diagonal 2048·2049/2; two matmuls forward, five
    backward; Q, K, V, O (and dO, dQ, dK, dV backward) and the float32 statistics moved."""
    pairs = 2048 * 2049 // 2
    flops = 2 * 2 * 32 * pairs * 128
    q, kv = 32 * 2048 * 128, 8 * 2048 * 128
    stats = 4 * 32 * 2048
    forward = attention_cost(1, 32, 8, 2048, 2048, 128, True, "bfloat16", H100)
    assert forward.flops == flops == 34_376_515_584
    assert forward.bytes == 2 * (2 * q + 2 * kv) + stats == 42_205_184
    compute = flops / (989e12 * 0.6)  # bound by its FLOPs: 57.9 us against 14.8 us of traffic
    assert forward.seconds == pytest.approx(compute + 2e-6, rel=1e-12)
    backward = attention_cost(1, 32, 8, 2048, 2048, 128, True, "bfloat16", H100, backward=True)
    assert backward.flops == 5 * flops // 2
    assert backward.bytes == 2 * (4 * q + 4 * kv) + stats
    assert backward.seconds == pytest.approx(5 * flops / 2 / (989e12 * 0.45) + 2e-6, rel=1e-12)
    full = attention_cost(1, 32, 8, 2048, 2048, 128, False, "bfloat16", H100)
    assert full.flops == 2 * 2 * 32 * 2048 * 2048 * 128


def _step(tmp_path, attention: Attention, **kwargs):
    path = save(block(**kwargs), tmp_path)
    return load_graph(path, {}, Training(attention=attention))


def test_a_fused_core_costs_its_kernels_and_nothing_inside(tmp_path):
    """On 2 devices splitting the batch: the softmax costs the forward kernel over its local
    shard (1 of the 2 sequences), its gradient op the backward kernel, every other op of the
    core and of its backward nothing."""
    graph = _step(tmp_path, Attention.FUSED, kv_heads=2)
    cluster = make_cluster(mesh="2")
    from autoshard.annotations import Annotation
    from autoshard.sharding import Sharding

    plan = propagate(graph, cluster.mesh, [Annotation("x", Sharding(((0,), (), ())))])
    costs = {}
    for op in graph.ops:
        option = plan.options.get(op.name)
        costs[op.name] = op_cost(op, rule_for(op, graph), option, graph, cluster)
    dtype = "bfloat16"
    assert costs["softmax"] == attention_cost(1, HEADS, 2, S, S, D, True, dtype, H100)
    grad = attention_cost(1, HEADS, 2, S, S, D, True, dtype, H100, backward=True)
    assert costs["softmax@grad0"] == grad
    inside = [n for n in costs if graph.fused.kernel(n) is Kernel.INSIDE]
    assert sorted(inside) == sorted([
        "scores", "scale", "mask", "context", "scores@grad0", "scores@grad1", "scale@grad0",
        "mask@grad0", "context@grad0", "context@grad1",
    ])  # fmt: skip
    assert all(costs[n] == OpCost(0, 0, 0.0) for n in inside)
    exported = _step(tmp_path, Attention.AS_EXPORTED, kv_heads=2)
    assert not exported.fused
    assert op_cost(exported.op_by_name["scores"], rule_for(exported.op_by_name["scores"],
                   exported), None, exported, cluster).flops > 0  # fmt: skip


# ---- memory ------------------------------------------------------------------------------------


def _end_of_forward(graph) -> int:
    return max(i for i, op in enumerate(graph.ops) if graph.phase(op.name) == "forward")


def test_fused_memory_by_hand(tmp_path):
    """At the end of the forward, op by op the core keeps three S x S tensors for the backward
    (the scores, read by the scale's gradient; the masked scores, by the softmax's; the
    probabilities, by the context's); fused it keeps only the probabilities' row statistics,
    float32, one per row, and not the causal mask (S x S, float32), which the kernel makes
    itself. Nothing else differs."""
    bf16 = 2
    square = B * HEADS * S * S * bf16
    statistics = B * HEADS * S * 4
    mask = S * S * 4
    held = {}
    for attention in Attention:
        graph = _step(tmp_path, attention)
        program = materialize(graph, propagate(graph, make_cluster(mesh="1").mesh, []))
        # the program has one step per op here (nothing resharded on one device)
        held[attention] = memory_timeline(program)[_end_of_forward(graph) + 1]
        if attention is Attention.FUSED:
            inside = {"scores", "scaled", "masked", "scores@grad0", "masked@grad0", "mask"}
            assert inside <= graph.fused.inside
    assert held[Attention.AS_EXPORTED] - held[Attention.FUSED] == 3 * square - statistics + mask


def test_a_recomputed_core_runs_its_forward_kernel_again(tmp_path):
    """With its layer recomputed, the core's recomputed softmax is a forward kernel again and
    its recomputed probabilities are held as statistics."""
    path = save(block(), tmp_path)
    forward = import_onnx(path, {})
    forward = dataclasses.replace(forward, fused=find_attention(forward))
    training = Training(recompute=Recompute.LAYERS, attention=Attention.FUSED)
    everything = tuple(range(len(forward.ops)))
    graph = training_graph(forward, training, [Replay(everything, everything[-1])])
    assert graph.fused.kernel("softmax@recompute") is Kernel.FORWARD
    assert graph.fused.held("probs@re") is Held.STATISTICS
    assert graph.fused.held("scores@re") is Held.NONE


def test_the_7b_decoders_activations_are_megatrons_terms(tmp_path):
    """The bundled Llama-7B-shaped decoder's training step, one sequence of 2048 per device
    (the quickstart's 32 over 4x8 data parallel), bf16: the activations held at the end of the
    forward against Korthikanti et al. 2022 (arXiv:2205.05198), term by term per layer in
    units of s·b bytes. Their eq. 1 counts 34·h + 5·a·s per layer: attention 11·h (QKV input
    2, Q and K 4, V 2, output projection input 2, dropout mask 1) + 5·a·s (softmax output 2,
    its dropout mask 1, dropout output 2), MLP 19·h, norms 4·h. Our graphs have no dropout
    (less 1·h + 1·h and 3·a·s), and a SwiGLU MLP of f features: its input 2·h, the gate's
    result, SiLU's, the up projection's and their product 2·f each. Flash attention keeps no
    a·s terms (the statistics, 4·a bytes per token, are among what the embedding and logits
    add). So Megatron's count for this model is 16·h + 8·f; the graph, spelling RMSNorm and
    SiLU op by op, also keeps each norm's normalized input (2·h, twice) and SiLU's sigmoid
    (2·f). Op by op, the three S x S tensors of each layer are kept too, less the statistics,
    to the byte."""
    s, h, f, a, layers = 2048, 4096, 11008, 32, 32
    held = {}
    for attention in Attention:
        graph = load_graph(
            MODELS / "decoder_32l_shape_only.onnx", {"batch": 1, "seq": s},
            Training(attention=attention),
        )  # fmt: skip
        program = materialize(graph, propagate(graph, make_cluster(mesh="1").mesh, []))
        timeline = memory_timeline(program)
        held[attention] = timeline[_end_of_forward(graph) + 1] - timeline[0]
    megatron = layers * s * (16 * h + 8 * f)
    op_by_op = layers * s * (4 * h + 2 * f)
    assert held[Attention.FUSED] == pytest.approx(megatron + op_by_op, rel=0.02)
    squares = layers * (3 * 2 * a * s * s - 4 * a * s)
    assert held[Attention.AS_EXPORTED] - held[Attention.FUSED] == squares

"""All-gather-K/V context parallelism partitioned and run on every device, against
onnxruntime on the whole op: an ONNX Attention (causal, grouped-query) whose queries, keys,
values and output arrive split on the sequence; each device computes its query rows with its
causal mask written out, over keys and values all-gathered whole."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from onnx import TensorProto, helper

from autoshard.analysis.attention import find_attention
from autoshard.annotations import Annotation
from autoshard.document.story import strategy_story
from autoshard.execute.steps import write_steps
from autoshard.execute.train_verify import verify_training
from autoshard.execute.verify import model_weights, verify
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.passes.lower import lower
from autoshard.passes.partition import partition
from autoshard.pipeline import load_graph
from autoshard.propagate import propagate
from autoshard.rules import rule_for
from autoshard.rules.base import ring_loops
from autoshard.sharding import Sharding, ShardingOption
from autoshard.training import Attention, Training
from autoshard.training.options import Optimizer, Precision
from tests.e2e.helpers import MODELS
from tests.unit.onnx_factory import model, save, tensor

F32 = TensorProto.FLOAT
RNG = np.random.default_rng(11)


def causal_gqa(batch=2, heads=4, kv_heads=2, seq=8, head_dim=8):
    q, kv = [batch, heads, seq, head_dim], [batch, kv_heads, seq, head_dim]
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], "attention", is_causal=1)
    inputs = [tensor("q", F32, q), tensor("k", F32, kv), tensor("v", F32, kv)]
    feed = {"q": q, "k": kv, "v": kv}
    feed = {n: RNG.standard_normal(s).astype(np.float32) for n, s in feed.items()}
    return model([node], inputs, [tensor("y", F32, q)], opset=23), feed


@pytest.mark.parametrize(
    ("heads", "sequence", "option"),
    [((), (0, 1), "[[], [], [], [0, 1]]"), ((1,), (0,), "[[], [1], [], [0]]")],
    ids=["sequence_4_ways", "heads_tp_sequence_cp"],
)
def test_all_gather_kv_partitions_exactly(tmp_path, heads, sequence, option):
    proto, feed = causal_gqa()
    path = save(proto, tmp_path)
    graph = import_onnx(path)
    split = Sharding(((), heads, sequence, ()))
    plan = propagate(graph, Mesh((2, 2)), [Annotation(n, split) for n in ("q", "k", "v", "y")])
    assert str(plan.options["attention"]) == option
    program = lower(graph, plan)
    gathered = sorted((c["value"], c["kind"]) for c in program.collectives_json())
    assert gathered == [("k", "all_gather"), ("v", "all_gather")]
    partitioned = partition(program, graph)
    report = verify(partitioned, graph, path, model_weights(graph, partitioned), feed)
    assert report.ok, report.to_json()


@pytest.mark.parametrize(
    ("heads", "sequence", "option", "steps"),
    [
        ((), (0, 1), "[[], [], [], [0, 1], [0, 1]]", 3),
        ((1,), (0,), "[[], [1], [], [0], [0]]", 1),
    ],
    ids=["ring_4_ways", "heads_tp_ring_2_ways"],
)
def test_ring_attention_partitions_exactly(tmp_path, heads, sequence, option, steps):
    """Ring attention's partitioned program equal to the unsplit attention: the causal GQA
    Attention with its queries and its keys split together over the sequence axes (the ring
    option, `rules.base.ring_loops`), no K/V all_gather: p - 1 permutes pass each of K and V
    one block a step around the ring, each device joins the blocks it held in key order and
    computes its query rows with its causal mask written out; onnxruntime on each device's
    segments equals onnxruntime on the whole op."""
    proto, feed = causal_gqa()
    path = save(proto, tmp_path)
    graph = import_onnx(path)
    split = Sharding(((), heads, sequence, ()))
    ring = ShardingOption.parse(option, 6)
    plan = propagate(
        graph, Mesh((2, 2)), [Annotation(n, split) for n in ("q", "k", "v", "y")],
        {"attention": ring},
    )  # fmt: skip
    assert str(plan.options["attention"]) == option
    assert plan.needs[("attention", 1)] == split  # K read as it arrives: no gather
    program = lower(graph, plan)
    assert program.collectives_json() == []
    axes = " and ".join(f"axis {a}" for a in sequence).replace("axis 0 and axis 1", "axes 0, 1")
    told = f"ring attention over {axes} (causal load-balanced)"
    assert told in strategy_story(graph, plan, []), strategy_story(graph, plan, [])
    partitioned = partition(program, graph)
    moved = [(c["kind"], c["value"]) for c in partitioned.collectives_json()]
    assert moved == [("permute", "k")] * steps + [("permute", "v")] * steps
    report = verify(partitioned, graph, path, model_weights(graph, partitioned), feed)
    assert report.ok, report.to_json()


def test_decomposed_ring_attention_partitions_exactly(tmp_path):
    """Ring attention on a decomposed core (MatMul, scale, causal mask, Softmax, MatMul, as a
    TorchScript export spells it, with GQA's repeat of K and V): x split on its sequence over
    both axes of 2x2, the core's two MatMuls computed as a ring (K and V read split with the
    queries, passed around in 3 permutes each) and its kernel load-balanced; onnxruntime on
    each device's segments equals onnxruntime on the whole model."""
    from tests.unit.test_fused_attention import block

    path = save(block(kv_heads=2), tmp_path)
    graph = import_onnx(path)
    graph = dataclasses.replace(graph, fused=find_attention(graph))
    options = {
        "scores": ShardingOption.parse("[[], [], [0, 1], [0, 1]]", 5),
        "softmax": ShardingOption.parse("[[], [], [0, 1], [0, 1]]", 4),
        "context": ShardingOption.parse("[[], [], [0, 1], [], [0, 1]]", 5),
    }
    plan = propagate(graph, Mesh((2, 2)), [Annotation("x", Sharding(((), (0, 1), ())))], options)
    assert plan.needs[("scores", 1)].split_axes == ((), (), (), (0, 1))  # kT split on keys
    program = lower(graph, plan)
    assert not [c for c in program.collectives_json() if c["value"] in ("kT", "v_r")]
    told = "ring attention over axes 0, 1 (causal load-balanced)"
    assert told in strategy_story(graph, plan, program.collectives_json())
    partitioned = partition(program, graph)
    moved = [(c["kind"], c["value"]) for c in partitioned.collectives_json()]
    assert moved.count(("permute", "kT")) == 3 and moved.count(("permute", "v_r")) == 3
    feed = {"x": RNG.standard_normal((2, 8, 16)).astype(np.float32)}
    report = verify(partitioned, graph, path, model_weights(graph, partitioned), feed)
    assert report.ok, report.to_json()


def test_ring_attention_trains_as_autograd(tmp_path):
    """GPT-2's two attention cores computed as ring attention over 2 devices in a training
    step (fp32, SGD), the rest replicated: forward, K and V pass around the ring (a permute
    each); backward, K and V again for dQ and dP, and dK and dV summed around the ring as
    they pass (a permute each): 6 per core. Two steps of every device's partitioned program
    equal PyTorch autograd on the model: loss, every gradient, every updated weight."""
    training = Training(
        attention=Attention.FUSED, precision=Precision.FP32, optimizer=Optimizer.SGD
    )
    model = MODELS / "gpt2.onnx"
    graph = load_graph(model, {"batch": 2, "seq": 8}, training)
    mesh = Mesh((2,))
    options = {}
    for region in graph.fused.regions:
        for name in (region.ops[0], region.softmax, region.ops[-1]):
            rank = len(graph.values[graph.op_by_name[name].inputs[0]].shape)
            loops = [()] * len(rule_for(graph.op_by_name[name], graph).loops)
            query, key = rule_for(graph.op_by_name[name], graph).ring[0]
            loops[query] = loops[key] = (0,)
            option = ShardingOption(tuple(loops))
            assert rank == 4 and ring_loops(option)
            for op in graph.ops:
                if op.name == name or (op.type == "Grad" and op.attr("op") == name):
                    options[op.name] = option
    plan = propagate(graph, mesh, [], options)
    partitioned = partition(lower(graph, plan), graph)
    sent = [c["value"] for c in partitioned.collectives_json() if c["kind"] == "permute"]
    assert len(sent) == 12
    assert sum("@grad" in value for value in sent) == 4  # dK and dV, each core
    manifest = write_steps(tmp_path, partitioned, graph, dict.fromkeys(range(mesh.size)))
    weights = model_weights(graph, partitioned)
    report = verify_training(partitioned, graph, model, weights, manifest, tmp_path, training, 2)
    assert report.ok, [c.line() for c in report.failures]

"""The fused ops of modern exports (rules/attention.py, and the com.microsoft norms and
activations), partitioned and run on every device, against onnxruntime on the whole op.

Each case is one op built with onnx.helper. On mesh 2x2 every candidate option of the op (every
exact assignment of mesh axes to its loops, as the search enumerates them) is partitioned and
verified; on 2x2x2 every candidate that puts the most axes on loops. The cases cover heads
split, query sequence split, grouped-query attention with fewer key-value heads than devices,
multi-query attention, masks (boolean and additive, broadcast), past key-value caches and the
3-D layout whose head counts the partition rewrites.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from autoshard.execute.verify import model_weights, verify
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.passes.lower import lower
from autoshard.passes.partition import partition
from autoshard.propagate import propagate
from autoshard.rules import IteratorType, Note, rule_for
from autoshard.search.candidates import candidates

MS = "com.microsoft"
TYPES = {"f": TensorProto.FLOAT, "b": TensorProto.BOOL, "i64": TensorProto.INT64,
         "i32": TensorProto.INT32}  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One op: its type, domain, attributes, inputs (name -> (kind, value)) and outputs
    (name -> (kind, shape)); an empty input name keeps an optional slot empty."""

    op: str
    inputs: tuple[tuple[str, str, np.ndarray | None], ...]
    outputs: tuple[tuple[str, tuple[int, ...]], ...]
    attrs: dict[str, object] = field(default_factory=dict)
    domain: str = ""
    int_outputs: tuple[str, ...] = ()  # int32 results (the rest are float)

    def model(self, path):
        node = helper.make_node(
            self.op, [n for n, _, _ in self.inputs], [n for n, _ in self.outputs], "op",
            domain=self.domain, **self.attrs,
        )  # fmt: skip
        inputs = [
            helper.make_tensor_value_info(n, TYPES[kind], value.shape)
            for n, kind, value in self.inputs
            if n and value is not None
        ]
        outputs = [
            helper.make_tensor_value_info(
                n, TensorProto.INT32 if n in self.int_outputs else TensorProto.FLOAT, s
            )
            for n, s in self.outputs
        ]
        graph = helper.make_graph([node], "case", inputs, outputs, value_info=outputs)
        opsets = [helper.make_opsetid("", 23)] + (
            [helper.make_opsetid(MS, 1)] if self.domain else []
        )
        onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=10), path)
        return path

    def feed(self):
        return {n: value for n, _, value in self.inputs if n and value is not None}


RNG = np.random.default_rng(7)


def f(*shape):
    return ("f", RNG.standard_normal(shape).astype(np.float32))


def mask(*shape):
    values = RNG.random(shape) < 0.6
    values[..., 0] = True  # no row fully masked
    return ("b", values)


def positions(batch, seq, high):
    return ("i64", RNG.integers(0, high, (batch, seq)).astype(np.int64))


def _in(**named):
    """Inputs in order; a None value leaves its optional slot empty."""
    return tuple(
        ("" if value is None else name.rstrip("_"), kind, value)
        for name, (kind, value) in named.items()
    )


NONE = ("f", None)


CASES = {
    # GQA: 4 query heads over 2 key-value heads, a boolean mask [B, 1, Sq, T], past caches.
    "attention_gqa_mask_past": Case(
        "Attention",
        _in(
            q=f(2, 4, 4, 8),
            k=f(2, 2, 4, 8),
            v=f(2, 2, 4, 8),
            m=mask(2, 1, 4, 7),
            pk=f(2, 2, 3, 8),
            pv=f(2, 2, 3, 8),
        ),
        (
            ("y", (2, 4, 4, 8)),
            ("present_k", (2, 2, 7, 8)),
            ("present_v", (2, 2, 7, 8)),
            ("qk", (2, 4, 4, 7)),
        ),
        {"qk_matmul_output_mode": 1, "scale": 0.3},
    ),  # fmt: skip
    # The 3-D layout, causal, GQA (8 query heads, 2 key-value heads): heads counted locally.
    "attention_3d_causal": Case(
        "Attention",
        _in(q=f(2, 4, 32), k=f(2, 4, 8), v=f(2, 4, 8)),
        (("y", (2, 4, 32)),),
        {"q_num_heads": 8, "kv_num_heads": 2, "is_causal": 1},
    ),
    # Causal with past keys and a boolean mask: a query split writes the causal mask out.
    "attention_causal_mask_past": Case(
        "Attention",
        _in(
            q=f(2, 2, 4, 8),
            k=f(2, 2, 4, 8),
            v=f(2, 2, 4, 8),
            m=mask(2, 1, 4, 7),
            pk=f(2, 2, 3, 8),
            pv=f(2, 2, 3, 8),
        ),
        (("y", (2, 2, 4, 8)), ("present_k", (2, 2, 7, 8)), ("present_v", (2, 2, 7, 8))),
        {"is_causal": 1},
    ),  # fmt: skip
    # Causal, an additive mask, keys beyond the queries (no past), qk after the mask.
    "attention_causal_additive": Case(
        "Attention",
        _in(q=f(2, 2, 4, 8), k=f(2, 2, 6, 8), v=f(2, 2, 6, 8), m=f(4, 6)),
        (
            ("y", (2, 2, 4, 8)),
            ("present_k", (2, 2, 6, 8)),
            ("present_v", (2, 2, 6, 8)),
            ("qk", (2, 2, 4, 6)),
        ),
        {"is_causal": 1, "qk_matmul_output_mode": 2},
    ),  # fmt: skip
    # The 3-D layout with an additive mask of one head dim per query head, softcap.
    "attention_3d_bias": Case(
        "Attention",
        _in(q=f(2, 4, 32), k=f(2, 6, 32), v=f(2, 6, 16), m=f(4, 4, 6)),
        (("y", (2, 4, 16)),),
        {"q_num_heads": 4, "kv_num_heads": 4, "softcap": 2.0},
    ),
    # Decoding: one new token of the 3-D layout, past caches in [B, Hkv, P, D].
    "attention_3d_decode_past": Case(
        "Attention",
        _in(
            q=f(2, 1, 32), k=f(2, 1, 16), v=f(2, 1, 16), m_=NONE, pk=f(2, 2, 3, 8), pv=f(2, 2, 3, 8)
        ),
        (("y", (2, 1, 32)), ("present_k", (2, 2, 4, 8)), ("present_v", (2, 2, 4, 8))),
        {"q_num_heads": 4, "kv_num_heads": 2, "is_causal": 1},
    ),  # fmt: skip
    # Multi-query: one key-value head read whole, query heads split alone.
    "attention_mqa": Case(
        "Attention",
        _in(q=f(2, 4, 4, 8), k=f(2, 1, 6, 8), v=f(2, 1, 6, 8), m=f(4, 6)),
        (("y", (2, 4, 4, 8)),),
    ),
    "rotary_4d": Case(
        "RotaryEmbedding",
        _in(x=f(2, 4, 4, 8), cos=f(16, 4), sin=f(16, 4), pos=positions(2, 4, 16)),
        (("y", (2, 4, 4, 8)),),
    ),
    "rotary_3d_per_token": Case(
        "RotaryEmbedding",
        _in(x=f(2, 4, 32), cos=f(2, 4, 2), sin=f(2, 4, 2)),
        (("y", (2, 4, 32)),),
        {"num_heads": 4, "rotary_embedding_dim": 4, "interleaved": 1},
    ),
    "ms_group_query_attention": Case(
        "GroupQueryAttention",
        _in(
            q=f(2, 4, 32),
            k=f(2, 4, 16),
            v=f(2, 4, 16),
            pk_=NONE,
            pv_=NONE,
            seqlens=("i32", np.array([3, 2], np.int32)),
            total=("i32", np.array(4, np.int32)),
        ),
        (("y", (2, 4, 32)), ("present_k", (2, 2, 4, 8)), ("present_v", (2, 2, 4, 8))),
        {"num_heads": 4, "kv_num_heads": 2},
        MS,
    ),  # fmt: skip
    "ms_group_query_attention_rotary": Case(
        "GroupQueryAttention",
        _in(
            q=f(2, 4, 128),
            k=f(2, 4, 32),
            v=f(2, 4, 32),
            pk_=NONE,
            pv_=NONE,
            seqlens=("i32", np.array([3, 3], np.int32)),
            total=("i32", np.array(4, np.int32)),
            cos=f(8, 8),
            sin=f(8, 8),
        ),
        (("y", (2, 4, 128)), ("present_k", (2, 2, 4, 16)), ("present_v", (2, 2, 4, 16))),
        {"num_heads": 8, "kv_num_heads": 2, "do_rotary": 1},
        MS,
    ),  # fmt: skip
    # A decoding step: past caches of 4 positions, one new token.
    "ms_group_query_attention_decode": Case(
        "GroupQueryAttention",
        _in(
            q=f(2, 1, 64),
            k=f(2, 1, 32),
            v=f(2, 1, 32),
            pk=f(2, 2, 4, 16),
            pv=f(2, 2, 4, 16),
            seqlens=("i32", np.array([4, 2], np.int32)),
            total=("i32", np.array(5, np.int32)),
        ),
        (("y", (2, 1, 64)), ("present_k", (2, 2, 5, 16)), ("present_v", (2, 2, 5, 16))),
        {"num_heads": 4, "kv_num_heads": 2},
        MS,
    ),  # fmt: skip
    # Cross attention: key and value already in heads [B, N, L, D].
    "ms_multi_head_attention_4d_kv": Case(
        "MultiHeadAttention",
        _in(q=f(2, 4, 32), k=f(2, 4, 6, 8), v=f(2, 4, 6, 8)),
        (("y", (2, 4, 32)),),
        {"num_heads": 4},
        MS,
    ),
    "ms_multi_head_attention": Case(
        "MultiHeadAttention",
        _in(
            q=f(2, 4, 32),
            k=f(2, 6, 32),
            v=f(2, 6, 32),
            bias_=NONE,
            pad=("i32", np.array([6, 4], np.int32)),
            ab=f(1, 4, 4, 6),
        ),
        (("y", (2, 4, 32)),),
        {"num_heads": 4},
        MS,
    ),  # fmt: skip
    # Packed QKV weights: the batch splits only.
    "ms_attention_packed": Case(
        "Attention",
        _in(x=f(2, 4, 16), w=f(16, 48), b=f(48), mask=("i32", np.array([4, 3], np.int32))),
        (("y", (2, 4, 16)),),
        {"num_heads": 4},
        MS,
    ),
    "ms_embed_layer_norm": Case(
        "EmbedLayerNormalization",
        _in(
            ids=("i32", RNG.integers(0, 32, (2, 4)).astype(np.int32)),
            seg=("i32", RNG.integers(0, 2, (2, 4)).astype(np.int32)),
            word=f(32, 16),
            pos=f(16, 16),
            segment=f(2, 16),
            gamma=f(16),
            beta=f(16),
            mask=("i32", np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.int32)),
        ),
        (("y", (2, 4, 16)), ("mask_index", (2,))),
        {},
        MS,
        ("mask_index",),
    ),  # fmt: skip
    "ms_rotary_3d": Case(
        "RotaryEmbedding",
        _in(x=f(2, 4, 32), pos=positions(2, 4, 16), cos=f(16, 4), sin=f(16, 4)),
        (("y", (2, 4, 32)),),
        {"num_heads": 4},
        MS,
    ),
    "ms_rotary_4d_offset": Case(
        "RotaryEmbedding",
        _in(x=f(2, 4, 4, 8), pos=("i64", np.array([5], np.int64)), cos=f(16, 4), sin=f(16, 4)),
        (("y", (2, 4, 4, 8)),),
        {},
        MS,
    ),
    "ms_skip_layer_norm": Case(
        "SkipLayerNormalization",
        _in(x=f(2, 4, 8), skip=f(4, 8), gamma=f(8), beta=f(8), bias=f(8)),
        (("y", (2, 4, 8)), ("mean", (2, 4, 1)), ("inv_std", (2, 4, 1)), ("sum", (2, 4, 8))),
        {},
        MS,
    ),
    "ms_skip_simplified_layer_norm": Case(
        "SkipSimplifiedLayerNormalization",
        _in(x=f(2, 4, 8), skip=f(2, 4, 8), gamma=f(8)),
        (("y", (2, 4, 8)), ("mean", (2, 4, 1)), ("inv_std", (2, 4, 1)), ("sum", (2, 4, 8))),
        {},
        MS,
    ),
    "simplified_layer_norm": Case(
        "SimplifiedLayerNormalization", _in(x=f(2, 4, 8), scale=f(8)), (("y", (2, 4, 8)),)
    ),
    "ms_fast_gelu": Case("FastGelu", _in(x=f(2, 4, 8), b=f(8)), (("y", (2, 4, 8)),), {}, MS),
    "ms_bias_gelu": Case("BiasGelu", _in(x=f(2, 4, 8), b=f(8)), (("y", (2, 4, 8)),), {}, MS),
    "ms_quick_gelu": Case("QuickGelu", _in(x=f(2, 4, 8)), (("y", (2, 4, 8)),), {}, MS),
}


# onnxruntime refuses a mask shorter than the keys (the ONNX reference pads it): rules only.
RULE_ONLY = {
    # Causal with a mask over the past keys only: the queries stay whole.
    "attention_causal_short_mask": Case(
        "Attention",
        _in(
            q=f(2, 2, 4, 8),
            k=f(2, 2, 4, 8),
            v=f(2, 2, 4, 8),
            m=mask(4, 3),
            pk=f(2, 2, 3, 8),
            pv=f(2, 2, 3, 8),
        ),
        (("y", (2, 2, 4, 8)), ("present_k", (2, 2, 7, 8)), ("present_v", (2, 2, 7, 8))),
        {"is_causal": 1},
    ),  # fmt: skip
}


MESHES = {"2x2": Mesh((2, 2)), "2x2x2": Mesh((2, 2, 2))}


def _options(rule, mesh):
    every = candidates(rule, mesh)
    if len(mesh.shape) == 2:
        return every
    most = max(sum(len(axes) for axes in o.loops) for o in every)
    return [o for o in every if sum(len(axes) for axes in o.loops) == most]


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_candidate_partitions_exactly(tmp_path, name, mesh):
    case = CASES[name]
    path = case.model(tmp_path / f"{name}.onnx")
    graph = import_onnx(path)
    rule = rule_for(graph.op_by_name["op"], graph)
    assert rule is not None
    options = _options(rule, MESHES[mesh])
    assert any(o.loops[0] for o in options)  # the batch splits, at least
    reference = None
    for option in options:
        plan = propagate(graph, MESHES[mesh], (), {"op": option})
        partitioned = partition(lower(graph, plan), graph)
        report = verify(partitioned, graph, path, model_weights(graph, partitioned), case.feed(),
                        None, 0, reference)  # fmt: skip
        assert report.ok, (str(option), report.to_json())


def test_grouped_heads_split_no_finer_than_the_key_value_heads(tmp_path):
    # 2 key-value heads: the heads split over one axis of 2x2, never over both (4 devices).
    case = CASES["attention_gqa_mask_past"]
    graph = import_onnx(case.model(tmp_path / "gqa.onnx"))
    rule = rule_for(graph.op_by_name["op"], graph)
    assert [loop.size for loop in rule.loops] == [2, 2, 2, 4, 7, 8]
    assert {len(o.loops[1]) for o in candidates(rule, MESHES["2x2"])} == {0, 1}
    # One key-value head (multi-query): the query heads split over both axes, K and V whole.
    graph = import_onnx(CASES["attention_mqa"].model(tmp_path / "mqa.onnx"))
    rule = rule_for(graph.op_by_name["op"], graph)
    assert {len(o.loops[1]) for o in candidates(rule, MESHES["2x2"])} == {0, 1, 2}
    assert str(rule.operands[1]) == "(d0, 0, 0, 0)"


@pytest.mark.parametrize(
    ("name", "query"),
    [
        ("attention_gqa_mask_past", IteratorType.PARALLEL),
        ("attention_3d_causal", IteratorType.PARALLEL),  # its causal mask is written out
        ("attention_causal_short_mask", IteratorType.INVALID),  # not over every key
        ("ms_group_query_attention", IteratorType.INVALID),  # causal from seqlens_k
        ("ms_multi_head_attention", IteratorType.PARALLEL),
    ],
)
def test_the_query_splits_unless_causal(tmp_path, name, query):
    graph = import_onnx((CASES | RULE_ONLY)[name].model(tmp_path / "m.onnx"))
    rule = rule_for(graph.op_by_name["op"], graph)
    assert rule.loops[3].kind is query
    assert rule.loops[4].kind is IteratorType.INVALID  # keys: never split


def test_three_d_heads_are_counted_per_device(tmp_path):
    case = CASES["attention_3d_causal"]
    path = case.model(tmp_path / "a.onnx")
    graph = import_onnx(path)
    rule = rule_for(graph.op_by_name["op"], graph)
    assert rule.note is Note.LOCAL_HEADS
    option = next(o for o in candidates(rule, MESHES["2x2"]) if o.loops[1] == (0,))
    partitioned = partition(lower(graph, propagate(graph, MESHES["2x2"], (), {"op": option})),
                            graph)  # fmt: skip
    ops = [s.op for d in partitioned.devices for s in d.steps if hasattr(s, "op")]
    attention = [op for op in ops if op.type == "Attention"]
    assert {(op.attr("q_num_heads"), op.attr("kv_num_heads")) for op in attention} == {(4, 1)}
    assert {op.attr("is_causal") for op in attention} == {1}  # its queries are whole


def test_a_causal_split_of_the_queries_writes_each_devices_mask(tmp_path):
    """Queries [0, 2) and [2, 4) of 4, 3 past keys: key j is allowed for local query i where
    j <= lo + i + 3."""
    case = CASES["attention_causal_mask_past"]
    graph = import_onnx(case.model(tmp_path / "a.onnx"))
    rule = rule_for(graph.op_by_name["op"], graph)
    option = next(
        o for o in candidates(rule, MESHES["2x2"]) if o.loops[3] == (1,) and not any(o.loops[:3])
    )
    partitioned = partition(lower(graph, propagate(graph, MESHES["2x2"], (), {"op": option})),
                            graph)  # fmt: skip
    for device in partitioned.devices:
        ops = [s.op for s in device.steps if hasattr(s, "op")]
        assert [op.type for op in ops] == ["And", "Attention"]
        assert ops[1].attr("is_causal") == 0
        lo = 2 * device.device[1]
        want = np.arange(7)[None, :] <= np.arange(lo, lo + 2)[:, None] + 3
        np.testing.assert_array_equal(device.constants[ops[0].inputs[1]], want)


def test_attention_gradients_sum_over_the_queries_for_keys_and_values(tmp_path):
    """The training step's gradients of an Attention, derived from its rule: dQ keeps the
    query loop parallel; dK and dV sum over it (partial over the axes splitting the queries),
    and all three split by heads and batch as the forward does."""
    from autoshard.sharding import Sharding, ShardingOption
    from autoshard.training import Training, training_graph

    weights = {name: RNG.standard_normal((32, n)).astype(np.float32)
               for name, n in (("wq", 32), ("wk", 16), ("wv", 16))}  # fmt: skip
    nodes = [
        helper.make_node("MatMul", ["x", f"w{t}"], [t], f"proj_{t}") for t in ("q", "k", "v")
    ] + [helper.make_node("Attention", ["q", "k", "v"], ["y"], "attn", q_num_heads=4,
                          kv_num_heads=2)]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (2, 4, 32))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (2, 4, 32))],
        [onnx.numpy_helper.from_array(w, n) for n, w in weights.items()],
    )  # fmt: skip
    path = tmp_path / "attn.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), path)
    step = training_graph(import_onnx(path), Training())
    grads = {op.attr("operand"): op for op in step.ops if op.attr("op") == "attn"}
    assert sorted(grads) == [0, 1, 2]
    rules = {k: rule_for(op, step) for k, op in grads.items()}
    assert rules[0].loops[3].kind is IteratorType.PARALLEL
    assert rules[1].loops[3].kind is rules[2].loops[3].kind is IteratorType.REDUCTION
    option = ShardingOption(((0,), (1,), (), (), (), ()))  # batch on axis 0, heads on 1
    query_split = ShardingOption(((), (), (), (0,), (), ()))
    assert rules[1].result_sharding(option, 0) == Sharding(((0,), (), (1,)))
    assert rules[1].result_sharding(query_split, 0) == Sharding((), (0,))
    assert rules[0].result_sharding(query_split, 0) == Sharding(((), (0,)))


def test_an_onnxruntime_optimized_bert_plans_partitions_and_verifies(tmp_path, capsys):
    """models/bert.onnx through onnxruntime's optimizer: EmbedLayerNormalization, packed
    Attention, SkipLayerNormalization and BiasGelu, whose shapes only onnxruntime infers.
    Every op has a rule; planned on 2x2 under a budget below the replicated weights, the
    partition equals onnxruntime on the whole model."""
    from onnxruntime.transformers.optimizer import optimize_model

    from autoshard.cli.main import main
    from tests.e2e.helpers import model_path

    path = tmp_path / "bert_ort.onnx"
    optimized = optimize_model(str(model_path("bert")), model_type="bert", num_heads=4,
                               hidden_size=64, opt_level=1)  # fmt: skip
    optimized.save_model_to_file(str(path))
    fused = {n.op_type for n in optimized.model.graph.node if n.domain == MS}
    assert fused == {"EmbedLayerNormalization", "Attention", "SkipLayerNormalization", "BiasGelu"}
    dims = ["--dim", "batch=4", "--dim", "seq=8"]
    plan = tmp_path / "plan.json"
    args = ["plan", str(path), "--mesh", "2x2", *dims, "--memory", "300KB", "-o", str(plan)]
    assert main(args) == 0
    document = json.loads(plan.read_text())
    assert document["unruled"] == []
    out = tmp_path / "out"
    args = ["partition", str(path), "--mesh", "2x2", *dims, "--plan", str(plan), "-o", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    assert main(["verify", str(out), "--model", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True

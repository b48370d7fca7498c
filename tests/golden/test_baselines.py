"""The baseline plans (autoshard.search.baselines) on the bundled models: their annotations, the
exact collectives materialization inserts for them, and the Megatron plans run on every device
against onnxruntime on the original model."""

import functools
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from autoshard.annotations import Annotation
from autoshard.execute.verify import model_weights, verify
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.passes.materialize import materialize
from autoshard.passes.partition import partition
from autoshard.plan import RETURN
from autoshard.propagate import propagate
from autoshard.search.baselines import BaselineError, data_parallel, dp_tp, megatron
from autoshard.sharding import Sharding

from .seed_models import write_seed_mlp

MODELS = Path(__file__).resolve().parents[2] / "models"
FLAT, SQUARE = Mesh((2,)), Mesh((2, 2))


@functools.cache
def model(name, batch=2, seq=8):
    dims = {"batch": batch} if name in ("mlp", "cnn") else {"batch": batch, "seq": seq}
    return import_onnx(MODELS / f"{name}.onnx", dims)


def program(graph, mesh, annotations):
    return materialize(graph, propagate(graph, mesh, annotations))


def collectives(graph, mesh, annotations, axes=False):
    """(kind, value moved[, mesh axes]) of every collective, in program order."""
    found = program(graph, mesh, annotations)
    return [
        (str(s.collective.kind), found.tensors[s.source].value)
        + ((s.collective.mesh_axes,) if axes else ())
        for s in found.communications
    ]


def terse(annotations):
    return [(a.value, str(a.sharding)) for a in annotations]


# ---- GPT-2: the Megatron pattern, fused QKV ---------------------------------------------------


def gpt2_ts_expected(tp=(0,), dp=None):
    """One all_reduce for the embedding, two per layer; three free slices of the fused QKV per
    layer (see the baselines' docstring); with data parallelism the constant causal mask is
    sliced to the local batch too."""
    top = "/lm/transformer"
    out = [("all_reduce", f"{top}/wte/Gather_output_0", tp)]
    for i in range(2):
        out += [("all_slice", f"{top}/h.{i}/attn/Split_output_{j}", tp) for j in (1, 2, 0)]
        if dp is not None and i == 0:
            out.append(("all_slice", f"{top}/Where_1_output_0", dp))
        out += [
            ("all_reduce", f"{top}/h.{i}/attn/c_proj/Gemm_output_0", tp),
            ("all_reduce", f"{top}/h.{i}/mlp/c_proj/Gemm_output_0", tp),
        ]
    return out


def test_gpt2_megatron_collectives():
    graph = model("gpt2")
    assert collectives(graph, FLAT, megatron(graph, FLAT, 0), axes=True) == gpt2_ts_expected()
    # 5 all_reduces of a [2, 8, 64] float32 (4096 B), ring on 2 devices: 2·(1/2)·4096 each.
    assert program(graph, FLAT, megatron(graph, FLAT, 0)).bytes_per_device == 5 * 4096


def test_gpt2_dynamo_megatron_annotations_and_collectives():
    graph = model("gpt2_dynamo")
    annotations = megatron(graph, FLAT, 0)
    h = "lm.transformer.h"
    per_layer = [
        (f"{h}.{{}}.attn.c_proj.weight", "[[0]]"),  # attention output: row
        (f"{h}.{{}}.mlp.c_fc.weight", "[[], [0]]"),  # MLP first: column, with its bias
        (f"{h}.{{}}.mlp.c_fc.bias", "[[0]]"),
        (f"{h}.{{}}.mlp.c_proj.weight", "[[0]]"),  # MLP second: row
    ]
    # The tied table: vocabulary-split embedding and LM head (the module docstring's example).
    expected = [("lm.lm_head.weight", "[[0]]")]
    expected += [(name.format(i), s) for i in range(2) for name, s in per_layer]
    assert terse(annotations) == expected
    assert all(a.required and not a.for_users for a in annotations)
    expected_collectives = [("all_reduce", "embedding")]
    for split, addmm in (("split", 1), ("split_1", 5)):
        expected_collectives += [("all_slice", f"{split}_split_{j}") for j in (1, 2, 0)]
        expected_collectives += [
            ("all_reduce", f"addmm_{addmm}"),
            ("all_reduce", f"addmm_{addmm + 2}"),
        ]
    assert collectives(graph, FLAT, annotations) == expected_collectives
    # The tied LM head is vocabulary-parallel: logits are held and returned split on the vocab.
    plan = propagate(graph, FLAT, annotations)
    assert str(plan.values["logits"]) == "[[], [], [0]]"
    assert str(plan.needs[(RETURN, 0)]) == "[[], [], [0]]"
    # The head split reached q, k and v from the output projection.
    assert str(plan.needs[("node_view_6", 0)]) == "[[], [], [0]]"


def test_gpt2_untied_head_is_column_split():
    # TorchScript breaks GPT-2's weight tying: the head is a [64, 512] copy, found by its shape.
    graph = model("gpt2")
    annotations = dict(terse(megatron(graph, FLAT, 0)))
    assert annotations["onnx::MatMul_592"] == "[[], [0]]"
    assert annotations["lm.transformer.wte.weight"] == "[[0]]"
    assert "lm.transformer.h.0.attn.c_attn.weight" not in annotations  # fused QKV: replicated


def test_heads_that_do_not_divide_leave_attention_alone():
    # 4 heads on 8 devices: attention replicated; the MLPs (256 wide) and the vocabulary split.
    graph, mesh = model("gpt2"), Mesh((8,))
    annotations = dict(terse(megatron(graph, mesh, 0)))
    assert not any("attn" in name for name in annotations)
    top = "/lm/transformer"
    assert collectives(graph, mesh, megatron(graph, mesh, 0)) == [
        ("all_reduce", f"{top}/wte/Gather_output_0"),
        ("all_reduce", f"{top}/h.0/mlp/c_proj/Gemm_output_0"),
        ("all_reduce", f"{top}/h.1/mlp/c_proj/Gemm_output_0"),
    ]


# ---- BERT, the 32-layer decoder, the MLP ------------------------------------------------------


def test_bert_megatron():
    graph = model("bert")
    annotations = dict(terse(megatron(graph, FLAT, 0)))
    layer = "bert.encoder.layer.0"
    # Q, K, V [in, out] MatMul weights column-split with their biases; the outputs row-split.
    assert [annotations[w] for w in ("onnx::MatMul_348", "onnx::MatMul_355")] == ["[[], [0]]"] * 2
    assert annotations[f"{layer}.attention.self.query.bias"] == "[[0]]"
    assert annotations["onnx::MatMul_358"] == "[[0]]"  # attention output dense
    assert annotations["onnx::MatMul_359"] == "[[], [0]]"  # intermediate
    assert annotations["onnx::MatMul_360"] == "[[0]]"  # output dense
    assert annotations["bert.embeddings.word_embeddings.weight"] == "[[0]]"
    # Position and token-type tables are read by constant ids: not split.
    assert "bert.embeddings.position_embeddings.weight" not in annotations
    assert len(annotations) == 1 + 2 * 10
    plan = propagate(graph, FLAT, megatron(graph, FLAT, 0))
    heads = "/bert/encoder/layer.0/attention/self/Reshape_output_0"
    assert str(plan.values[heads]) == "[[], [], [0]]"  # [2, 8, 4, 16] split by heads
    expected = [("all_reduce", "/bert/embeddings/word_embeddings/Gather_output_0")]
    for i in range(2):
        expected += [
            ("all_reduce", f"/bert/encoder/layer.{i}/attention/output/dense/MatMul_output_0"),
            ("all_reduce", f"/bert/encoder/layer.{i}/output/dense/MatMul_output_0"),
        ]
    assert collectives(graph, FLAT, megatron(graph, FLAT, 0)) == expected


def test_decoder_32_layers_megatron():
    graph = model("decoder_32l_shape_only")
    expected = [("all_reduce", "embed.out")]
    for i in range(32):
        expected += [
            ("all_reduce", f"layers.{i}.attn.o_proj.out"),
            ("all_reduce", f"layers.{i}.mlp.down_proj.out"),
        ]
    annotations = megatron(graph, FLAT, 0)
    assert collectives(graph, FLAT, annotations) == expected
    held = dict(terse(annotations))
    # SwiGLU: gate and up column-split, down row-split; the untied head column-split.
    assert held["layers.7.mlp.gate_proj.weight"] == held["layers.7.mlp.up_proj.weight"]
    assert held["layers.7.mlp.gate_proj.weight"] == "[[], [0]]"
    assert held["layers.7.mlp.down_proj.weight"] == "[[0]]"
    assert held["lm_head.weight"] == "[[], [0]]"


def test_mlp_megatron_column_then_row():
    graph = model("mlp")
    annotations = megatron(graph, FLAT, 0)
    # Gemm transB: weights are [out, in], so the column split is dim 0.
    assert terse(annotations) == [
        ("0.weight", "[[0]]"),
        ("0.bias", "[[0]]"),
        ("2.weight", "[[], [0]]"),
    ]
    assert collectives(graph, FLAT, annotations) == [("all_reduce", "y")]


def test_cnn_channel_split_convs():
    # Conv -> BatchNorm -> Relu -> MaxPool -> Conv: output channels, then input channels; the
    # second conv's result is partial, reduced once. The classifier Gemm stays whole.
    graph = model("cnn")
    annotations = megatron(graph, FLAT, 0)
    assert terse(annotations) == [
        ("0.weight", "[[0]]"),
        ("0.bias", "[[0]]"),
        ("4.weight", "[[], [0]]"),
    ]
    assert collectives(graph, FLAT, annotations) == [("all_reduce", "/4/Conv_output_0")]


# ---- data parallel and DP x TP ----------------------------------------------------------------


def test_data_parallel_annotates_every_batch_input():
    assert terse(data_parallel(model("bert"), FLAT)) == [
        ("input_ids", "[[0]]"),
        ("attention_mask", "[[0]]"),
    ]
    assert terse(data_parallel(model("mlp", batch=4), SQUARE, (0, 1))) == [("x", "[[0, 1]]")]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("gpt2", gpt2_ts_expected(tp=(1,), dp=(0,))),
        (
            "bert",
            [("all_reduce", "/bert/embeddings/word_embeddings/Gather_output_0", (1,))]
            + [("all_slice", "/bert/embeddings/token_type_embeddings/Gather_output_0", (0,))]
            + [("all_slice", "/bert/Add_output_0", (0,))]  # constant mask ids, local rows
            + [
                ("all_reduce", f"/bert/encoder/layer.{i}/{where}/dense/MatMul_output_0", (1,))
                for i in range(2)
                for where in ("attention/output", "output")
            ],
        ),
        ("mlp", [("all_reduce", "y", (1,))]),
    ],
)
def test_dp_tp_reduces_over_the_tp_axis_only(name, expected):
    graph = model(name)
    annotations = dp_tp(graph, SQUARE, 0, 1)
    assert annotations[: len(graph.inputs)] == data_parallel(graph, SQUARE, (0,))
    assert collectives(graph, SQUARE, annotations, axes=True) == expected


def test_dp_tp_halves_megatron_bytes():
    # Each device reduces its half batch: [1, 8, 64] float32 on 2 devices, 2048 B each.
    graph = model("gpt2")
    assert program(graph, SQUARE, dp_tp(graph, SQUARE)).bytes_per_device == 5 * 2048


def test_named_axes():
    graph, mesh = model("mlp"), Mesh.parse("dp=2,tp=2")
    assert terse(dp_tp(graph, mesh, "dp", "tp"))[:2] == [("x", "[[0]]"), ("0.weight", "[[1]]")]


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: data_parallel(model("mlp", batch=3), FLAT),
            "data_parallel: batch 3 does not divide over mesh axes [0] (2 devices); "
            "bind a batch that is a multiple of 2",
        ),
        (lambda: megatron(model("mlp"), FLAT, 1), "megatron: unknown mesh axis 1"),
        (lambda: dp_tp(model("mlp"), SQUARE, 1, 1), "dp_tp: mesh axes [1, 1] repeat an axis"),
    ],
    ids=["batch", "axis", "same-axes"],
)
def test_bad_axes_and_batches_are_named(call, message):
    with pytest.raises(BaselineError) as error:
        call()
    assert message in str(error.value)


# ---- propagation: outputs are returned whole --------------------------------------------------


def test_propagated_partial_output_is_reduced_on_return(tmp_path):
    graph = import_onnx(write_seed_mlp(tmp_path / "mlp.onnx"))
    row = [Annotation("w2", Sharding.parse("[[0]]"))]
    plan = propagate(graph, FLAT, row)
    assert str(plan.values["y"]) == "[[]] partial = sum[0]"
    assert str(plan.needs[(RETURN, 0)]) == "[[]]"
    # w2's row split propagates back: dot1 column-split (x is replicated), the zero constant
    # sliced, y reduced once: the design pages' MLP as Megatron does it.
    assert collectives(graph, FLAT, row) == [("all_slice", "zero"), ("all_reduce", "y")]
    # A user who pins y partial gets it returned partial.
    pinned = [*row, Annotation("y", Sharding.parse("[[]] partial = sum[0]"))]
    assert str(propagate(graph, FLAT, pinned).needs[(RETURN, 0)]) == "[[]] partial = sum[0]"


# ---- numerics: every device runs its program --------------------------------------------------


@pytest.mark.parametrize(
    "name, mesh, plan",
    [
        ("mlp", FLAT, "megatron"),
        ("gpt2", FLAT, "megatron"),
        ("gpt2_dynamo", SQUARE, "dp_tp"),
        ("cnn", SQUARE, "dp_tp"),
    ],
)
def test_megatron_runs_like_the_model(name, mesh, plan):
    graph = model(name)
    annotations = megatron(graph, mesh, 0) if plan == "megatron" else dp_tp(graph, mesh)
    partitioned = partition(program(graph, mesh, annotations), graph)
    report = verify(partitioned, graph, MODELS / f"{name}.onnx", model_weights(graph, partitioned))
    for output, check in report.outputs.items():
        assert check.max_rel_err <= check.tolerance, (output, check)
        assert check.max_replica_err == 0.0, (output, check)


# ---- a hand-built attention: weights through Transpose, grouped-query heads -------------------


def write_gqa_attention(path):
    """x [2, 4, 8] -> attention with 4 query heads and 2 key/value heads (each repeated twice,
    Llama's repeat_kv) of size 2; projections `x @ Transpose(W)` with torch's [out, in] weights;
    then the output projection and a residual add."""
    rng = np.random.default_rng(0)
    f32 = onnx.TensorProto.FLOAT
    weights = {"wq": (8, 8), "wk": (4, 8), "wv": (4, 8), "wo": (8, 8)}
    inits = [
        numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
        for n, s in weights.items()
    ]
    ints = {
        "q_shape": [2, 4, 4, 2],
        "kv_shape": [2, 4, 2, 2],
        "axis2": [2],
        "rep": [2, 2, 2, 4, 2],
        "heads": [2, 4, 4, 2],
        "merged": [2, 4, 8],
    }
    inits += [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in ints.items()]
    node = onnx.helper.make_node
    nodes = [node("Transpose", [w], [f"{w}_t"], perm=[1, 0]) for w in weights]
    nodes += [node("MatMul", ["x", f"{w}_t"], [f"{w[1]}_proj"]) for w in ("wq", "wk", "wv")]
    nodes += [
        node("Reshape", ["q_proj", "q_shape"], ["q_heads"]),
        node("Transpose", ["q_heads"], ["q"], perm=[0, 2, 1, 3]),
    ]
    for t in ("k", "v"):
        nodes += [
            node("Reshape", [f"{t}_proj", "kv_shape"], [f"{t}_heads"]),
            node("Transpose", [f"{t}_heads"], [f"{t}_t"], perm=[0, 2, 1, 3]),
            node("Unsqueeze", [f"{t}_t", "axis2"], [f"{t}_1"]),
            node("Expand", [f"{t}_1", "rep"], [f"{t}_rep"]),
            node("Reshape", [f"{t}_rep", "heads"], [f"{t}_all"]),
        ]
    nodes += [
        node("Transpose", ["k_all"], ["k"], perm=[0, 1, 3, 2]),
        node("MatMul", ["q", "k"], ["scores"]),
        node("Softmax", ["scores"], ["probs"], axis=-1),
        node("MatMul", ["probs", "v_all"], ["ctx"]),
        node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
        node("Reshape", ["ctx_t", "merged"], ["ctx_m"]),
        node("MatMul", ["ctx_m", "wo_t"], ["o"]),
        node("Add", ["x", "o"], ["y"]),
    ]
    x = onnx.helper.make_tensor_value_info("x", f32, [2, 4, 8])
    y = onnx.helper.make_tensor_value_info("y", f32, [2, 4, 8])
    graph = onnx.helper.make_graph(nodes, "gqa", [x], [y], inits)
    opset = onnx.helper.make_opsetid("", 17)
    onnx.save(onnx.helper.make_model(graph, opset_imports=[opset], ir_version=10), path)
    return path


def test_grouped_query_attention_through_transposed_weights(tmp_path):
    path = write_gqa_attention(tmp_path / "gqa.onnx")
    graph = import_onnx(path)
    annotations = megatron(graph, FLAT, 0)
    # [out, in] weights behind a Transpose: Q, K, V split on dim 0 (output), O on dim 1 (input).
    assert terse(annotations) == [
        ("wq", "[[0]]"),
        ("wk", "[[0]]"),
        ("wv", "[[0]]"),
        ("wo", "[[], [0]]"),
    ]
    assert collectives(graph, FLAT, annotations) == [("all_reduce", "o")]
    # On 4 devices the 2 key/value heads do not divide: the whole block is left alone.
    assert megatron(graph, Mesh((4,)), 0) == []
    partitioned = partition(program(graph, FLAT, annotations), graph)
    report = verify(partitioned, graph, path, model_weights(graph, partitioned))
    assert report.outputs["y"].max_rel_err <= report.outputs["y"].tolerance

"""Llama's float32 islands (`build_decoder_shape_only(float32=True)`): under bf16-mixed the
upcast values stay float32, priced and held at 4 bytes an element, the rest take bf16."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import onnx
import pytest

from autoshard.cost.cluster import make_cluster
from autoshard.cost.compute import op_bytes, op_cost
from autoshard.cost.liveness import _walk_memory
from autoshard.pipeline import load_graph
from autoshard.program import Compute
from autoshard.search.budget import auto_plan
from autoshard.training import Training
from autoshard.training.options import Kernels, Loss, TrainingError
from autoshard.training.step import float32_islands

MODELS = Path(__file__).resolve().parents[2] / "models"
B, S, H, V = 2, 16, 64, 128  # batch, sequence, hidden, vocabulary
TRAINING = Training(loss=Loss.CROSS_ENTROPY)  # bf16-mixed


def _decoder(path: Path, float32: bool) -> Path:
    """A 1-layer shape-only decoder (hidden 64, 4 heads of 16, 2 KV heads)."""
    spec = importlib.util.spec_from_file_location("make_models", MODELS / "make_models.py")
    assert spec is not None and spec.loader is not None
    make_models = importlib.util.module_from_spec(spec)
    sys.modules["make_models"] = make_models  # its dataclasses look it up
    spec.loader.exec_module(make_models)
    built = make_models.build_decoder_shape_only(
        1, hidden=H, heads=4, kv_heads=2, ffn=128, vocab=V, float32=float32
    )
    onnx.save(built.proto, path)
    return path


@pytest.fixture(scope="module")
def islands(tmp_path_factory):
    path = _decoder(tmp_path_factory.mktemp("islands") / "decoder.onnx", True)
    return load_graph(path, {"batch": B, "seq": S}, TRAINING)


def test_upcast_values_stay_float32_and_the_rest_take_bf16(islands, tmp_path):
    dtype = {name: islands.values[name].dtype for name in islands.values}
    for name in ("layers.0.input_norm.upcast", "layers.0.input_norm.pow",
                 "layers.0.input_norm.div", "layers.0.attn.q_rope.sum",
                 "layers.0.attn.k_rope.upcast", "rope.cos", "logits", "loss"):  # fmt: skip
        assert dtype[name] == "float32", name
    bf16 = ("embed.out", "layers.0.input_norm.downcast", "layers.0.input_norm.out",
            "layers.0.attn.q_rope.downcast", "layers.0.attn.scores", "lm_head.out")  # fmt: skip
    for name in bf16:
        assert dtype[name] == "bfloat16", name
    # A gradient has its value's dtype: the upcast's float32, the norm's result's bf16.
    grads = [n for n in dtype if n.startswith("layers.0.input_norm.upcast@grad")]
    assert grads and all(dtype[n] == "float32" for n in grads)
    # Without islands (float16 throughout), every float but the optimizer's states is bf16.
    path = _decoder(tmp_path / "plain.onnx", False)
    assert not float32_islands(load_graph(path, {"batch": B, "seq": S}, None))
    plain = load_graph(path, {"batch": B, "seq": S}, TRAINING)
    assert {v.dtype for v in plain.values.values() if "@state" not in v.name} == {
        "bfloat16",
        "int64",
        "bool",
    }


def test_a_float32_norm_and_loss_move_four_bytes_an_element(islands):
    """Whole-tensor bytes (read + written): the upcast reads bf16 and writes float32; the
    norm's Pow reads and writes float32; the loss's Exp reads and writes the float32 logits'
    shifted copy; the downcast reads float32 and writes bf16."""
    ops = {op.name: op for op in islands.ops}

    def moved(output: str) -> int:
        op = next(o for o in ops.values() if output in o.outputs)
        return op_bytes(op, None, None, islands, make_cluster(mesh="1").mesh)

    assert moved("layers.0.input_norm.upcast") == B * S * H * (2 + 4)
    assert moved("layers.0.input_norm.pow") == B * S * H * (4 + 4) + 4  # and the float32 2.0
    assert moved("layers.0.input_norm.downcast") == B * S * H * (4 + 2)
    assert moved("layers.0.attn.q_rope.upcast") == B * 4 * S * 16 * (2 + 4)
    assert moved("logits") == B * S * V * (2 + 4)
    exp = next(o for o in ops.values() if o.type == "Exp")
    assert op_bytes(exp, None, None, islands, make_cluster(mesh="1").mesh) == B * S * V * 8


def test_the_backward_holds_the_float32_norm_input_and_logits(islands):
    """At the backward's start the norms' float32 inputs (the Pow's and Div's gradients read
    them) are held at 4 bytes an element, and so are the logits and the loss's shifted
    logits; the rotary's float32 values are not held (its gradient multiplies by cos and
    sin alone), only its bf16 result, which the scores' gradient reads."""
    program = auto_plan(islands, make_cluster(mesh="1"), []).program
    backward = next(
        i for i, s in enumerate(program.steps)
        if isinstance(s, Compute) and islands.phase(s.op.name) != "forward"
    )  # fmt: skip
    live = next(live for i, _, live in _walk_memory(program) if i == backward)
    held = {program.tensors[n].value: b for n, b in live.items()}
    for norm in ("layers.0.input_norm", "layers.0.post_attn_norm", "final_norm"):
        assert held[f"{norm}.upcast"] == B * S * H * 4
    assert held["logits"] == held["loss@3_sub"] == B * S * V * 4
    assert held["layers.0.attn.q_rope.downcast"] == B * 4 * S * 16 * 2
    assert not [n for n in held if "rope." in n and n.split(".")[-1] in ("upcast", "sum")]


def test_compiled_kernels_keep_a_norms_chain_on_chip(islands, tmp_path):
    """`--kernels compiled`: in each RMSNorm the Pow's square, the mean and the normalized
    value stay on chip (every reader an elementwise op or reduction of the forward); the
    float32 input is written (the backward's gradients read it), and so is the norm's
    result (a matmul reads it). The Pow then reads the input alone (B*S*H float32 and the
    exponent), writes nothing and launches nothing; the mean reads and writes nothing."""
    path = _decoder(tmp_path / "decoder.onnx", True)
    dims = {"batch": B, "seq": S}
    compiled = load_graph(path, dims, Training(loss=Loss.CROSS_ENTROPY, kernels=Kernels.COMPILED))
    assert not islands.on_chip
    norm = "layers.0.input_norm"
    for name in ("pow", "mean", "div"):
        assert f"{norm}.{name}" in compiled.on_chip
    for name in ("upcast", "sqrt", "out"):
        assert f"{norm}.{name}" not in compiled.on_chip
    cluster = make_cluster(mesh="1")

    def priced(graph, output):
        op = next(o for o in graph.ops if output in o.outputs)
        return op_cost(op, None, None, graph, cluster)  # unsharded, whole tensors

    eager_pow, pow_ = priced(islands, f"{norm}.pow"), priced(compiled, f"{norm}.pow")
    assert (eager_pow.bytes, pow_.bytes) == (2 * B * S * H * 4 + 4, B * S * H * 4 + 4)
    assert priced(compiled, f"{norm}.mean").bytes == 0
    launch = cluster.device.launch_s
    assert pow_.seconds < eager_pow.seconds - launch
    assert priced(compiled, f"{norm}.mean").seconds < launch
    assert "kernels" not in Training().to_json()
    assert Training.parse(kernels="compiled").to_json()["kernels"] == "compiled"
    with pytest.raises(TrainingError, match="unknown kernels 'fused'; choose one of: eager, "):
        Training.parse(kernels="fused")

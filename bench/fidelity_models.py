"""Shape-only Llama-, GPT- and BERT-style models at real widths, for the fidelity bench.

    python bench/fidelity_models.py OUT_DIR [--layers 2]

writes OUT_DIR/llama.onnx (Llama-2-7B's widths: hidden 4096, 32 heads, SwiGLU 11008, vocab
32000: `models/make_models.py`'s decoder), OUT_DIR/gpt.onnx (GPT-2-XL's: hidden 1600, 25 heads
of 64, MLP 6400, vocab 50257, learned positions up to 2048) and OUT_DIR/bert.onnx
(BERT-large's: hidden 1024, 16 heads, 4096, vocab 30522, positions up to 2048), each with
`--layers` layers, float16, weights as references to an absent file (so each file is a few
KB, and plans and the fidelity bench time them with random data). Symbolic dims `batch` and
`seq`. Every layer is the same, so a few time the whole model's per-layer mix; the
embeddings and the head weigh more than in the full depth.

The graphs follow what the exporters write for the Hugging Face models in eager mode:
GPT-2 pre-norm (LayerNormalization, a fused QKV projection split in three, a causal mask
added, the tanh GELU as Pow/Mul/Add/Tanh), BERT post-norm (three projections, the padding
mask from `attention_mask`, the erf GELU).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from make_models import OPSET, _ExternalWeights, build_decoder_shape_only  # noqa: E402

DTYPE = TensorProto.FLOAT16
NP_DTYPE = np.float16


class Builder:
    """Nodes, small constants and absent weights of one graph."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.small: list[TensorProto] = []
        self.weights = _ExternalWeights(f"{name}.weights", DTYPE)
        self.count = 0

    def node(self, op: str, inputs: list[str], name: str, outputs: int = 1, **attrs) -> str:
        self.count += 1
        names = [name] if outputs == 1 else [f"{name}.{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, names, name=f"{name}_{self.count}", **attrs))
        return name

    def const(self, name: str, value, dtype=NP_DTYPE) -> str:
        self.small.append(numpy_helper.from_array(np.array(value, dtype), name))
        return name

    def weight(self, name: str, dims: list[int]) -> str:
        return self.weights.add(name, dims)

    def linear(self, x: str, prefix: str, n_in: int, n_out: int) -> str:
        y = self.node("MatMul", [x, self.weight(f"{prefix}.weight", [n_in, n_out])], f"{prefix}.mm")
        return self.node("Add", [y, self.weight(f"{prefix}.bias", [n_out])], f"{prefix}.out")

    def layer_norm(self, x: str, prefix: str, h: int) -> str:
        g, b = self.weight(f"{prefix}.weight", [h]), self.weight(f"{prefix}.bias", [h])
        return self.node("LayerNormalization", [x, g, b], f"{prefix}.out", axis=-1, epsilon=1e-5)

    def attention(self, q: str, k: str, v: str, mask: str, prefix: str, h: int, nh: int) -> str:
        """Heads out of [b, s, h] projections, scaled scores plus `mask`, softmax, context."""
        q = self.node("Reshape", [q, "shape_heads"], f"{prefix}.q_heads")
        k = self.node("Reshape", [k, "shape_heads"], f"{prefix}.k_heads")
        v = self.node("Reshape", [v, "shape_heads"], f"{prefix}.v_heads")
        q = self.node("Transpose", [q], f"{prefix}.q_t", perm=[0, 2, 1, 3])
        kt = self.node("Transpose", [k], f"{prefix}.k_t", perm=[0, 2, 3, 1])
        v = self.node("Transpose", [v], f"{prefix}.v_t", perm=[0, 2, 1, 3])
        scores = self.node("MatMul", [q, kt], f"{prefix}.scores")
        scores = self.node("Div", [scores, "sqrt_head_dim"], f"{prefix}.scaled")
        scores = self.node("Add", [scores, mask], f"{prefix}.masked")
        probs = self.node("Softmax", [scores], f"{prefix}.probs", axis=-1)
        ctx = self.node("MatMul", [probs, v], f"{prefix}.ctx")
        ctx = self.node("Transpose", [ctx], f"{prefix}.ctx_t", perm=[0, 2, 1, 3])
        return self.node("Reshape", [ctx, "shape_hidden"], f"{prefix}.merged")

    def common(self, h: int, nh: int) -> None:
        self.const("shape_heads", [0, 0, nh, h // nh], np.int64)
        self.const("shape_hidden", [0, 0, h], np.int64)
        self.const("sqrt_head_dim", math.sqrt(h // nh))
        self.const("one", 1.0)
        self.const("half", 0.5)
        self.const("idx_seq", 1, np.int64)
        self.const("axes_0", [0], np.int64)
        self.const("zero_i", 0, np.int64)
        self.const("one_i", 1, np.int64)

    def positions(self, ids: str) -> str:
        """Range(0, seq) from the ids' shape (folded to a constant at planning)."""
        shape = self.node("Shape", [ids], "pos.shape")
        seq = self.node("Gather", [shape, "idx_seq"], "pos.seq", axis=0)
        return self.node("Range", ["zero_i", seq, "one_i"], "pos.ids")

    def model(self, inputs: list[str], output: str, width: int, doc: str) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, self.name,
            [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in inputs],
            [helper.make_tensor_value_info(output, DTYPE, ["batch", "seq", width])],
            self.small + self.weights.tensors,
        )  # fmt: skip
        return helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8, doc_string=doc
        )


def gpt(layers: int, h: int = 1600, nh: int = 25, vocab: int = 50257, ctx: int = 2048):
    b = Builder("gpt")
    b.common(h, nh)
    b.const("split_qkv", [h, h, h], np.int64)
    b.const("gelu_c", math.sqrt(2 / math.pi))
    b.const("gelu_k", 0.044715)
    b.const("three", 3.0)
    # Causal mask [seq, seq]: 0 on/below the diagonal, float16 min above it.
    shape = b.node("Shape", ["input_ids"], "mask.shape")
    seq = b.node("Gather", [shape, "idx_seq"], "mask.seq", axis=0)
    seq1 = b.node("Unsqueeze", [seq, "axes_0"], "mask.seq1")
    square = b.node("Concat", [seq1, seq1], "mask.shape2", axis=0)
    fill = helper.make_tensor("fill", DTYPE, [1], [float(np.finfo(NP_DTYPE).min)])
    full = b.node("ConstantOfShape", [square], "mask.full", value=fill)
    mask = b.node("Trilu", [full, "one_i"], "mask.causal", upper=1)
    tokens = b.node("Gather", [b.weight("wte", [vocab, h]), "input_ids"], "embed.tokens", axis=0)
    places = b.node("Gather", [b.weight("wpe", [ctx, h]), b.positions("input_ids")], "embed.pos")
    x = b.node("Add", [tokens, places], "embed.out")
    for i in range(layers):
        p = f"h.{i}"
        a = b.layer_norm(x, f"{p}.ln_1", h)
        qkv = b.linear(a, f"{p}.attn.c_attn", h, 3 * h)
        b.node("Split", [qkv, "split_qkv"], f"{p}.attn.split", outputs=3, axis=2)
        parts = [f"{p}.attn.split.{j}" for j in range(3)]
        merged = b.attention(*parts, mask, f"{p}.attn", h, nh)
        x = b.node("Add", [x, b.linear(merged, f"{p}.attn.c_proj", h, h)], f"{p}.attn_residual")
        m = b.layer_norm(x, f"{p}.ln_2", h)
        f = b.linear(m, f"{p}.mlp.c_fc", h, 4 * h)
        cube = b.node("Pow", [f, "three"], f"{p}.mlp.pow")
        inner = b.node("Add", [f, b.node("Mul", [cube, "gelu_k"], f"{p}.mlp.k")], f"{p}.mlp.in")
        t = b.node("Tanh", [b.node("Mul", [inner, "gelu_c"], f"{p}.mlp.c")], f"{p}.mlp.tanh")
        g = b.node("Mul", [f, b.node("Add", [t, "one"], f"{p}.mlp.one")], f"{p}.mlp.times")
        g = b.node("Mul", [g, "half"], f"{p}.mlp.gelu")
        x = b.node("Add", [x, b.linear(g, f"{p}.mlp.c_proj", 4 * h, h)], f"{p}.mlp_residual")
    x = b.layer_norm(x, "ln_f", h)
    b.node("MatMul", [x, b.weight("lm_head.weight", [h, vocab])], "logits")
    return b.model(["input_ids"], "logits", vocab, f"Shape-only GPT-style, {layers} layers")


def bert(layers: int, h: int = 1024, nh: int = 16, ffn: int = 4096, vocab: int = 30522,
         ctx: int = 2048):  # fmt: skip
    b = Builder("bert")
    b.common(h, nh)
    b.const("sqrt_two", math.sqrt(2.0))
    b.const("axes_12", [1, 2], np.int64)
    b.const("fmin", float(np.finfo(NP_DTYPE).min))
    # Padding mask [b, 1, 1, s]: (1 - mask) * min.
    m = b.node("Cast", ["attention_mask"], "mask.float", to=DTYPE)
    m = b.node("Unsqueeze", [m, "axes_12"], "mask.4d")
    m = b.node("Sub", ["one", m], "mask.inverted")
    mask = b.node("Mul", [m, "fmin"], "mask.additive")
    tokens = b.node("Gather", [b.weight("word", [vocab, h]), "input_ids"], "embed.tokens")
    places = b.node("Gather", [b.weight("position", [ctx, h]), b.positions("input_ids")],
                    "embed.pos")  # fmt: skip
    x = b.node("Add", [tokens, places], "embed.sum")
    x = b.layer_norm(x, "embed.ln", h)
    for i in range(layers):
        p = f"layer.{i}"
        q, k, v = (b.linear(x, f"{p}.attn.{n}", h, h) for n in ("query", "key", "value"))
        merged = b.attention(q, k, v, mask, f"{p}.attn", h, nh)
        a = b.node("Add", [b.linear(merged, f"{p}.attn.out", h, h), x], f"{p}.attn_residual")
        x = b.layer_norm(a, f"{p}.attn.ln", h)
        f = b.linear(x, f"{p}.intermediate", h, ffn)
        e = b.node("Erf", [b.node("Div", [f, "sqrt_two"], f"{p}.gelu.div")], f"{p}.gelu.erf")
        g = b.node("Mul", [f, b.node("Add", [e, "one"], f"{p}.gelu.one")], f"{p}.gelu.times")
        g = b.node("Mul", [g, "half"], f"{p}.gelu.out")
        o = b.node("Add", [b.linear(g, f"{p}.output", ffn, h), x], f"{p}.ffn_residual")
        x = b.layer_norm(o, f"{p}.output.ln", h)
    b.nodes[-1].output[0] = "last_hidden_state"
    return b.model(["input_ids", "attention_mask"], "last_hidden_state", h,
                   f"Shape-only BERT-style, {layers} layers")  # fmt: skip


def write(out: Path, layers: int) -> dict[str, int]:
    """llama.onnx, gpt.onnx and bert.onnx of `layers` layers in `out`; their node counts."""
    out.mkdir(parents=True, exist_ok=True)
    built = {
        "llama": build_decoder_shape_only(layers).proto,
        "gpt": gpt(layers),
        "bert": bert(layers),
    }
    for name, proto in built.items():
        onnx.save(proto, out / f"{name}.onnx")
    return {name: len(proto.graph.node) for name, proto in built.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    for name, nodes in write(args.out, args.layers).items():
        print(f"wrote {args.out / name}.onnx ({nodes} nodes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

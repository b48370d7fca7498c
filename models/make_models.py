"""Regenerate the small ONNX models that autoshard's test-suite reads.

Run from the repository root::

    python models/make_models.py              # rebuild every model
    python models/make_models.py mlp bert     # rebuild only some

Why this script exists: the test-suite needs real exporter output (TorchScript and dynamo
graphs have different op patterns, names and shape idioms), but the repository must stay small
and the tests must not need torch or network access.  So the models are built here, once, from
tiny configs with random weights, and the resulting ``.onnx`` files are committed next to this
script.  Everything is deterministic (a fixed ``torch.manual_seed`` per model), and nothing is
downloaded: Hugging Face models are built from configs, never ``from_pretrained``.

Each model is checked before its file is replaced: ``onnx.checker.check_model`` must pass and
onnxruntime's outputs on random inputs must match torch's at (batch, seq) = (2, 16) and (3, 7)
(the second catches dimensions accidentally baked in as constants).  The shape-only decoder has
no weight data at all; it is checked with ``check_model`` beside a sparse placeholder weights
file, and with shape inference.  See models/README.md for what each file contains.

Requires (dev only): torch, transformers, onnx, onnxruntime, onnxscript (dynamo exporter).
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MODELS_DIR = Path(__file__).resolve().parent
OPSET = 17
# The dynamo exporter (onnxscript) implements opset >= 18 only.  Asking it for 17 makes it export
# 18 and down-convert with onnx's C version converter, which leaves Split's opset-18
# ``num_outputs`` attribute in place and yields a model that fails onnx.checker.
DYNAMO_OPSET = 18
BATCH, SEQ = 2, 16  # example shapes for tracing, and the main onnxruntime-vs-torch check
# (batch, seq) pairs the parity check runs; the second differs from the traced example so a
# dimension that was accidentally baked in as a constant shows up as a failure.
CHECK_SHAPES = ((BATCH, SEQ), (3, 7))
ATOL = 1e-4


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


@dataclass
class Built:
    """A freshly built model plus what is needed to verify it.

    ``make_feeds(batch, seq)`` builds random inputs and ``reference`` maps them to the expected
    outputs (torch run on the same inputs); both are None for models that cannot be run (the
    shape-only decoder).
    """

    proto: onnx.ModelProto
    exporter: str
    make_feeds: Callable[[int, int], dict[str, np.ndarray]] | None = None
    reference: Callable[[dict[str, np.ndarray]], list[np.ndarray]] | None = None


def save_atomic(proto: onnx.ModelProto, path: Path) -> None:
    """Write ``proto`` to ``path`` as one self-contained file, atomically.

    The bytes go to a temp file in the same folder first and are moved over the target with
    ``os.replace``, so an interrupted run never leaves a truncated model behind.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(proto.SerializeToString())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the models are ordinary repo files
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def torchscript_export(
    model,
    args: tuple,
    input_names: list[str],
    output_names: list[str],
    dynamic_axes: dict[str, dict[int, str]],
    **kwargs,
) -> onnx.ModelProto:
    """Export with the TorchScript exporter (``dynamo=False``) into memory and load the proto."""
    import torch

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings / deprecation notices are expected
        torch.onnx.export(
            model,
            args,
            buf,
            dynamo=False,
            opset_version=OPSET,
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
            **kwargs,
        )
    return onnx.load_from_string(buf.getvalue())


def torch_reference(model, names: list[str]) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
    """Return a function that runs ``model`` on a feed dict (by input name) under no_grad."""
    import torch

    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        with torch.no_grad():
            out = model(*(torch.from_numpy(feeds[n]) for n in names))
        outs = out if isinstance(out, tuple | list) else (out,)
        return [o.detach().numpy() for o in outs]

    return run


def jitter_parameters(model) -> None:
    """Add small seeded noise to every parameter, in place.

    Hugging Face init leaves biases at 0 and LayerNorm weights at 1, so many tensors are
    bit-identical across layers; the TorchScript exporter then de-duplicates them into one
    shared initializer (plus Identity nodes), which no real checkpoint would produce.  Noise
    keeps every parameter distinct and makes the parity check exercise the biases too.
    """
    import torch

    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)


def token_feeds(vocab: int, with_mask: bool = False) -> Callable[[int, int], dict]:
    """Feed maker: random int64 token ids [batch, seq] (and a padding-style attention mask)."""

    def make(batch: int, seq: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        feeds = {"input_ids": rng.integers(0, vocab, size=(batch, seq), dtype=np.int64)}
        if with_mask:
            mask = np.ones((batch, seq), dtype=np.int64)
            mask[-1, seq // 2 :] = 0  # last sequence is right-padded
            feeds["attention_mask"] = mask
        return feeds

    return make


def float_feeds(name: str, *shape: int) -> Callable[[int, int], dict]:
    """Feed maker: random float32 ``name`` of shape [batch, *shape] (seq is ignored)."""

    def make(batch: int, seq: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        return {name: rng.standard_normal((batch, *shape)).astype(np.float32)}

    return make


# --------------------------------------------------------------------------------------------
# 1. MLP
# --------------------------------------------------------------------------------------------


def build_mlp() -> Built:
    """2-layer MLP (Linear 64->256, ReLU, Linear 256->64); the simplest shardable graph.

    Input ``x`` float32 [batch, 64]. TorchScript exporter, opset 17.
    """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).eval()
    x = torch.randn(BATCH, 64)
    proto = torchscript_export(model, (x,), ["x"], ["y"], {"x": {0: "batch"}, "y": {0: "batch"}})
    return Built(
        proto,
        "torch.onnx.export(dynamo=False)",
        float_feeds("x", 64),
        torch_reference(model, ["x"]),
    )


# --------------------------------------------------------------------------------------------
# 2./3. GPT-2 (TorchScript and dynamo exporters)
# --------------------------------------------------------------------------------------------


def _tiny_gpt2():
    """Tiny GPT-2 LM (2 layers, 64 wide, 4 heads, vocab 512) returning only the logits.

    The KV cache is disabled so the graph has a single output and no past-key-value inputs;
    eager attention keeps the exported attention pattern explicit (MatMul/Softmax/MatMul).
    """
    import torch
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel

    class LogitsOnly(nn.Module):
        def __init__(self, lm: nn.Module) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, input_ids):
            # An all-ones mask keeps transformers off its packed-sequence detection path
            # (torch.diff, which the TorchScript exporter cannot export).
            mask = torch.ones_like(input_ids)
            return self.lm(input_ids=input_ids, attention_mask=mask, use_cache=False).logits

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=512,
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=511,
        eos_token_id=511,
        use_cache=False,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    config._attn_implementation = "eager"
    lm = GPT2LMHeadModel(config)
    jitter_parameters(lm)  # the LM head stays tied: it is the same tensor as wte
    return LogitsOnly(lm).eval(), config


def build_gpt2() -> Built:
    """GPT-2 decoder, TorchScript exporter: input ``input_ids`` int64 [batch, seq] -> logits."""
    import torch

    model, config = _tiny_gpt2()
    ids = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    proto = torchscript_export(
        model,
        (ids,),
        ["input_ids"],
        ["logits"],
        {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}},
    )
    return Built(
        proto,
        "torch.onnx.export(dynamo=False)",
        token_feeds(config.vocab_size),
        torch_reference(model, ["input_ids"]),
    )


def export_tiny_llama(
    path: Path, vocab: int, hidden: int, batch: int, seq: int, opset: int = 23
) -> Path:
    """A 2-layer Hugging Face Llama (4 query heads over 2 key-value heads, MLP twice as wide)
    exported by the dynamo exporter to `path`, its logits the output and (batch, seq) token ids
    the input: what the opset-23 and training-run tests and bench/train_run.py plan."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, ids):  # type: ignore[no-untyped-def]
            return self.lm(input_ids=ids, use_cache=False).logits

    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Logits(), (ids,), path, dynamo=True, opset_version=opset, verbose=False)
    return path


def strip_stack_traces(proto: onnx.ModelProto) -> None:
    """Drop the dynamo exporter's per-node ``pkg.torch.onnx.stack_trace`` metadata, in place.

    The traces hold absolute file paths and line numbers of this script and of site-packages,
    so they would change the file whenever this script is edited or run on another machine.
    The other metadata (``namespace``, ``pkg.torch.onnx.name_scopes``, ``class_hierarchy``,
    ``fx_node``) is deterministic and kept: it is real exporter output that maps nodes to
    modules.
    """
    for node in proto.graph.node:
        kept = [p for p in node.metadata_props if p.key != "pkg.torch.onnx.stack_trace"]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)


def build_gpt2_dynamo() -> Built:
    """The same GPT-2 exported with the dynamo exporter (torch.export + onnxscript).

    Batch and seq are symbolic via ``torch.export.Dim("batch")`` / ``Dim("seq")``.  The
    ONNXProgram's proto is saved as a single file (no external data).
    """
    import torch
    from torch.export import Dim

    model, config = _tiny_gpt2()
    ids = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    dynamic_shapes = {
        "input_ids": {0: Dim("batch", min=1, max=1024), 1: Dim("seq", min=2, max=128)}
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model,
            (ids,),
            dynamo=True,
            opset_version=DYNAMO_OPSET,
            input_names=["input_ids"],
            output_names=["logits"],
            dynamic_shapes=dynamic_shapes,
            optimize=True,
            verbose=False,
        )
    proto = program.model_proto
    strip_stack_traces(proto)
    return Built(
        proto,
        "torch.onnx.export(dynamo=True)",
        token_feeds(config.vocab_size),
        torch_reference(model, ["input_ids"]),
    )


# --------------------------------------------------------------------------------------------
# 4. BERT
# --------------------------------------------------------------------------------------------


def build_bert() -> Built:
    """Tiny BERT encoder (2 layers, hidden 64, 4 heads, ffn 128, vocab 512).

    Inputs ``input_ids`` and ``attention_mask`` int64 [batch, seq]; output
    ``last_hidden_state``.  Eager attention so the padding mask is an explicit Add.
    """
    import torch
    from torch import nn
    from transformers import BertConfig, BertModel

    class HiddenOnly(nn.Module):
        def __init__(self, bert: nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask)
            return out.last_hidden_state

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        attn_implementation="eager",
    )
    config._attn_implementation = "eager"
    bert = BertModel(config, add_pooling_layer=False)
    jitter_parameters(bert)
    model = HiddenOnly(bert).eval()
    ids = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    proto = torchscript_export(
        model,
        (ids, mask),
        ["input_ids", "attention_mask"],
        ["last_hidden_state"],
        {"input_ids": axes, "attention_mask": axes, "last_hidden_state": axes},
    )
    return Built(
        proto,
        "torch.onnx.export(dynamo=False)",
        token_feeds(config.vocab_size, with_mask=True),
        torch_reference(model, ["input_ids", "attention_mask"]),
    )


# --------------------------------------------------------------------------------------------
# 5. CNN
# --------------------------------------------------------------------------------------------


def build_cnn() -> Built:
    """Small CNN on [batch, 3, 32, 32] images -> 10 logits.

    Exported in eval mode with ``do_constant_folding=False`` so BatchNormalization stays a
    separate op (not fused into the Conv): the planner should see it.
    """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    # Non-trivial running statistics so BatchNorm is not an identity in eval mode.
    with torch.no_grad():
        bn = model[1]
        bn.running_mean.copy_(torch.randn(8) * 0.1)
        bn.running_var.copy_(torch.rand(8) + 0.5)
        bn.weight.copy_(torch.rand(8) + 0.5)
        bn.bias.copy_(torch.randn(8) * 0.1)
    model.eval()
    image = torch.randn(BATCH, 3, 32, 32)
    proto = torchscript_export(
        model,
        (image,),
        ["image"],
        ["logits"],
        {"image": {0: "batch"}, "logits": {0: "batch"}},
        do_constant_folding=False,
        training=torch.onnx.TrainingMode.EVAL,
    )
    return Built(
        proto,
        "torch.onnx.export(dynamo=False)",
        float_feeds("image", 3, 32, 32),
        torch_reference(model, ["image"]),
    )


# --------------------------------------------------------------------------------------------
# 6. Shape-only 32-layer decoder (no torch, no weight data)
# --------------------------------------------------------------------------------------------

BIG_NAME = "decoder_32l_shape_only"
BIG_LAYERS, BIG_HIDDEN, BIG_HEADS, BIG_FFN, BIG_VOCAB = 32, 4096, 32, 11008, 32000
BIG_DTYPE = TensorProto.FLOAT16
ROPE_THETA = 500000.0  # Llama 3's rotary base (`build_decoder_shape_only(float32=True)`)


class _ExternalWeights:
    """Creates float initializers that point into a (deliberately absent) weights file.

    Each tensor gets ``data_location = EXTERNAL`` and ``location/offset/length`` entries laid
    out back to back, exactly as if ``<name>.weights`` existed.  No bytes are stored, so the
    7B-parameter graph is a few hundred KB.
    """

    def __init__(self, location: str, dtype: int) -> None:
        self.location = location
        self.dtype = dtype
        self.itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(dtype)).itemsize
        self.offset = 0
        self.tensors: list[TensorProto] = []

    def add(self, name: str, dims: list[int]) -> str:
        t = TensorProto()
        t.name = name
        t.data_type = self.dtype
        t.dims.extend(dims)
        t.data_location = TensorProto.EXTERNAL
        length = math.prod(dims) * self.itemsize
        for key, value in (
            ("location", self.location),
            ("offset", self.offset),
            ("length", length),
        ):
            entry = t.external_data.add()
            entry.key, entry.value = key, str(value)
        self.offset += length
        self.tensors.append(t)
        return name


def build_decoder_32l_shape_only() -> Built:
    return build_decoder_shape_only(BIG_LAYERS)


def build_decoder_shape_only(
    layers: int,
    *,
    hidden: int = BIG_HIDDEN,
    heads: int = BIG_HEADS,
    kv_heads: int | None = None,
    ffn: int = BIG_FFN,
    vocab: int = BIG_VOCAB,
    float32: bool = False,
) -> Built:
    """Llama-style decoder graph (`layers` layers, 32 in the bundled model) built with
    ``onnx.helper``; the widths default to Llama-7B's (hidden 4096, 32 heads, SwiGLU 11008,
    vocab 32000), and bigger ones give the 70B and 405B shapes the large-model bench plans.
    Weights are external references to a file that does not exist, so the graph is usable for
    shape/cost planning only, never for running.

    Per layer: RMSNorm decomposition (Pow/ReduceMean/Add/Sqrt/Div/Mul), Q/K/V MatMuls,
    Reshape to [0, 0, heads, head_dim] (torch-style 0/-1 targets), Transpose, QK^T MatMul, Div
    by sqrt(head_dim), Add causal mask, Softmax, MatMul V, Transpose back, Reshape
    [0, 0, hidden], output MatMul, residual Add, RMSNorm, SwiGLU MLP (gate/up MatMul,
    Sigmoid*x, Mul, down MatMul), residual Add.  The causal mask is computed in-graph from
    Shape(input_ids) so shape folding is exercised.  No rotary embedding (irrelevant for
    shapes/costs).

    Grouped-query attention (`kv_heads` < `heads`; None means `heads`, plain multi-head): K
    and V project to kv_heads * head_dim and each KV head is repeated for its group as
    Hugging Face's ``repeat_kv`` exports it (Unsqueeze, Expand, Reshape).  Multi-head graphs
    are built exactly as before, so the bundled model regenerates byte for byte.

    `float32` adds the float32 islands a real Llama's training step runs (off by default: the
    bundled models keep their bytes). Each RMSNorm upcasts as Hugging Face's and TorchTitan's
    do (``x.float()`` ... ``.type_as(x)``, exported as Cast to float32 before the Pow and
    Cast back before the weight's Mul); Q and K (as [b, heads, s, hd], before ``repeat_kv``)
    get rotary embeddings in float32, as TorchTitan computes them: Cast up, ``x * cos +
    rotate_half(x) * sin`` with Hugging Face's rotate_half (Slice, Slice, Neg, Concat), Cast
    back; cos and sin ([s, hd], float32) are computed in-graph from Range(seq) and the
    inverse frequencies (theta 500000, Llama 3's); and the logits are Cast to float32, as
    the loss reads them (``logits.float()``), so a cross-entropy loss is priced in float32.
    """
    h, nh, kv = hidden, heads, heads if kv_heads is None else kv_heads
    if h % nh or nh % kv:
        raise ValueError(f"hidden {h}, heads {nh}, kv_heads {kv}: need heads | hidden, kv | heads")
    hd = h // nh
    group = nh // kv
    np_dt = helper.tensor_dtype_to_np_dtype(BIG_DTYPE)
    weights = _ExternalWeights(f"{BIG_NAME}.weights", BIG_DTYPE)
    nodes: list[onnx.NodeProto] = []
    counter = iter(range(1_000_000))

    def node(op: str, inputs: list[str], name: str, **attrs) -> str:
        """Append one single-output node named ``name``; returns its output name."""
        nodes.append(helper.make_node(op, inputs, [name], name=f"{name}_{next(counter)}", **attrs))
        return name

    # Small constants are embedded (int64 shapes/axes, fp16 scalars), as exporters do.
    small = [
        numpy_helper.from_array(np.array([0, 0, nh, hd], np.int64), "shape_heads"),
        numpy_helper.from_array(np.array([0, 0, h], np.int64), "shape_hidden"),
        numpy_helper.from_array(np.array([-1], np.int64), "axes_last"),
        numpy_helper.from_array(np.array([0], np.int64), "axes_0"),
        numpy_helper.from_array(np.array(1, np.int64), "idx_seq"),
        numpy_helper.from_array(np.array(1, np.int64), "k_one"),
        numpy_helper.from_array(np.array(2.0, np_dt), "two"),
        numpy_helper.from_array(np.array(1e-5, np_dt), "eps"),
        numpy_helper.from_array(np.array(math.sqrt(hd), np_dt), "sqrt_head_dim"),
    ]
    if group > 1:  # only GQA graphs carry these, so MHA graphs stay byte-identical
        small += [
            numpy_helper.from_array(np.array([0, 0, kv, hd], np.int64), "shape_kv_heads"),
            numpy_helper.from_array(np.array([2], np.int64), "axes_2"),
            numpy_helper.from_array(np.array([1, 1, group, 1, 1], np.int64), "kv_repeat"),
            numpy_helper.from_array(np.array([0, nh, -1, hd], np.int64), "shape_kv_merged"),
        ]

    if float32:
        small += [
            numpy_helper.from_array(np.array(2.0, np.float32), "two_f32"),
            numpy_helper.from_array(np.array(1e-5, np.float32), "eps_f32"),
            numpy_helper.from_array(np.array([0], np.int64), "rot_lo"),
            numpy_helper.from_array(np.array([hd // 2], np.int64), "rot_mid"),
            numpy_helper.from_array(np.array([hd], np.int64), "rot_hi"),
            numpy_helper.from_array(np.array([1], np.int64), "axes_1"),
            numpy_helper.from_array(np.array(0, np.int64), "i64_zero"),
            numpy_helper.from_array(
                ROPE_THETA ** -(np.arange(0, hd, 2, dtype=np.float32) / hd), "inv_freq"
            ),
        ]
    two, eps = ("two_f32", "eps_f32") if float32 else ("two", "eps")

    def rms_norm(x: str, prefix: str) -> str:
        w = weights.add(f"{prefix}.weight", [h])
        if float32:
            x = node("Cast", [x], f"{prefix}.upcast", to=TensorProto.FLOAT)
        sq = node("Pow", [x, two], f"{prefix}.pow")
        mean = node("ReduceMean", [sq], f"{prefix}.mean", axes=[-1], keepdims=1)
        var = node("Add", [mean, eps], f"{prefix}.add_eps")
        rms = node("Sqrt", [var], f"{prefix}.sqrt")
        normed = node("Div", [x, rms], f"{prefix}.div")
        if float32:
            normed = node("Cast", [normed], f"{prefix}.downcast", to=BIG_DTYPE)
        return node("Mul", [normed, w], f"{prefix}.out")

    def rotary(x: str, prefix: str) -> str:
        """[b, heads, s, hd] rotated in float32 (the docstring), cast back."""
        x = node("Cast", [x], f"{prefix}.upcast", to=TensorProto.FLOAT)
        lo = node("Slice", [x, "rot_lo", "rot_mid", "axes_last"], f"{prefix}.lo")
        hi = node("Slice", [x, "rot_mid", "rot_hi", "axes_last"], f"{prefix}.hi")
        turned = node("Concat", [node("Neg", [hi], f"{prefix}.neg"), lo], f"{prefix}.half",
                      axis=-1)  # fmt: skip
        cos = node("Mul", [x, "rope.cos"], f"{prefix}.cos")
        sin = node("Mul", [turned, "rope.sin"], f"{prefix}.sin")
        out = node("Add", [cos, sin], f"{prefix}.sum")
        return node("Cast", [out], f"{prefix}.downcast", to=BIG_DTYPE)

    def linear(x: str, prefix: str, n_in: int, n_out: int) -> str:
        w = weights.add(f"{prefix}.weight", [n_in, n_out])
        return node("MatMul", [x, w], f"{prefix}.out")

    # Causal mask [seq, seq]: 0 on/below the diagonal, fp16 min above it.
    shape = node("Shape", ["input_ids"], "mask.shape")
    seq = node("Gather", [shape, "idx_seq"], "mask.seq", axis=0)
    seq1 = node("Unsqueeze", [seq, "axes_0"], "mask.seq1")
    sq_shape = node("Concat", [seq1, seq1], "mask.shape2", axis=0)
    fill = helper.make_tensor("fill", BIG_DTYPE, [1], [float(np.finfo(np_dt).min)])
    full = node("ConstantOfShape", [sq_shape], "mask.full", value=fill)
    mask = node("Trilu", [full, "k_one"], "mask.causal", upper=1)  # k=1: strictly above

    if float32:  # cos, sin [s, hd] of the positions 0..s-1
        positions = node("Range", ["i64_zero", seq, "k_one"], "rope.positions")
        positions = node("Cast", [positions], "rope.positions_f32", to=TensorProto.FLOAT)
        positions = node("Unsqueeze", [positions, "axes_1"], "rope.column")
        angles = node("Mul", [positions, "inv_freq"], "rope.angles")  # [s, hd/2]
        angles = node("Concat", [angles, angles], "rope.emb", axis=-1)
        node("Cos", [angles], "rope.cos")
        node("Sin", [angles], "rope.sin")

    embed = weights.add("embed_tokens.weight", [vocab, h])
    x = node("Gather", [embed, "input_ids"], "embed.out", axis=0)

    def repeat_kv(x: str, prefix: str) -> str:
        """[b, kv, s, hd] -> [b, nh, s, hd], each KV head repeated `group` times."""
        x = node("Unsqueeze", [x, "axes_2"], f"{prefix}.unsqueeze")  # [b, kv, 1, s, hd]
        x = node("Expand", [x, "kv_repeat"], f"{prefix}.expand")  # [b, kv, group, s, hd]
        return node("Reshape", [x, "shape_kv_merged"], f"{prefix}.merge")

    for i in range(layers):
        p = f"layers.{i}"
        a = rms_norm(x, f"{p}.input_norm")
        q = linear(a, f"{p}.attn.q_proj", h, h)
        k = linear(a, f"{p}.attn.k_proj", h, kv * hd)
        v = linear(a, f"{p}.attn.v_proj", h, kv * hd)
        kv_shape = "shape_heads" if group == 1 else "shape_kv_heads"
        q = node("Reshape", [q, "shape_heads"], f"{p}.attn.q_heads")
        k = node("Reshape", [k, kv_shape], f"{p}.attn.k_heads")
        v = node("Reshape", [v, kv_shape], f"{p}.attn.v_heads")
        q = node("Transpose", [q], f"{p}.attn.q_t", perm=[0, 2, 1, 3])  # [b, nh, s, hd]
        if float32:
            q = rotary(q, f"{p}.attn.q_rope")
            k = node("Transpose", [k], f"{p}.attn.k_t", perm=[0, 2, 1, 3])  # [b, kv, s, hd]
            k = rotary(k, f"{p}.attn.k_rope")
            k = repeat_kv(k, f"{p}.attn.k_rep") if group > 1 else k
            kt = node("Transpose", [k], f"{p}.attn.k_rep_t", perm=[0, 1, 3, 2])  # [b, nh, hd, s]
            v = node("Transpose", [v], f"{p}.attn.v_t", perm=[0, 2, 1, 3])  # [b, kv, s, hd]
            v = repeat_kv(v, f"{p}.attn.v_rep") if group > 1 else v
        elif group == 1:
            kt = node("Transpose", [k], f"{p}.attn.k_t", perm=[0, 2, 3, 1])  # [b, nh, hd, s]
            v = node("Transpose", [v], f"{p}.attn.v_t", perm=[0, 2, 1, 3])  # [b, nh, s, hd]
        else:
            k = node("Transpose", [k], f"{p}.attn.k_t", perm=[0, 2, 1, 3])  # [b, kv, s, hd]
            k = repeat_kv(k, f"{p}.attn.k_rep")
            kt = node("Transpose", [k], f"{p}.attn.k_rep_t", perm=[0, 1, 3, 2])  # [b, nh, hd, s]
            v = node("Transpose", [v], f"{p}.attn.v_t", perm=[0, 2, 1, 3])  # [b, kv, s, hd]
            v = repeat_kv(v, f"{p}.attn.v_rep")
        scores = node("MatMul", [q, kt], f"{p}.attn.scores")
        scores = node("Div", [scores, "sqrt_head_dim"], f"{p}.attn.scaled")
        scores = node("Add", [scores, mask], f"{p}.attn.masked")
        probs = node("Softmax", [scores], f"{p}.attn.probs", axis=-1)
        ctx = node("MatMul", [probs, v], f"{p}.attn.ctx")
        ctx = node("Transpose", [ctx], f"{p}.attn.ctx_t", perm=[0, 2, 1, 3])  # [b, s, nh, hd]
        ctx = node("Reshape", [ctx, "shape_hidden"], f"{p}.attn.merged")
        o = linear(ctx, f"{p}.attn.o_proj", h, h)
        x = node("Add", [x, o], f"{p}.attn_residual")

        m = rms_norm(x, f"{p}.post_attn_norm")
        gate = linear(m, f"{p}.mlp.gate_proj", h, ffn)
        up = linear(m, f"{p}.mlp.up_proj", h, ffn)
        sig = node("Sigmoid", [gate], f"{p}.mlp.sigmoid")
        act = node("Mul", [gate, sig], f"{p}.mlp.silu")
        hidden = node("Mul", [act, up], f"{p}.mlp.gated")
        down = linear(hidden, f"{p}.mlp.down_proj", ffn, h)
        x = node("Add", [x, down], f"{p}.mlp_residual")

    x = rms_norm(x, "final_norm")
    linear(x, "lm_head", h, vocab)
    if float32:
        node("Cast", [nodes[-1].output[0]], "logits", to=TensorProto.FLOAT)
    else:
        nodes[-1].output[0] = "logits"

    graph = helper.make_graph(
        nodes,
        BIG_NAME,
        inputs=[helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        outputs=[helper.make_tensor_value_info(
            "logits", TensorProto.FLOAT if float32 else BIG_DTYPE, ["batch", "seq", vocab]
        )],
        initializer=small + weights.tensors,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="autoshard/models/make_models.py",
        ir_version=8,
        doc_string=f"Shape-only {layers}-layer decoder: weights are external references to a file "
        f"({BIG_NAME}.weights) that is intentionally absent.",
    )
    return Built(model, "onnx.helper (hand-built)")


def build_block_dynamo() -> Built:
    """Two pre-norm blocks (LayerNorm(32), Linear 32->64, ReLU, Linear 64->32, residual) exported
    with the dynamo exporter, kept as it writes them: the Linear weights are folded transposes
    `val_N` [in, out] whose value metadata `pkg.onnxscript.optimizer.folded_from` names the
    parameter, and the two fresh LayerNorms (ones, zeros: left at their init on purpose) are
    deduplicated into one pair of initializers read by both blocks. Nodes carry their
    `pkg.torch.onnx.name_scopes`. The export tests recover every parameter name from these.
    """
    import torch
    from torch import nn
    from torch.export import Dim

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(32)
            self.up = nn.Linear(32, 64)
            self.down = nn.Linear(64, 32, bias=False)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).eval()
    x = torch.randn(BATCH, SEQ, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (x,), dynamo=True, opset_version=DYNAMO_OPSET, input_names=["x"],
            output_names=["y"], optimize=True, verbose=False,
            dynamic_shapes={"input": {0: Dim("batch", max=1024), 1: Dim("seq", max=128)}},
        )  # fmt: skip
    proto = program.model_proto
    strip_stack_traces(proto)
    reference = torch_reference(model, ["x"])
    return Built(proto, "torch.onnx.export(dynamo=True)", _block_feeds, reference)


def _block_feeds(batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((batch, seq, 32), dtype=np.float32)}


# --------------------------------------------------------------------------------------------
# verification and driver
# --------------------------------------------------------------------------------------------

BUILDERS: dict[str, Callable[[], Built]] = {
    "mlp": build_mlp,
    "gpt2": build_gpt2,
    "gpt2_dynamo": build_gpt2_dynamo,
    "bert": build_bert,
    "cnn": build_cnn,
    "block_dynamo": build_block_dynamo,
    BIG_NAME: build_decoder_32l_shape_only,
}


def param_count(proto: onnx.ModelProto) -> int:
    """Sum of initializer element counts (external tensors included)."""
    return sum(math.prod(t.dims) for t in proto.graph.initializer)


def check_shape_only(proto: onnx.ModelProto) -> None:
    """Validate a model whose weights point to an absent external file.

    ``onnx.checker`` insists that each external ``location`` is a regular file, so the bare
    proto cannot pass it.  We save the proto into a temp dir next to a *sparse* placeholder
    weights file of the declared total size (no disk blocks used) and run the path-based checker
    plus strict shape inference there; then the saved file must also load with
    ``load_external_data=False``.
    """
    locations: dict[str, int] = {}
    for t in proto.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            end = int(info["offset"]) + int(info["length"])
            locations[info["location"]] = max(locations.get(info["location"], 0), end)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        path.write_bytes(proto.SerializeToString())
        for location, size in locations.items():
            with open(Path(tmp) / location, "wb") as f:
                f.truncate(size)
        onnx.checker.check_model(str(path), full_check=True)
        loaded = onnx.load(str(path), load_external_data=False)
    onnx.shape_inference.infer_shapes(loaded, check_type=True, strict_mode=True)


def verify(name: str, built: Built) -> dict[tuple[int, int], float]:
    """Check the proto and compare onnxruntime with torch at each of ``CHECK_SHAPES``.

    Returns the max abs error per (batch, seq); empty for the shape-only model.  Raises if the
    checker fails or an error exceeds ``ATOL``.
    """
    if built.reference is None or built.make_feeds is None:
        check_shape_only(built.proto)
        return {}
    onnx.checker.check_model(built.proto, full_check=True)
    import onnxruntime as ort

    sess = ort.InferenceSession(built.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    errors = {}
    for batch, seq in CHECK_SHAPES:
        feeds = built.make_feeds(batch, seq)
        got = sess.run(None, feeds)
        want = built.reference(feeds)
        if len(got) != len(want):
            raise AssertionError(f"{name}: {len(got)} onnx outputs vs {len(want)} torch outputs")
        for g, w in zip(got, want, strict=True):
            if g.shape != w.shape:
                raise AssertionError(f"{name}: onnx output {g.shape} vs torch {w.shape}")
        err = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want, strict=True))
        if err > ATOL:
            raise AssertionError(f"{name}: onnxruntime differs from torch by {err:.3g} > {ATOL}")
        errors[batch, seq] = err
    return errors


def selected_names(
    parser: argparse.ArgumentParser, names: list[str], known: Iterable[str]
) -> list[str]:
    """The models named on the command line (all `known` when none); a parser error naming
    the unknown ones and the choices."""
    choices = list(known)
    unknown = sorted(set(names) - set(choices))
    if unknown:
        parser.error(f"unknown model(s): {', '.join(unknown)}; choose from {', '.join(choices)}")
    return names or choices


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"models to regenerate (default: all): {', '.join(BUILDERS)}",
    )
    args = parser.parse_args(argv)
    for name in selected_names(parser, args.names, BUILDERS):
        built = BUILDERS[name]()
        errors = verify(name, built)  # before writing: a bad export never replaces a good file
        path = MODELS_DIR / f"{name}.onnx"
        save_atomic(built.proto, path)
        if errors:
            err_txt = ", ".join(f"b{b}s{s}={e:.1e}" for (b, s), e in errors.items())
        else:
            err_txt = "n/a (shape-only)"
        print(
            f"{path.name:28s} {path.stat().st_size / 1024:7.1f} KiB  "
            f"params={param_count(built.proto):>13,d}  [{built.exporter}]  "
            f"ort-vs-torch max|err|: {err_txt}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

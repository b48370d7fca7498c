"""Export a zoo of small real-architecture ONNX models, for testing autoshard on unseen models.

Run from the repository root::

    python models/make_zoo.py                         # every model -> /tmp/autoshard-zoo
    python models/make_zoo.py --out DIR gpt2 resnet   # only some

Unlike ``make_models.py`` (the committed test models), the zoo is *not* committed: it is built
on demand so that later stages can be tried "as a new user would" on real architectures, with
both torch exporters and symbolic dims.  Each model is exported twice where the exporter allows:

* ``<name>_ts.onnx``: TorchScript exporter (``dynamo=False``), opset 17, ``dynamic_axes`` with
  symbolic dim names (``batch``, ``seq``, ``dec_seq``);
* ``<name>_dynamo.onnx``: dynamo exporter (``dynamo=True``), opset 18, ``dynamic_shapes`` with
  ``torch.export.Dim("batch")`` etc., one self-contained file (no external data).

Every model is tiny (2 layers, hidden 64, 4 heads, vocab 512) with seeded random weights; nothing
is downloaded (Hugging Face models are built from configs, never ``from_pretrained``), and
reruns write byte-identical files.  A file is written only after it passes ``onnx.checker`` and
onnxruntime matches torch (max abs error < 1e-4) at (batch, seq) = (2, 16), the traced shape,
(3, 7), which catches dims frozen at trace time, and (1, 2), which catches a MoE graph that needs
every expert to get a token.  T5/BART decoder inputs have their own dim ``dec_seq`` = seq // 2.
A model may list variants (Mixtral: transformers' ``experts_implementation``); they are tried in
order until one passes.  Failures are reported, not hidden: ``KNOWN_FAILURES`` documents the
expected ones and the summary printed at the end flags any other.  ``DIR/zoo.json`` records each
attempt: status, reason, symbolic input dims, op histogram, errors.

Requires (dev only): torch, transformers, onnx, onnxruntime, onnxscript.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from make_models import (  # sibling script: shared export conventions and helpers
    ATOL,
    BATCH,
    CHECK_SHAPES,
    DYNAMO_OPSET,
    SEQ,
    _tiny_gpt2,
    float_feeds,
    jitter_parameters,
    save_atomic,
    selected_names,
    strip_stack_traces,
    token_feeds,
    torch_reference,
    torchscript_export,
)
from torch import nn

DEFAULT_OUT = Path("/tmp/autoshard-zoo")
EXPORTERS = ("ts", "dynamo")
VOCAB, HIDDEN, LAYERS, HEADS, FFN, MAX_POS = 512, 64, 2, 4, 128, 128
# make_models' (2, 16) and (3, 7), plus a tiny batch of 2 tokens each: it catches graphs that
# only work when every MoE expert receives a token, as at trace time (see KNOWN_FAILURES).
ZOO_CHECK_SHAPES = (*CHECK_SHAPES, (1, 2))
SHAPE_KEYS = tuple(f"b{b}s{s}" for b, s in ZOO_CHECK_SHAPES)

# (model, exporter, variant) -> why it fails.  Observed with torch 2.13.0+cpu, transformers
# 5.23.0, onnxscript 0.7.2.  The script still tries these pairs, so a fix upstream shows up as
# "known failure now passes" in the summary; a failure not listed here is flagged "UNEXPECTED".
KNOWN_FAILURES: dict[tuple[str, str, str], str] = {
    ("mixtral", "ts", "experts=grouped_mm"): (
        "transformers' default MoE kernel (grouped_mm) counts tokens per expert with torch.histc: "
        "UnsupportedOperatorError: 'aten::histc' to ONNX opset 17 is not supported"
    ),
    ("mixtral", "ts", "experts=eager"): (
        "exports and matches at (2, 16) and (3, 7), but the trace unrolled the eager MoE's "
        "Python loop over the experts hit at trace time (all 4), splitting NonZero's result into "
        "4 pieces; when fewer experts get a token (batch=1, seq=2) onnxruntime fails in the "
        "experts' Split ('Split size 1 exceeds the remaining size')"
    ),
    ("mixtral", "dynamo", "experts=grouped_mm"): (
        "the grouped_mm fallback is a custom op transformers::grouped_mm_fallback with no ONNX "
        "translation: DispatchError: No ONNX function found"
    ),
    ("mixtral", "dynamo", "experts=eager"): (
        "the eager MoE loops over the experts that got tokens (nonzero() -> data-dependent "
        "length u0); torch.export cannot guard on it: GuardOnDataDependentSymNode Eq(u0, 0)"
    ),
}
# Qwen3-MoE's experts are transformers' same MoE kernels: it fails as Mixtral does.
KNOWN_FAILURES.update(
    {
        ("qwen3_moe", exporter, variant): why
        for (_, exporter, variant), why in KNOWN_FAILURES.items()
    }
)


# --------------------------------------------------------------------------------------------
# what a model builder returns
# --------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One eval-mode torch model ready to export, with its I/O naming and a feed maker.

    ``inputs`` maps each input name, in ``forward`` argument order, to its dynamic axes
    (``{0: "batch", 1: "seq"}``); ``make_feeds(batch, seq)`` returns numpy inputs by name.
    """

    model: nn.Module
    inputs: dict[str, dict[int, str]]
    output: str
    output_axes: dict[int, str]
    make_feeds: Callable[[int, int], dict[str, np.ndarray]]
    variant: str = "-"


@dataclass
class Result:
    """Outcome of one (model, exporter, variant) attempt, as printed and saved in zoo.json."""

    name: str
    exporter: str
    variant: str
    status: str = "ok"  # ok | export failed | check failed
    file: str = ""
    nodes: int = 0
    op_types: int = 0
    size_kib: float = 0.0
    errors: dict[str, float] = field(default_factory=dict)  # "b2s16" -> max abs error
    dims: list[str] = field(default_factory=list)  # symbolic dim names of the graph inputs
    ops: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    reason: str = ""


# --------------------------------------------------------------------------------------------
# small wrappers: return only the main output tensor, no KV cache
# --------------------------------------------------------------------------------------------


class CausalLMLogits(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


class Seq2SeqLogits(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, decoder_input_ids):
        # An all-ones decoder mask, as in make_models' GPT-2: keeps transformers off its
        # packed-sequence detection (aten::diff, which TorchScript cannot export).
        out = self.lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=torch.ones_like(decoder_input_ids),
            use_cache=False,
        )
        return out.logits


class EncoderHidden(nn.Module):
    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids, attention_mask):
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class ImageHidden(nn.Module):
    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, pixel_values):
        return self.encoder(pixel_values=pixel_values).last_hidden_state


def _hf_model(model_cls, config, **kwargs) -> nn.Module:
    """``model_cls(config)`` in eval mode: eager attention (explicit MatMul/Softmax/MatMul),
    seeded weights plus seeded noise (see make_models.jitter_parameters)."""
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(config, **kwargs)
    jitter_parameters(model)
    return model.eval()


TOKENS = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
LOGITS_AXES = {0: "batch", 1: "seq"}
IMAGE = {"image": {0: "batch"}}


def seq2seq_feeds(vocab: int) -> Callable[[int, int], dict[str, np.ndarray]]:
    """Encoder ids + padding mask [batch, seq], decoder ids [batch, seq // 2] (its own dim)."""
    encoder_feeds = token_feeds(vocab, with_mask=True)

    def make(batch: int, seq: int) -> dict[str, np.ndarray]:
        feeds = encoder_feeds(batch, seq)
        rng = np.random.default_rng(1)
        dec = rng.integers(0, vocab, size=(batch, max(seq // 2, 2)), dtype=np.int64)
        return {**feeds, "decoder_input_ids": dec}

    return make


# --------------------------------------------------------------------------------------------
# Hugging Face models (tiny configs, random weights)
# --------------------------------------------------------------------------------------------


def build_gpt2(variant: str | None) -> Case:
    """GPT2LMHeadModel: the same tiny model and weights as make_models' gpt2.onnx."""
    model, config = _tiny_gpt2()
    return Case(
        model,
        {"input_ids": TOKENS["input_ids"]},
        "logits",
        LOGITS_AXES,
        token_feeds(config.vocab_size),
    )


def build_bert(variant: str | None) -> Case:
    """BertModel (no pooler) -> last_hidden_state; learned absolute positions, GELU (erf)."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=MAX_POS,
    )
    bert = _hf_model(BertModel, config, add_pooling_layer=False)
    return Case(
        EncoderHidden(bert).eval(),
        TOKENS,
        "last_hidden_state",
        LOGITS_AXES,
        token_feeds(VOCAB, with_mask=True),
    )


def build_llama(variant: str | None) -> Case:
    """LlamaForCausalLM: rotary embeddings, RMSNorm, SwiGLU, GQA (4 query / 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        use_cache=False,
    )
    lm = _hf_model(LlamaForCausalLM, config)
    return Case(
        CausalLMLogits(lm).eval(), TOKENS, "logits", LOGITS_AXES, token_feeds(VOCAB, with_mask=True)
    )


def build_mixtral(variant: str | None) -> Case:
    """MixtralForCausalLM: Llama-style attention (GQA) + sparse MoE, 4 experts, top-2 routing.

    ``variant`` is transformers' ``experts_implementation`` (None = its default, grouped_mm);
    the exporters need different ones, see KNOWN_FAILURES.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=MAX_POS,
        use_cache=False,
    )
    config._experts_implementation = variant  # None: transformers picks (grouped_mm)
    lm = _hf_model(MixtralForCausalLM, config)
    return Case(
        CausalLMLogits(lm).eval(),
        TOKENS,
        "logits",
        LOGITS_AXES,
        token_feeds(VOCAB, with_mask=True),
        variant=f"experts={config._experts_implementation}",
    )


def build_qwen3_moe(variant: str | None) -> Case:
    """Qwen3MoeForCausalLM: GQA with per-head q/k RMSNorm, a sparse MoE in every layer (4
    experts, top-2 routing, no shared expert). ``variant`` as Mixtral's."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
        head_dim=HIDDEN // HEADS, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=MAX_POS, use_cache=False,
    )  # fmt: skip
    config._experts_implementation = variant
    lm = _hf_model(Qwen3MoeForCausalLM, config)
    return Case(
        CausalLMLogits(lm).eval(), TOKENS, "logits", LOGITS_AXES,
        token_feeds(VOCAB, with_mask=True), variant=f"experts={config._experts_implementation}",
    )  # fmt: skip


def build_t5(variant: str | None) -> Case:
    """T5ForConditionalGeneration: encoder + decoder, relative position bias, tied LM head."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=HIDDEN // HEADS,
        d_ff=FFN,
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        num_heads=HEADS,
        pad_token_id=0,
        eos_token_id=1,
        use_cache=False,
    )
    return _seq2seq_case(_hf_model(T5ForConditionalGeneration, config))


def build_bart(variant: str | None) -> Case:
    """BartForConditionalGeneration: encoder + decoder, learned positions, LayerNorm, GELU."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
        max_position_embeddings=MAX_POS,
        use_cache=False,
    )
    return _seq2seq_case(_hf_model(BartForConditionalGeneration, config))


def _seq2seq_case(lm: torch.nn.Module) -> Case:
    """An encoder-decoder LM: encoder tokens (batch, seq), decoder tokens (batch, dec_seq)."""
    inputs = {**TOKENS, "decoder_input_ids": {0: "batch", 1: "dec_seq"}}
    return Case(
        Seq2SeqLogits(lm).eval(), inputs, "logits", {0: "batch", 1: "dec_seq"}, seq2seq_feeds(VOCAB)
    )


def build_vit(variant: str | None) -> Case:
    """ViTModel (no pooler): 3x32x32 images, 8x8 patches (Conv) -> 16 patches + CLS token."""
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
    )
    vit = _hf_model(ViTModel, config, add_pooling_layer=False)
    return Case(
        ImageHidden(vit).eval(),
        {"pixel_values": {0: "batch"}},
        "last_hidden_state",
        {0: "batch"},
        float_feeds("pixel_values", 3, 32, 32),
    )


def build_convnext(variant: str | None) -> Case:
    """ConvNextModel (no pooler): 3x32x32 images, two stages (16, 32 channels) of one block
    each: depthwise 7x7 Conv, LayerNorm over channels (a Transpose each way), inverted MLP."""
    from transformers import ConvNextConfig, ConvNextModel

    config = ConvNextConfig(
        num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], image_size=32
    )
    torch.manual_seed(0)
    convnext = ConvNextModel(config)
    jitter_parameters(convnext)
    return Case(
        ImageHidden(convnext.eval()).eval(),
        {"pixel_values": {0: "batch"}},
        "last_hidden_state",
        {0: "batch"},
        float_feeds("pixel_values", 3, 32, 32),
    )


def _causal_lm(kind: str, **config) -> Callable[[str | None], Case]:
    """The builder of transformers' `{kind}ForCausalLM` of a tiny `{kind}Config` (vocab 512,
    2 layers, no cache, `config` the rest): its logits from token ids and a padding mask."""

    def build(variant: str | None) -> Case:
        import transformers

        made = getattr(transformers, f"{kind}Config")(
            vocab_size=VOCAB, num_hidden_layers=LAYERS, use_cache=False, **config
        )
        lm = _hf_model(getattr(transformers, f"{kind}ForCausalLM"), made)
        return Case(
            CausalLMLogits(lm).eval(), TOKENS, "logits", LOGITS_AXES,
            token_feeds(VOCAB, with_mask=True),
        )  # fmt: skip

    return build


# Decoder-only LMs that differ from Llama: q/k/v biases (Qwen2); fused q/k/v and gate/up
# projections, sliced apart in the graph (Phi-3); parallel attention and MLP residual, rotary
# on half the head (GPT-NeoX); learned positions offset by 2, ReLU MLP (OPT); ALiBi biases,
# no position embeddings (BLOOM).
LLAMA_LIKE = {"hidden_size": HIDDEN, "intermediate_size": FFN, "num_attention_heads": HEADS}
build_qwen2 = _causal_lm(
    "Qwen2", **LLAMA_LIKE, num_key_value_heads=2, max_position_embeddings=MAX_POS
)
build_phi3 = _causal_lm(
    "Phi3", **LLAMA_LIKE, num_key_value_heads=HEADS, max_position_embeddings=MAX_POS,
    pad_token_id=0,
)  # fmt: skip
build_neox = _causal_lm("GPTNeoX", **LLAMA_LIKE, max_position_embeddings=MAX_POS, rotary_pct=0.5)
build_opt = _causal_lm(
    "OPT", hidden_size=HIDDEN, ffn_dim=FFN, num_attention_heads=HEADS,
    max_position_embeddings=MAX_POS, word_embed_proj_dim=HIDDEN,
)  # fmt: skip
build_bloom = _causal_lm("Bloom", hidden_size=HIDDEN, n_head=HEADS)
# Multi-query attention (one key/value head) beside a parallel MLP (Falcon); rotary on part of
# the head, interleaved, and a parallel residual (GPT-J); embeddings scaled by sqrt(hidden),
# GeGLU, RMSNorm of (1 + weight) (Gemma); a sliding-window causal mask narrower than the
# sequence (Mistral).
build_falcon = _causal_lm(
    "Falcon", hidden_size=HIDDEN, num_attention_heads=HEADS, multi_query=True,
    parallel_attn=True, new_decoder_architecture=False, alibi=False,
)  # fmt: skip
build_gptj = _causal_lm(
    "GPTJ", n_embd=HIDDEN, n_head=HEADS, n_inner=FFN, rotary_dim=8, n_positions=MAX_POS,
    bos_token_id=0, eos_token_id=0,
)  # fmt: skip
build_gemma = _causal_lm(
    "Gemma", **LLAMA_LIKE, num_key_value_heads=1, head_dim=HIDDEN // HEADS,
    max_position_embeddings=MAX_POS,
)  # fmt: skip
build_mistral = _causal_lm(
    "Mistral", **LLAMA_LIKE, num_key_value_heads=2, max_position_embeddings=MAX_POS,
    sliding_window=8,
)  # fmt: skip


def build_distilbert(variant: str | None) -> Case:
    """DistilBertModel -> last_hidden_state: BERT without token types or pooler, 2 layers."""
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(
        vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN,
        max_position_embeddings=MAX_POS,
    )  # fmt: skip
    distilbert = _hf_model(DistilBertModel, config)
    return Case(
        EncoderHidden(distilbert).eval(),
        TOKENS,
        "last_hidden_state",
        LOGITS_AXES,
        token_feeds(VOCAB, with_mask=True),
    )


# --------------------------------------------------------------------------------------------
# hand-written CNNs (no torchvision): a few blocks each, [batch, 3, 32, 32] -> 10 logits
# --------------------------------------------------------------------------------------------


def _cnn_case(model) -> Case:
    """Seeded noise on all parameters and non-trivial BatchNorm running stats, then eval."""
    jitter_parameters(model)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean = torch.randn(m.num_features) * 0.1
                m.running_var = torch.rand(m.num_features) + 0.5
    return Case(model.eval(), IMAGE, "logits", {0: "batch"}, float_feeds("image", 3, 32, 32))


def build_resnet(variant: str | None) -> Case:
    """Conv-BN-ReLU stem, 2 basic residual blocks (the second strided, 1x1 projection
    shortcut), global average pool, fc."""

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.shortcut: nn.Module = nn.Identity()
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return torch.relu(out + self.shortcut(x))

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        BasicBlock(16, 16, 1),
        BasicBlock(16, 32, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    return _cnn_case(model)


def build_mobilenet(variant: str | None) -> Case:
    """MobileNetV2's inverted residuals: a 1x1 expansion, a depthwise 3x3 (the second block
    strided, no residual), ReLU6, a linear 1x1 projection; global average pool, fc."""

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int = 4) -> None:
            super().__init__()
            wide = cin * expand
            self.body = nn.Sequential(
                nn.Conv2d(cin, wide, 1, bias=False), nn.BatchNorm2d(wide), nn.ReLU6(),
                nn.Conv2d(wide, wide, 3, stride, 1, groups=wide, bias=False),
                nn.BatchNorm2d(wide), nn.ReLU6(),
                nn.Conv2d(wide, cout, 1, bias=False), nn.BatchNorm2d(cout),
            )  # fmt: skip
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            out = self.body(x)
            return x + out if self.residual else out

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
        InvertedResidual(16, 16, 1), InvertedResidual(16, 24, 2), InvertedResidual(24, 24, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(24, 10),
    )  # fmt: skip
    return _cnn_case(model)


def build_vgg(variant: str | None) -> Case:
    """Conv-ReLU x2, MaxPool, Conv-ReLU, MaxPool, Flatten, Linear-ReLU-Linear."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    return _cnn_case(model)


def build_densenet(variant: str | None) -> Case:
    """Stem conv, a dense block of 3 BN-ReLU-Conv1x1-BN-ReLU-Conv3x3 layers whose outputs are
    Concat-ed onto the features (growth 8), a transition (BN-ReLU-Conv1x1, AvgPool), classifier."""
    growth = 8

    class DenseLayer(nn.Module):
        def __init__(self, cin: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.BatchNorm2d(cin),
                nn.ReLU(),
                nn.Conv2d(cin, 4 * growth, 1, bias=False),
                nn.BatchNorm2d(4 * growth),
                nn.ReLU(),
                nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False),
            )

        def forward(self, x):
            return torch.cat([x, self.body(x)], dim=1)

    torch.manual_seed(0)
    c0 = 16
    c1 = c0 + 3 * growth
    model = nn.Sequential(
        nn.Conv2d(3, c0, 3, padding=1, bias=False),
        DenseLayer(c0),
        DenseLayer(c0 + growth),
        DenseLayer(c0 + 2 * growth),
        nn.BatchNorm2d(c1),
        nn.ReLU(),
        nn.Conv2d(c1, c1 // 2, 1, bias=False),
        nn.AvgPool2d(2),
        nn.BatchNorm2d(c1 // 2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(c1 // 2, 10),
    )
    return _cnn_case(model)


# name -> (builder, variants to try in order until one exports).  None = the library default.
MODELS: dict[str, tuple[Callable[[str | None], Case], tuple[str | None, ...]]] = {
    "gpt2": (build_gpt2, (None,)),
    "bert": (build_bert, (None,)),
    "llama": (build_llama, (None,)),
    "t5": (build_t5, (None,)),
    "bart": (build_bart, (None,)),
    "vit": (build_vit, (None,)),
    "mixtral": (build_mixtral, (None, "eager", "batched_mm")),  # see KNOWN_FAILURES
    "qwen3_moe": (build_qwen3_moe, (None, "eager", "batched_mm")),  # as Mixtral
    "resnet": (build_resnet, (None,)),
    "vgg": (build_vgg, (None,)),
    "densenet": (build_densenet, (None,)),
    "qwen2": (build_qwen2, (None,)),
    "phi3": (build_phi3, (None,)),
    "neox": (build_neox, (None,)),
    "opt": (build_opt, (None,)),
    "bloom": (build_bloom, (None,)),
    "distilbert": (build_distilbert, (None,)),
    "convnext": (build_convnext, (None,)),
    "falcon": (build_falcon, (None,)),
    "gptj": (build_gptj, (None,)),
    "gemma": (build_gemma, (None,)),
    "mistral": (build_mistral, (None,)),
    "mobilenet": (build_mobilenet, (None,)),
}


# --------------------------------------------------------------------------------------------
# export, check, report
# --------------------------------------------------------------------------------------------


def example_args(case: Case) -> tuple:
    """Torch tensors at the traced shape (BATCH, SEQ), in forward order."""
    feeds = case.make_feeds(BATCH, SEQ)
    return tuple(torch.from_numpy(feeds[name]) for name in case.inputs)


def export_ts(case: Case) -> onnx.ModelProto:
    axes = {**case.inputs, case.output: case.output_axes}
    return torchscript_export(
        case.model, example_args(case), list(case.inputs), [case.output], axes
    )


def export_dynamo(case: Case) -> onnx.ModelProto:
    from torch.export import Dim

    dims: dict[str, Dim] = {}  # one Dim object per name, shared by all inputs that use it

    def dim(name: str) -> Dim:
        if name not in dims:
            dims[name] = Dim(name, min=1, max=1024) if name == "batch" else Dim(name, max=MAX_POS)
        return dims[name]

    # torch logs a warning per torchvision op it cannot register; torchvision is not needed here.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    shapes = tuple({axis: dim(n) for axis, n in axes.items()} for axes in case.inputs.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            case.model,
            example_args(case),
            dynamo=True,
            opset_version=DYNAMO_OPSET,
            input_names=list(case.inputs),
            output_names=[case.output],
            dynamic_shapes=shapes,
            optimize=True,
            verbose=False,
        )
    assert program is not None  # None only when writing to a file
    proto = program.model_proto
    strip_stack_traces(proto)
    external = [
        t.name for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
    ]
    if external:
        raise AssertionError(f"dynamo export left external data: {external[:3]}")
    return proto


def describe_error(exc: BaseException) -> str:
    """A one-line reason: the innermost chained exception's type and its first message line,
    prefixed by the outer exception type when that differs."""
    root = exc
    while (inner := root.__cause__ or root.__context__) is not None:
        root = inner
    lines = [ln.strip() for ln in str(root).splitlines() if ln.strip()]
    text = f"{type(root).__name__}: {lines[0] if lines else ''}"
    if root is not exc:
        text = f"{type(exc).__name__} <- {text}"
    return text[:300]


def input_dims(proto: onnx.ModelProto) -> list[str]:
    """Symbolic dim names (dim_param) of the graph inputs, in first-seen order."""
    names: list[str] = []
    for value in proto.graph.input:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param and d.dim_param not in names:
                names.append(d.dim_param)
    return names


def check(case: Case, proto: onnx.ModelProto, result: Result) -> None:
    """onnx.checker, then onnxruntime vs torch at each ZOO_CHECK_SHAPES; fills ``result.errors``.

    Raises AssertionError naming the shape and the error when a check fails.
    """
    import onnxruntime as ort

    onnx.checker.check_model(proto, full_check=True)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    reference = torch_reference(case.model, list(case.inputs))
    for batch, seq in ZOO_CHECK_SHAPES:
        feeds = case.make_feeds(batch, seq)
        try:
            (got,) = sess.run(None, feeds)
        except Exception as exc:
            raise AssertionError(f"onnxruntime fails at batch={batch} seq={seq}: {exc}") from exc
        (want,) = reference(feeds)
        if got.shape != want.shape:
            raise AssertionError(
                f"batch={batch} seq={seq}: onnx output {got.shape} vs torch {want.shape}"
            )
        err = float(np.max(np.abs(got - want)))
        result.errors[f"b{batch}s{seq}"] = err
        if not err < ATOL:  # also catches NaN
            raise AssertionError(f"batch={batch} seq={seq}: max abs error {err:.3g} >= {ATOL}")


def build_one(name: str, exporter: str, out: Path, verbose: bool = False) -> list[Result]:
    """Try the model's variants in order with one exporter; stop at the first that passes.

    Returns every attempt (failed ones first).  Only a file that passes ``check`` is written.
    """
    builder, variants = MODELS[name]
    results = []
    for variant in variants:
        start = time.perf_counter()
        result = Result(name, exporter, variant or "-")
        try:
            case = builder(variant)
            result.variant = case.variant
            proto = export_ts(case) if exporter == "ts" else export_dynamo(case)
        except Exception as exc:
            result.status, result.reason = "export failed", describe_error(exc)
            result.seconds = time.perf_counter() - start
            results.append(result)
            if verbose:
                traceback.print_exc()
            continue
        ops = collections.Counter(n.op_type for n in proto.graph.node)
        result.nodes, result.op_types = len(proto.graph.node), len(ops)
        result.ops, result.dims = dict(ops.most_common()), input_dims(proto)
        try:
            check(case, proto, result)
        except Exception as exc:
            result.status, result.reason = "check failed", describe_error(exc)
        else:
            path = out / f"{name}_{exporter}.onnx"
            save_atomic(proto, path)
            result.file, result.size_kib = path.name, path.stat().st_size / 1024
        result.seconds = time.perf_counter() - start
        results.append(result)
        if result.status == "ok":
            break
    else:  # no variant passed: do not leave a file from an earlier run behind
        (out / f"{name}_{exporter}.onnx").unlink(missing_ok=True)
    return results


def print_summary(results: list[Result], total_seconds: float) -> int:
    """Print the table and the failures; return the number of unexpected failures."""
    errs = [f"err {k}" for k in SHAPE_KEYS]
    header = ("name", "exporter", "variant", "status", "nodes", "op types", "KiB", *errs)
    header += ("sec", "input dims")
    rows = []
    for r in results:
        errs = [f"{r.errors[k]:.1e}" if k in r.errors else "-" for k in SHAPE_KEYS]
        rows.append(
            (
                r.name,
                r.exporter,
                r.variant,
                r.status,
                str(r.nodes or "-"),
                str(r.op_types or "-"),
                f"{r.size_kib:.1f}" if r.file else "-",
                *errs,
                f"{r.seconds:.1f}",
                ",".join(r.dims),
            )
        )
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    line = " | ".join
    print("\n" + line(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(line(c.ljust(w) for c, w in zip(row, widths, strict=True)))

    unexpected = 0
    failed = [r for r in results if r.status != "ok"]
    if failed:
        print("\nFailures:")
    for r in failed:
        known = KNOWN_FAILURES.get((r.name, r.exporter, r.variant))
        unexpected += known is None
        tag = "known" if known else "UNEXPECTED"
        print(f"  {r.name}/{r.exporter} [{r.variant}] {r.status} ({tag}): {r.reason}")
        if known:
            print(f"      why: {known}")
    for key in KNOWN_FAILURES:
        if any((r.name, r.exporter, r.variant) == key and r.status == "ok" for r in results):
            print(f"  known failure now passes: {key}")
    missing = {(r.name, r.exporter) for r in results} - {
        (r.name, r.exporter) for r in results if r.status == "ok"
    }
    ok = sum(r.status == "ok" for r in results)
    print(
        f"\n{ok} files written; pairs with no file: {sorted(missing) or 'none'}; "
        f"{unexpected} unexpected failure(s); total {total_seconds:.0f} s"
    )
    return unexpected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"models to export (default: all): {', '.join(MODELS)}",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    parser.add_argument(
        "--exporter",
        choices=EXPORTERS,
        action="append",
        help="only this exporter (repeatable; default both)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print export tracebacks")
    args = parser.parse_args(argv)
    names = selected_names(parser, args.names, MODELS)
    args.out.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    results: list[Result] = []
    for name in names:
        for exporter in args.exporter or EXPORTERS:
            for r in build_one(name, exporter, args.out, args.verbose):
                results.append(r)
                print(
                    f"{name}_{exporter} [{r.variant}]: {r.status} in {r.seconds:.1f} s"
                    + (f" - {r.reason}" if r.reason else ""),
                    flush=True,
                )
    total = time.perf_counter() - start

    manifest = args.out / "zoo.json"
    old = json.loads(manifest.read_text()) if manifest.exists() else {}
    redone = {(r.name, r.exporter) for r in results}
    old_results = [r for r in old.get("results", []) if (r["name"], r["exporter"]) not in redone]
    manifest.write_text(
        json.dumps({"results": old_results + [asdict(r) for r in results]}, indent=1) + "\n"
    )
    return 1 if print_summary(results, total) else 0


if __name__ == "__main__":
    sys.exit(main())

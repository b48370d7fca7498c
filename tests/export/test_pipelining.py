"""A pipelined plan's DTensor export run by `torch.distributed.pipelining`: a tiny Hugging
Face Llama of 4 layers (seeded, nothing downloaded; TorchScript's ONNX export) planned for
training over `pp=2,dp=1` with 2 micro-batches (a stage's plan is searched on the model cut
to 2 layers), exported, and its `build_stages` / `build_schedule` run on 2 gloo ranks: the
last stage's output of a global batch of 2 micro-batches must be the single-process logits
(rel <= 1e-5). The JAX export carries the same split."""

from __future__ import annotations

import copy
import functools
import io
import json
import warnings
from pathlib import Path

import pytest

from autoshard.cli.main import main
from tests.export.gloo import load_module, run_on_ranks

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.pipelining")
transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS, BATCH, SEQ, MICRO = 128, 64, 4, 2, 16, 2


class Logits(torch.nn.Module):
    """The LM's logits alone (no KV cache; an all-ones mask, as test_hf_models exports)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        mask = torch.ones_like(ids)
        return self.lm(input_ids=ids, attention_mask=mask, use_cache=False).logits


@functools.cache
def pristine() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return Logits(transformers.LlamaForCausalLM(config)).eval()


def tokens(count: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count, SEQ), generator=torch.Generator().manual_seed(0))


def _worker(rank: int, module_path: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    exported = load_module(module_path, f"pp_plan_{rank}")
    mesh = init_device_mesh(
        "cpu", exported.PIPELINE_MESH_SHAPE, mesh_dim_names=exported.PIPELINE_MESH_DIM_NAMES
    )
    batch = tokens(BATCH * MICRO)
    stages = exported.build_stages(copy.deepcopy(pristine()), mesh, (batch[:BATCH],))
    schedule = exported.build_schedule(stages)
    with torch.no_grad():
        result = schedule.step(batch) if rank == 0 else schedule.step()
    if rank == exported.PIPELINE_MESH_SHAPE[0] - 1:
        torch.save(result, out)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pipelining")
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(pristine(), (tokens(BATCH),), buffer, dynamo=False, opset_version=17,
                          input_names=["input_ids"], output_names=["logits"])  # fmt: skip
    (folder / "llama.onnx").write_bytes(buffer.getvalue())
    plan = folder / "plan.json"
    argv = ["plan", str(folder / "llama.onnx"), "--mesh", "pp=2,dp=1", "--mode", "training",
            "--micro-batches", str(MICRO), "--schedule", "1f1b", "-q", "-o", str(plan)]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(plan.read_text())["pipeline"]["stage_model_layers"] == 2
    for target, name in (("dtensor", "plan.py"), ("jax", "plan.jax.json")):
        argv = ["export", str(plan), "--to", target, "-o", str(folder / name)]
        assert main(argv) == 0
    return folder


def test_the_stage_split_runs_on_torch_pipelining(exported):
    module = load_module(exported / "plan.py", "pp_plan")
    assert module.SPLIT_POINTS == ("lm.model.layers.2",)
    assert (module.SCHEDULE, module.MICRO_BATCHES) == ("Schedule1F1B", MICRO)
    assert module.PIPELINE_MESH_DIM_NAMES == ("pp", "dp")
    out = exported / "logits.pt"
    run_on_ranks(_worker, 2, str(exported / "plan.py"), str(out))
    with torch.no_grad():
        expected = pristine()(tokens(BATCH * MICRO))
    got = torch.load(out)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_the_jax_export_places_layers_on_stages(exported):
    layout = json.loads((exported / "plan.jax.json").read_text())
    block = layout["pipeline"]
    assert block["axis"] == "pp" and block["mesh"] == {"shape": [2, 1], "axis_names": ["pp", "dp"]}
    assert block["stage_of_layer"] == [0, 0, 1, 1]
    assert block["layer_modules"] == [f"lm.model.layers.{g}" for g in range(LAYERS)]
    params = layout["parameters"]
    assert params["lm.model.layers.3.mlp.up_proj.weight"]["stages"] == [1]
    assert params["lm.model.embed_tokens.weight"]["stages"] == [0]
    assert params["lm.lm_head.weight"]["stages"] == [1]

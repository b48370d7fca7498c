"""A pipelined plan's DTensor export run by `torch.distributed.pipelining`: models of 4
repeated layers (seeded, nothing downloaded; TorchScript's ONNX export) planned for training
with 2 micro-batches (a stage's plan is searched on the model cut to 2 layers), exported, and
the module's `build_stages` / `build_schedule` run on gloo ranks: the last stage's output of a
global batch of 2 micro-batches must be the single-process output (rel <= 1e-5). A tiny
Hugging Face Llama, 1F1B over `pp=2,dp=1` (2 ranks), and GPipe over `pp=2,tp=2` (4 ranks) with
two weights pinned split over tp, which the export unrolls from the stage's model to the whole
(layers 1 and 2 held as layer 0, layer 3 as layer 1: `export.unroll`) and each stage holds as
DTensors; a residual MLP, interleaved 1F1B of 2 chunks per stage (torch's multi-stage
schedules take no value sent past the next stage, and Llama's first stage sends its rotary
tables to every stage). The JAX export carries the same split."""

from __future__ import annotations

import copy
import functools
import io
import json
import warnings
from pathlib import Path

import pytest

from autoshard.cli.main import main
from autoshard.ir.onnx_import import file_weights, load_model
from autoshard.names import recover_names
from tests.export.gloo import load_module, run_on_ranks

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("torch.distributed.pipelining")
transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS, BATCH, SEQ, MICRO = 128, 64, 4, 2, 16, 2
SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe",
             "interleaved:2": "ScheduleInterleaved1F1B",
             "zb-h1": "ScheduleInterleavedZeroBubble"}  # fmt: skip


class Logits(torch.nn.Module):
    """The LM's logits alone (no KV cache; an all-ones mask, as test_hf_models exports)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        mask = torch.ones_like(ids)
        return self.lm(input_ids=ids, attention_mask=mask, use_cache=False).logits


class MLP(torch.nn.Module):
    """An input projection, 4 repeated residual layers (GELU, then Linear) and a head: a
    model whose stages hand on one tensor, as torch's multi-stage (interleaved) schedules
    need."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(HIDDEN, HIDDEN)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS))
        self.head = torch.nn.Linear(HIDDEN, 8)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = x + layer(torch.nn.functional.gelu(x))
        return self.head(x)


@functools.cache
def pristine(model: str) -> torch.nn.Module:
    if model == "mlp":
        torch.manual_seed(0)
        return MLP().eval()
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # no two parameters equal: the exporter merges none
        for param in lm.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return Logits(lm).eval()


def inputs(model: str, count: int) -> torch.Tensor:
    """A batch of `count`: token ids (Llama) or features (the MLP)."""
    generator = torch.Generator().manual_seed(0)
    if model == "mlp":
        return torch.randn(count, HIDDEN, generator=generator)
    return torch.randint(0, VOCAB, (count, SEQ), generator=generator)


LAYER = {"llama": "lm.model.layers", "mlp": "layers"}  # the layers' ModuleList


# name -> (model, mesh, schedule, ranks, pinned: parameter -> its ONNX weight's split)
CASES = {
    "llama-pp2": ("llama", "pp=2,dp=1", "1f1b", 2, {}),
    "llama-pp2-tp2": ("llama", "pp=2,tp=2", "gpipe", 4, {
        "lm.model.layers.0.mlp.up_proj.weight": "[[], [1]]",
        "lm.model.layers.1.mlp.down_proj.weight": "[[1], []]"}),
    "mlp-pp2-interleaved": ("mlp", "pp=2,dp=1", "interleaved:2", 2, {}),
    "mlp-pp2-zb-h1": ("mlp", "pp=2,dp=1", "zb-h1", 2, {}),
}  # fmt: skip


def _worker(rank: int, model: str, module_path: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    exported = load_module(module_path, f"pp_plan_{rank}")
    mesh = init_device_mesh(
        "cpu", exported.PIPELINE_MESH_SHAPE, mesh_dim_names=exported.PIPELINE_MESH_DIM_NAMES
    )
    batch = inputs(model, BATCH * MICRO)
    stages = exported.build_stages(copy.deepcopy(pristine(model)), mesh, (batch[:BATCH],))
    schedule = exported.build_schedule(stages)
    stage = mesh[exported.PP_DIM].get_local_rank()  # every device of the first stage reads
    with torch.no_grad():
        result = schedule.step(batch) if stage == 0 else schedule.step()
    if rank == dist.get_world_size() - 1:
        torch.save(result, out)


def _pinned(model: Path, pinned: dict[str, str]) -> list[str]:
    """`--annotate` flags pinning each parameter's ONNX weight (its name recovered)."""
    proto = load_model(model)
    holding = {p.name: w for w, e in recover_names(proto, file_weights(proto, model)).items()
               for p in e.params}  # fmt: skip
    return [
        f for param, split in pinned.items() for f in ("--annotate", f"{holding[param]}={split}")
    ]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pipelining")
    for model in LAYER:
        buffer = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(pristine(model), (inputs(model, BATCH),), buffer, dynamo=False,
                              opset_version=17, input_names=["x"], output_names=["y"])  # fmt: skip
        (folder / f"{model}.onnx").write_bytes(buffer.getvalue())
    return folder


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, models) -> tuple[str, Path]:
    model, mesh, schedule, _, pinned = CASES[request.param]
    onnx_model = models / f"{model}.onnx"
    folder = models / request.param
    folder.mkdir()
    plan = folder / "plan.json"
    argv = ["plan", str(onnx_model), "--mesh", mesh, "--mode", "training", "--micro-batches",
            str(MICRO), "--schedule", schedule, *_pinned(onnx_model, pinned), "-q", "-o",
            str(plan)]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(plan.read_text())["pipeline"]["stage_model_layers"] == 2
    for target, name in (("dtensor", "plan.py"), ("jax", "plan.jax.json")):
        argv = ["export", str(plan), "--to", target, "--model", str(onnx_model), "-o",
                str(folder / name)]  # fmt: skip
        assert main(argv) == 0
    return request.param, folder


def test_the_stage_split_runs_on_torch_pipelining(exported):
    case, folder = exported
    model, _, schedule, ranks, pinned = CASES[case]
    module = load_module(folder / "plan.py", "pp_plan")
    points = [1, 2, 3] if "interleaved" in schedule else [2]  # 4 chunks of 1 layer, or 2 of 2
    assert [f"{LAYER[model]}.{g}" for g in points] == list(module.SPLIT_POINTS)
    assert (SCHEDULES[schedule], MICRO) == (module.SCHEDULE, module.MICRO_BATCHES)
    assert (2, ranks // 2) == module.PIPELINE_MESH_SHAPE
    split = {name for name, p in module.PLACEMENTS.items() if p != (module.Replicate(),)}
    if pinned:  # layers 1 and 2 as the stage's layer 0, layer 3 as its layer 1
        up, down = (
            "lm.model.layers.{}.mlp.up_proj.weight",
            "lm.model.layers.{}.mlp.down_proj.weight",
        )
        assert {up.format(g) for g in (0, 1, 2)} | {down.format(3)} <= split
        assert not {up.format(3), down.format(1), down.format(2)} & split
    out = folder / "logits.pt"
    run_on_ranks(_worker, ranks, model, str(folder / "plan.py"), str(out))
    with torch.no_grad():
        expected = pristine(model)(inputs(model, BATCH * MICRO))
    got = torch.load(out)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_the_jax_export_places_layers_on_stages(exported):
    case, folder = exported
    model, _, schedule, ranks, _ = CASES[case]
    layout = json.loads((folder / "plan.jax.json").read_text())
    block = layout["pipeline"]
    assert block["axis"] == "pp" and block["mesh"]["shape"] == [2, ranks // 2]
    # interleaved: chunk c (one layer) on stage c % 2
    stages = [0, 1, 0, 1] if "interleaved" in schedule else [0, 0, 1, 1]
    assert block["stage_of_layer"] == stages
    assert block["layer_modules"] == [f"{LAYER[model]}.{g}" for g in range(LAYERS)]
    params = layout["parameters"]
    if model == "mlp":
        assert params["layers.2.weight"]["stages"] == [stages[2]]
        assert params["head.bias"]["stages"] == [1]
        return
    assert params["lm.model.layers.3.mlp.up_proj.weight"]["stages"] == [1]
    assert params["lm.model.embed_tokens.weight"]["stages"] == [0]
    assert params["lm.lm_head.weight"]["stages"] == [1]

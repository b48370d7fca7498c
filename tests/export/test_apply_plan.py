"""The generated `apply_plan` run by torch on a gloo group of 4 ranks (mesh dp=2,tp=2), with the
parallel styles it chose: the MLP of models/mlp.onnx and the two pre-norm blocks of
models/block_dynamo.onnx, each under an inference plan (Megatron's column then row split; the
blocks' norms sequence-parallel) and a training plan storing weights split further over dp
(FSDP2); and the MLP with its second weight held split but read whole (no style: distributed as
held). Every rank's output is the single-process model's, and every parameter's local shard
is the slice the plan holds on that device. All runs share one start of 4 processes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from autoshard.cli.main import main
from autoshard.document.plan_document import read_document
from autoshard.mesh import Mesh
from autoshard.sharding import Sharding
from tests.export.gloo import load_module, run_on_ranks

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
tensor_api = pytest.importorskip("torch.distributed.tensor")
pytest.importorskip("torch.distributed.fsdp")

MODELS = Path(__file__).resolve().parents[2] / "models"
MESH = Mesh.parse("dp=2,tp=2")

_MEGATRON_BLOCK = [
    "x=[[0], [1], []]", "val_2=[[], [1]]", "0.up.bias=[[1]]", "val_4=[[1], []]",
    "val_7=[[], [1]]", "1.up.bias=[[1]]", "val_9=[[1], []]",
]  # fmt: skip
# Training: the up and down weights (and up's bias) held split over dp too, inside tp, and
# read as in inference (FSDP gathers them over dp before use).
_FSDP_BLOCK = [
    "x=[[0], [1], []]", "val_2=[[0], [1]]", "0.up.bias=[[1, 0]]", "val_4=[[1], [0]]",
    "val_7=[[0], [1]]", "1.up.bias=[[1, 0]]", "val_9=[[1], [0]]",
    *(f"{note}@users" for note in _MEGATRON_BLOCK),
]  # fmt: skip
CASES = {
    "mlp-inference": ("mlp.onnx", ["--dim", "batch=8"],
                      ["x=[[0], []]", "0.weight=[[1], []]", "0.bias=[[1]]", "2.weight=[[], [1]]",
                       "2.bias=[[]]"]),
    # Training: the Megatron reads pinned on the activations (the search would run the second
    # Gemm whole on so small a model); a weight's `@users` pin would also pin its Update's read.
    "mlp-training": ("mlp.onnx", ["--dim", "batch=8", "--mode", "training"],
                     ["0.weight=[[1], [0]]", "0.bias=[[1, 0]]", "2.weight=[[], [1]]",
                      "2.bias=[[]]", "/0/Gemm_output_0=[[], [1]]",
                      "/1/Relu_output_0=[[], [1]]@users"]),
    # 2.weight held split on tp but read whole: distributed as held (DTensor gathers it).
    "mlp-gathered": ("mlp.onnx", ["--dim", "batch=8"],
                     ["x=[[0], []]", "0.weight=[[1], []]", "0.bias=[[1]]", "2.weight=[[], [1]]",
                      "2.weight=[[], []]@users", "2.bias=[[]]"]),
    "block-inference": ("block_dynamo.onnx", ["--dim", "batch=4", "--dim", "seq=8"],
                        _MEGATRON_BLOCK),
    "block-training": ("block_dynamo.onnx",
                       ["--dim", "batch=4", "--dim", "seq=8", "--mode", "training"], _FSDP_BLOCK),
}  # fmt: skip
STYLES = {
    "mlp-inference": {"0.weight": "colwise", "0.bias": "colwise", "2.weight": "rowwise",
                      "2.bias": "rowwise"},
    # 2.bias's state split over dp, 2.weight's not: fully_shard cannot, `_hold_as` holds it
    "mlp-training": {"0.weight": "colwise+fsdp", "0.bias": "colwise+fsdp",
                     "2.weight": "rowwise", "2.bias": "rowwise+zero"},
    "mlp-gathered": {"0.weight": "colwise", "0.bias": "colwise", "2.weight": "distribute",
                     "2.bias": "distribute"},
    "block-inference": {"0.up.weight": "colwise", "0.up.bias": "colwise",
                        "0.down.weight": "rowwise", "0.norm.weight": "sequence",
                        "1.norm.bias": "sequence"},
    # The shared norm's two weight-gradient contributions added as partial sums, then one
    # reduce_scatter to its optimizer state split on tp (`search.partials`): ZeRO's state.
    "block-training": {"0.up.weight": "colwise+fsdp", "0.up.bias": "colwise+fsdp",
                       "1.down.weight": "rowwise+fsdp", "1.norm.weight": "sequence+zero"},
}  # fmt: skip


def _torch_model(name: str, export: dict):
    """The torch module the ONNX model was exported from, with the ONNX model's weights
    (each parameter read from its ONNX weight, transposed back where the export says)."""
    from torch import nn

    if name == "mlp.onnx":
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    else:

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.norm = nn.LayerNorm(32)
                self.up = nn.Linear(32, 64)
                self.down = nn.Linear(64, 32, bias=False)

            def forward(self, x):
                return x + self.down(torch.relu(self.up(self.norm(x))))

        model = nn.Sequential(Block(), Block())
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(MODELS / name).graph.initializer}
    state = {}
    for param, entry in export["parameters"].items():
        array = weights[entry["onnx_weight"]]
        state[param] = torch.from_numpy((array.T if entry["transposed"] else array).copy())
    model.load_state_dict(state)
    return model.eval()


def _input(name: str):
    rng = np.random.default_rng(0)
    shape = (8, 64) if name == "mlp.onnx" else (4, 8, 32)
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))


def _worker(rank: int, folder: str) -> None:
    from torch.distributed.tensor.experimental import implicit_replication

    for case, (model_name, _, _) in CASES.items():
        path = Path(folder) / case
        generated = load_module(path / "apply.py", f"apply_{rank}")
        mesh = torch.distributed.device_mesh.init_device_mesh(
            "cpu", generated.MESH_SHAPE, mesh_dim_names=generated.MESH_DIM_NAMES
        )
        export = json.loads((path / "export.json").read_text())
        reference, model = _torch_model(model_name, export), _torch_model(model_name, export)
        generated.apply_plan(model, mesh)
        x = _input(model_name)
        with torch.no_grad(), implicit_replication():
            y = model(x)
            y = y.full_tensor() if isinstance(y, tensor_api.DTensor) else y
            expected = reference(x)
        local = {}
        for name in generated.PLACEMENTS:
            tensor = generated._lookup(model, name)[2]
            local[name] = (tensor.to_local() if isinstance(tensor, tensor_api.DTensor)
                           else tensor).detach().numpy().copy()  # fmt: skip
        torch.save(
            {"error": float((y - expected).abs().max() / expected.abs().max()),
             "local": local,
             "held": {k: (tuple(v) == tuple(generated.HELD_AS.get(k, generated.PLACEMENTS[k])),
                          repr(v))
                      for k, v in generated.held_placements(model, mesh).items()}},
            path / f"rank{rank}.pt",
        )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Plan and export every case, then run them all on one start of 4 gloo ranks."""
    folder = tmp_path_factory.mktemp("apply")
    for case, (model_name, flags, written) in CASES.items():
        path = folder / case
        path.mkdir()
        shutil.copy(MODELS / model_name, path)
        plan = path / "plan.json"
        notes = []
        for note in written:  # `value=sharding`, as its users read it with `@users`
            text, _, users = note.partition("@")
            value, _, sharding = text.partition("=")
            notes.append({"value": value, "sharding": sharding, "required": True,
                          "for": users or "result"})  # fmt: skip
        (path / "annotations.json").write_text(json.dumps({"annotations": notes}))
        argv = ["plan", str(path / model_name), "--mesh", str(MESH), *flags,
                "--annotations", str(path / "annotations.json"), "-o", str(plan)]  # fmt: skip
        assert main(argv) == 0
        assert main(["export", str(plan), "--to", "dtensor", "-o", str(path / "apply.py")]) == 0
        from autoshard.export import Target, export_plan

        document = export_plan(plan, Target.DTENSOR).document
        (path / "export.json").write_text(json.dumps(document))
    run_on_ranks(_worker, 4, str(folder))
    return folder


@pytest.mark.parametrize("case", list(CASES))
def test_styles_chosen(runs, case):
    export = json.loads((runs / case / "export.json").read_text())
    assert export["parallelize"]["fallback"] is None
    assert export["parallelize"]["tp"] == "tp"
    assert export["parallelize"]["fsdp"] == ("dp" if "training" in case else None)
    got = {name: export["parameters"][name]["style"] for name in STYLES[case]}
    assert got == STYLES[case]


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_shards_are_the_plans(runs, case):
    path = runs / case
    export = json.loads((path / "export.json").read_text())
    document = read_document(path / "plan.json")
    model_name = CASES[case][0]
    full = {
        name: param.detach().numpy()
        for name, param in _torch_model(model_name, export).named_parameters()
    }
    for device in MESH.devices():
        rank = MESH.linear_index(device)
        result = torch.load(path / f"rank{rank}.pt", weights_only=False)
        assert result["error"] <= 1e-5, (case, rank)
        for name, entry in export["parameters"].items():
            held = document.values[entry["onnx_weight"]].sharding
            if "held" in entry:  # `_hold_as`: held as its optimizer state (ZeRO)
                held = document.strategy.weights[entry["onnx_weight"]].state
            shape = full[name].shape
            onnx_shape = shape[::-1] if entry["transposed"] else shape
            region = Sharding.parse(held).slices(MESH, onnx_shape, device)
            region = region[::-1] if entry["transposed"] else region
            expected = full[name][tuple(slice(a, b) for a, b in region)]
            assert np.array_equal(result["local"][name], expected), (case, name, rank)
            same, held_repr = result["held"][name]
            assert same, (case, name, held_repr, entry["placements"])

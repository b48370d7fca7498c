"""The DTensor export, run by torch: placements round-trip (each rank's local shard is the
plan's, the full tensor is the original), and the generated `apply_plan` on a gloo group of 4
ranks gives the single-process output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from autoshard.cli.main import main
from autoshard.export.to_dtensor import placements
from autoshard.mesh import Mesh
from autoshard.sharding import Sharding
from tests.export.gloo import load_module, run_on_ranks

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
tensor_api = pytest.importorskip("torch.distributed.tensor")
placement_types = pytest.importorskip("torch.distributed.tensor.placement_types")
fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")

MODELS = Path(__file__).resolve().parents[2] / "models"

CASES = [
    ("2x2", (8, 6), "[[0], [1]]"),
    ("2x2", (8, 6), "[[0, 1]]"),
    ("2x2", (8, 6), "[[1, 0]]"),
    ("2x2", (6, 8), "[[], [1, 0]]"),
    ("2x2x2", (8, 4), "[[2, 0, 1]]"),
    ("2x2x2", (8, 4), "[[1, 2], [0]]"),
    ("2x2x2", (16, 4), "[[2, 1, 0]]"),
    ("2x4", (16, 8), "[[1, 0]]"),
    ("2x4", (8, 16), "[[], [1, 0]]"),
]


def _python(placement):  # our Placement -> the torch object its text builds
    names = {
        "Shard": tensor_api.Shard,
        "Replicate": tensor_api.Replicate,
        "Partial": tensor_api.Partial,
        "_StridedShard": placement_types._StridedShard,
    }
    return eval(str(placement), names)  # the text is what the generated module writes


@pytest.mark.parametrize(
    ("mesh_text", "shape", "text"), CASES, ids=[f"{c[2]}@{c[0]}" for c in CASES]
)
def test_placements_round_trip(mesh_text, shape, text):
    mesh = Mesh.parse(mesh_text)
    sharding = Sharding.parse(text).check(mesh, shape)
    full = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    chosen = [_python(p) for p in placements(sharding, mesh)]
    for device in mesh.devices():
        dist.init_process_group(
            "fake", store=fake_pg.FakeStore(), rank=mesh.linear_index(device), world_size=mesh.size
        )
        try:
            device_mesh = torch.distributed.device_mesh.init_device_mesh("cpu", mesh.shape)
            local = tensor_api.distribute_tensor(full, device_mesh, chosen, src_data_rank=None)
            region = sharding.slices(mesh, shape, device)
            expected = full[tuple(slice(a, b) for a, b in region)]
            assert torch.equal(local.to_local(), expected), (device, chosen)
        finally:
            dist.destroy_process_group()


def test_transposed_weight_swaps_the_dim():
    mesh = Mesh.parse("dp=2,tp=2")
    # An ONNX MatMul's B [in, out] split on out over tp is the Linear weight's Shard(0).
    assert [str(p) for p in placements(Sharding.parse("[[], [1]]"), mesh, True)] == [
        "Replicate()",
        "Shard(0)",
    ]
    assert [str(p) for p in placements(Sharding.parse("[[1, 0]]"), mesh)] == [
        "_StridedShard(0, split_factor=2)",
        "Shard(0)",
    ]


# ---- apply_plan on gloo: the MLP of models/mlp.onnx, 4 ranks -----------------------------------


def _mlp_from_onnx():
    """models/mlp.onnx's torch module (Linear, ReLU, Linear) with its weights."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    weights = {
        t.name: torch.from_numpy(numpy_helper.to_array(t).copy())
        for t in onnx.load(MODELS / "mlp.onnx").graph.initializer
    }
    model.load_state_dict(weights)
    return model.eval()


def _worker(rank: int, module_path: str, out: str) -> None:
    generated = load_module(module_path, "apply_mlp")
    mesh = torch.distributed.device_mesh.init_device_mesh(
        "cpu", generated.MESH_SHAPE, mesh_dim_names=generated.MESH_DIM_NAMES
    )
    reference, model = _mlp_from_onnx(), _mlp_from_onnx()
    generated.apply_plan(model, mesh)
    held = {n: tuple(p.placements) for n, p in model.named_parameters()}
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((8, 64), dtype=np.float32))
    replicated = [tensor_api.Replicate()] * mesh.ndim
    with torch.no_grad():
        y = model(tensor_api.distribute_tensor(x, mesh, replicated)).full_tensor()
        expected = reference(x)
    error = float((y - expected).abs().max() / expected.abs().max())
    if rank == 0:
        Path(out).write_text(repr({"held": {k: [repr(p) for p in v] for k, v in held.items()},
                                   "planned": {k: [repr(p) for p in v]
                                               for k, v in generated.PLACEMENTS.items()},
                                   "error": error}))  # fmt: skip


def test_apply_plan_on_gloo(tmp_path, capsys):
    plan, module = tmp_path / "plan.json", tmp_path / "apply_mlp.py"
    model = str(MODELS / "mlp.onnx")
    assert main(["plan", model, "--mesh", "dp=2,tp=2", "--dim", "batch=8",
                 "--annotate", "0.weight=[[1, 0], []]", "--annotate", "2.weight=[[], [0, 1]]",
                 "-o", str(plan)]) == 0  # fmt: skip
    assert main(["export", str(plan), "--to", "dtensor", "--model", model, "-o", str(module)]) == 0
    out = tmp_path / "result.txt"
    run_on_ranks(_worker, 4, str(module), str(out))
    result = eval(out.read_text())
    # 0.weight [256, 64] held [[1, 0]]: tp-major rows, so dp's Shard is strided by |tp|.
    assert result["planned"]["0.weight"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
    assert result["planned"]["2.weight"] == ["Shard(dim=1)", "Shard(dim=1)"]
    assert result["held"] == result["planned"]
    assert result["error"] <= 1e-5

"""A pipelined plan partitioned stage by stage and its forward run on gloo, one process per
device of the whole mesh, against onnxruntime on the whole model; the stage cut itself; and
the plans whose stages cannot be mapped, refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from autoshard.analysis.shorten import layer_run
from autoshard.analysis.stage_cut import StageCutError, cut_stages
from autoshard.cli.main import main
from autoshard.ir.graph import verify
from autoshard.pipeline import load_graphs
from tests.unit.onnx_factory import F32, model, rng_weight, save, tensor

from .helpers import model_path

pytest.importorskip("torch")

HIDDEN, LAYERS = 64, 4


def mlp(directory: Path) -> Path:
    """x [batch, 8] -> embed -> 4 x (MatMul, Add, Relu) -> head -> y [batch, 4]."""
    nodes = [helper.make_node("MatMul", ["x", "embed"], ["h0"], name="embed")]
    inits = {"embed": rng_weight((8, HIDDEN), 1), "head": rng_weight((HIDDEN, 4), 2)}
    for i in range(LAYERS):
        inits[f"w{i}"] = rng_weight((HIDDEN, HIDDEN), 10 + i) / 8  # keeps the scale
        inits[f"b{i}"] = rng_weight((HIDDEN,), 20 + i)
        nodes += [
            helper.make_node("MatMul", [f"h{i}", f"w{i}"], [f"m{i}"], name=f"l{i}.mm"),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"l{i}.add"),
            helper.make_node("Relu", [f"a{i}"], [f"h{i + 1}"], name=f"l{i}.relu"),
        ]
    nodes.append(helper.make_node("MatMul", [f"h{LAYERS}", "head"], ["y"], name="head"))
    proto = model(nodes, [tensor("x", F32, ["batch", 8])], [tensor("y", F32, ["batch", 4])],
                  inits)  # fmt: skip
    return save(proto, directory, "mlp4.onnx")


# A slow device (0.1 GFLOP/s) beside fast links: splitting the stage's work pays, so the
# search splits each stage over its 2 devices as it would a large model on a GPU.
SLOW = {
    "device": {
        "name": "slow",
        "flops": {"float32": 1e8},
        "default_flops": 1e8,
        "memory": 10**10,
        "link_bandwidth": 1e11,
        "hbm_bandwidth": 1e10,
    }
}


def _plan(tmp_path: Path, onnx: Path, mesh: str, dims: list[str], *flags: str) -> Path:
    """A pipelined training plan of `onnx` on `mesh`, as the search finds it."""
    plan, cluster = tmp_path / "plan.json", tmp_path / "slow.json"
    cluster.write_text(json.dumps(SLOW))
    argv = ["plan", str(onnx), "--cluster", str(cluster), "--mesh", mesh, "--mode", "training",
            "--micro-batches", "2", *[f"--dim={d}" for d in dims], *flags, "-q", "-o",
            str(plan)]  # fmt: skip
    assert main(argv) == 0
    return plan


def _partition_and_run(tmp_path: Path, onnx: Path, plan: Path, capsys) -> tuple[dict, dict]:
    out = tmp_path / "out"
    assert main(["partition", str(onnx), "--plan", str(plan), "--forward", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["run", str(out), "--check", str(onnx), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["devices"] == 4
    for check in report["outputs"].values():
        assert check["max_rel_err"] <= 1e-5 and check["max_replica_err"] == 0
    return json.loads((out / "manifest.json").read_text()), report


def _collectives(out: Path, stage: int) -> list[str]:
    steps = json.loads((out / f"stage-{stage}" / "steps.json").read_text())
    return [c["kind"] for c in steps["collectives"]]


def test_a_4_layer_mlp_pipelined_over_2_stages_of_2_way_tensor_parallelism(tmp_path, capsys):
    onnx = mlp(tmp_path)
    plan = _plan(tmp_path, onnx, "pp=2,tp=2", ["batch=4"], "--schedule", "1f1b")
    decided = json.loads(plan.read_text())["ops"]
    # The search splits the layers' features over tp: stage 1's layers 2 and 3 run as the
    # stage's model's layers 0 and 1 do.
    assert decided["l1.mm"]["sharding_option"] == "[[], [0]]"
    manifest, report = _partition_and_run(tmp_path, onnx, plan, capsys)
    pipeline = manifest["pipeline"]
    assert [s["layers"] for s in pipeline["stages"]] == [[0, 2], [2, 4]]
    assert [s["devices"] for s in pipeline["stages"]] == [[0, 1], [2, 3]]
    assert pipeline["stages"][0]["sends"] == ["h2"] == pipeline["stages"][1]["receives"]
    assert report["outputs"]["y"]["shape"] == [2, 4, 4]  # 2 micro-batches stacked
    out = tmp_path / "out"
    # Every layer gathers its input's features (stage 0: h0, h1; stage 1: h2, h3), and the
    # head, whose sum runs over the split features, reduces its partial result.
    assert _collectives(out, 0) == ["all_gather", "all_gather"]
    assert _collectives(out, 1) == ["all_gather", "all_gather", "all_reduce"]
    weights = json.loads((out / "stage-1" / "steps.json").read_text())["weights"]
    assert weights == ["b2", "b3", "head", "w2", "w3"]
    # The boundary, layer 1's result, held as the stage's model holds it: its features split,
    # each device sending its half to its place in the next stage.
    boundary = pipeline["boundary"]["h2"]
    assert boundary["sharding"] == "[[], [0]]" and boundary["local_shapes"] == [[4, 32]] * 2
    mlir = (out / "pipeline.mlir").read_text()
    assert "mesh.send %arg0 on @mesh0 mesh_axes = [0] destination = [1] : (tensor<4x32xf32>)" in (
        mlir
    )
    assert "mesh.recv %r0 on @mesh0 mesh_axes = [0] source = [0] : (tensor<4x32xf32>)" in mlir
    # autoshard's MLIR reader takes them back: a send to position 1, a receive from 0.
    from autoshard.mlir.parse import parse_module

    p2p = [op for op in parse_module(mlir).ops if op.name in ("mesh.send", "mesh.recv")]
    assert [(op.name, dict(op.attrs), op.loc) for op in p2p] == [
        ("mesh.send", {"mesh": "mesh0", "mesh_axes": (0,), "destination": (1,)}, ("h2",)),
        ("mesh.recv", {"mesh": "mesh0", "mesh_axes": (0,), "source": (0,)}, ("h2",)),
    ]


def test_a_gpt2_export_pipelined_over_2_stages_of_2_way_tensor_parallelism(tmp_path, capsys):
    gpt2 = model_path("gpt2")
    plan = _plan(tmp_path, gpt2, "pp=2,tp=2", ["batch=2", "seq=16"])
    assert "Weights: 17 split (tensor parallel)" in json.loads(plan.read_text())["story"]
    manifest, _ = _partition_and_run(tmp_path, gpt2, plan, capsys)
    assert [s["layers"] for s in manifest["pipeline"]["stages"]] == [[0, 1], [1, 2]]
    for stage in (0, 1):
        assert "all_to_all" in _collectives(tmp_path / "out", stage)
    # verify shares the run: the same forward, checked against onnxruntime.
    assert main(["verify", str(tmp_path / "out"), "--model", str(gpt2)]) == 0
    assert "a pipelined forward of 2 micro-batches as 4 processes (gloo): ok" in (
        capsys.readouterr().out
    )


def test_the_stages_are_the_whole_models_ops_and_the_values_that_cross(tmp_path):
    graph = load_graphs(mlp(tmp_path), {"batch": 4}, None)[0]
    run = layer_run(graph)
    assert run is not None and run.count == LAYERS
    cuts = cut_stages(graph, run, [range(0, 1), range(1, 3), range(3, 4)])
    for cut in cuts:
        verify(cut.graph)
    assert [[op.name for op in c.graph.ops] for c in cuts] == [
        ["embed", "l0.mm", "l0.add", "l0.relu"],
        ["l1.mm", "l1.add", "l1.relu", "l2.mm", "l2.add", "l2.relu"],
        ["l3.mm", "l3.add", "l3.relu", "head"],
    ]
    assert [(c.receives, c.sends) for c in cuts] == [((), ("h1",)), (("h1",), ("h3",)),
                                                     (("h3",), ())]  # fmt: skip
    assert [c.graph.inputs for c in cuts] == [("x",), ("h1",), ("h3",)]
    assert [c.graph.outputs for c in cuts] == [("h1",), ("h3",), ("y",)]
    with pytest.raises(StageCutError, match="do not cover the model's 4 repeated layers"):
        cut_stages(graph, run, [range(0, 1), range(2, 4)])


def test_a_plan_whose_stages_cannot_be_mapped_is_refused_in_one_line(tmp_path, capsys):
    onnx = mlp(tmp_path)
    plan = _plan(tmp_path, onnx, "pp=2,tp=2", ["batch=4"])
    data = json.loads(plan.read_text())
    data["pipeline"]["stages"][0]["layers"] = [0, 3]
    data["pipeline"]["stages"][1]["layers"] = [3, 4]
    data["pipeline"]["stage_model_layers"] = 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["partition", str(onnx), "--plan", str(bad), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "a stage of 3 layers is deeper than the stage's model it decides (2 layers)" in err
    assert "\n" not in err
    assert main(["partition", str(onnx), "--plan", str(plan), "--forward", "--mesh", "2x2", "-o",
                 str(tmp_path / "o")]) == 2  # fmt: skip
    assert "is a pipeline on mesh pp=2,tp=2, not 2x2: leave out --mesh" in capsys.readouterr().err
    data = json.loads(plan.read_text())
    del data["ops"]["l1.mm"]
    bad.write_text(json.dumps(data))
    assert main(["partition", str(onnx), "--plan", str(bad), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no op 'l1.mm': is it for this model?" in err and "\n" not in err


def test_given_inputs_run_per_micro_batch_and_a_bad_file_stops_every_rank(tmp_path, capsys):
    onnx = mlp(tmp_path)
    plan = _plan(tmp_path, onnx, "pp=2,tp=2", ["batch=4"])
    out = tmp_path / "out"
    assert main(["partition", str(onnx), "--plan", str(plan), "--forward", "-o", str(out)]) == 0
    from autoshard.run.pipelined import run_pipelined

    x = np.arange(2 * 4 * 8, dtype=np.float32).reshape(2, 4, 8) / 64
    report = run_pipelined(out, inputs={"x": x}, check=onnx)
    assert report.ok and report.outputs["y"].shape == (2, 4, 4)
    assert not np.allclose(report.outputs["y"][0], report.outputs["y"][1])
    # Device 2 of the whole mesh is stage 1's first device: its weight file, changed.
    weights = out / "stage-1" / "weights" / "device-0.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    capsys.readouterr()
    assert main(["run", str(out), "--check", str(onnx)]) == 2
    err = capsys.readouterr().err
    assert "rank 2 failed at loading: weight file" in err
    assert "does not match the manifest's sha256 (all 4 ranks stopped)" in err


def test_partitioning_twice_gives_the_same_bytes(tmp_path, capsys):
    onnx = mlp(tmp_path)
    plan = _plan(tmp_path, onnx, "pp=2,tp=2", ["batch=4"])
    folders = [tmp_path / "a", tmp_path / "b"]
    for out in folders:
        assert main(["partition", str(onnx), "--plan", str(plan), "--forward", "-o", str(out)]) == 0
    files = [sorted(p.relative_to(f) for p in f.rglob("*") if p.is_file()) for f in folders]
    assert files[0] == files[1] and len(files[0]) > 10
    for name in files[0]:
        assert (folders[0] / name).read_bytes() == (folders[1] / name).read_bytes(), name


@pytest.mark.parametrize(
    ("whole", "axis", "stages", "stage", "mesh", "devices"),
    [
        ("pp=2,tp=2", 0, 2, 1, "tp=2", (2, 3)),
        ("pp=4,dp=2", 0, 2, 1, "pp=2,dp=2", (4, 5, 6, 7)),  # 2 stages split the axis of 4
        ("pp=4,dp=2", 0, 4, 2, "dp=2", (4, 5)),
        ("dp=2,pp=4", 1, 4, 1, "dp=2", (1, 5)),  # the pipeline axis inner
    ],
)
def test_a_stages_devices_on_the_whole_mesh(whole, axis, stages, stage, mesh, devices):
    from autoshard.execute.stage_plans import stage_devices
    from autoshard.mesh import Mesh

    assert stage_devices(Mesh.parse(whole), axis, stages, stage, Mesh.parse(mesh)) == devices


def test_a_shape_only_decoder_is_partitioned_not_run(tmp_path, capsys):
    import sys

    import onnx as onnx_lib

    sys.path.insert(0, str(model_path("gpt2").parent))
    from make_models import build_decoder_shape_only

    built = build_decoder_shape_only(4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100)
    decoder = tmp_path / "decoder.onnx"
    onnx_lib.save(built.proto, decoder)
    plan = _plan(tmp_path, decoder, "pp=2,tp=2", ["batch=2", "seq=8"], "--schedule", "gpipe")
    out = tmp_path / "out"
    assert main(["partition", str(decoder), "--plan", str(plan), "--forward", "-o", str(out)]) == 0
    for stage in (0, 1):
        assert (out / f"stage-{stage}" / "spmd.mlir").read_text().startswith("module {")
        assert not (out / f"stage-{stage}" / "weights").exists()
    capsys.readouterr()
    assert main(["run", str(out)]) == 2
    assert "is the partition of a shape-only model: nothing to run" in capsys.readouterr().err


def test_an_interleaved_plans_forward_runs_chunk_by_chunk(tmp_path, capsys):
    """`partition --forward` of an interleaved plan (2 virtual stages): the 4 layers in 4
    chunks, chunk c on pipeline position c % 2 as the plan records them; each device runs its
    2 chunks' forwards in Megatron's order (F0 F1 F0.1 F1.1: micro-batches 0 and 1 through
    its first chunk, then through its second), equal to onnxruntime."""
    from autoshard.run.pipelined import forward_passes

    onnx = mlp(tmp_path)
    plan = _plan(tmp_path, onnx, "pp=2,tp=2", ["batch=4"], "--schedule", "interleaved:2")
    assert [c["stage"] for c in json.loads(plan.read_text())["pipeline"]["chunks"]] == [0, 1] * 2
    manifest, report = _partition_and_run(tmp_path, onnx, plan, capsys)
    pipeline = manifest["pipeline"]
    assert pipeline["virtual"] == 2
    chunks = [(s["layers"], s["position"], s["devices"]) for s in pipeline["stages"]]
    assert chunks == [([0, 1], 0, [0, 1]), ([1, 2], 1, [2, 3]), ([2, 3], 0, [0, 1]),
                      ([3, 4], 1, [2, 3])]  # fmt: skip
    assert pipeline["stages"][2]["receives"] == ["h2"]  # from position 1 back to 0
    assert [str(p) for p in forward_passes(pipeline, 0)] == ["F0", "F1", "F0.1", "F1.1"]
    assert report["outputs"]["y"]["shape"] == [2, 4, 4]
    mlir = (tmp_path / "out" / "pipeline.mlir").read_text()
    assert "// chunk 2: layers 2..2 on devices [0, 1]" in mlir

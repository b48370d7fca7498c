"""`autoshard partition` then `autoshard verify`, through the command line: every bundled model
on meshes 2, 2x2 and 2x4 under data parallelism, hand tensor parallelism, Megatron and an
uneven batch; the weight files put back together bit for bit; the same bytes on a second run;
the SPMD IR accepted by upstream MLIR; and verify's failures and errors."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

import numpy as np
import onnx
import pytest

from autoshard.cli.main import main
from autoshard.execute.verify import random_inputs
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.search.baselines import megatron

from .helpers import assert_weights_round_trip, model_path

DIMS = {
    "mlp": {"batch": 4},
    "cnn": {"batch": 4},
    "gpt2": {"batch": 4, "seq": 8},
    "gpt2_dynamo": {"batch": 4, "seq": 8},
    "bert": {"batch": 4, "seq": 8},
}
FIRST_INPUT = {"mlp": "x", "cnn": "image", "gpt2": "input_ids", "gpt2_dynamo": "input_ids",
               "bert": "input_ids"}  # fmt: skip
# Hand tensor parallelism over the mesh's last axis A: a column-split first MLP weight and a
# row-split second one (the mlp and cnn store W as [out, in]: transB).
TENSOR_PARALLEL = {
    "mlp": {"0.weight": "[[A]]", "2.weight": "[[], [A]]"},
    "cnn": {"4.weight": "[[A]]"},
    "gpt2": {"lm.transformer.h.0.mlp.c_fc.weight": "[[], [A]]",
             "lm.transformer.h.0.mlp.c_proj.weight": "[[A]]"},
    "gpt2_dynamo": {"lm.transformer.h.1.mlp.c_fc.weight": "[[], [A]]"},
    "bert": {"onnx::MatMul_359": "[[], [A]]", "onnx::MatMul_360": "[[A]]"},
}  # fmt: skip
MESHES = ("2", "2x2", "2x4")


def cli(*args):
    return main([str(a) for a in args])


def dim_flags(dims):
    return [f for name, size in dims.items() for f in ("--dim", f"{name}={size}")]


def annotations(name, mesh_text, kind):
    mesh = Mesh.parse(mesh_text)
    last = mesh.ndim - 1
    if kind == "data":
        split = "[[0]]" if mesh.ndim == 1 else "[[0, 1]]"
        return {FIRST_INPUT[name]: split}
    if kind == "tensor":
        return {v: s.replace("A", str(last)) for v, s in TENSOR_PARALLEL[name].items()}
    if kind == "megatron":
        graph = import_onnx(model_path(name), DIMS[name])
        return {a.value: a.sharding.text() for a in megatron(graph, mesh, last)}
    # Uneven: batch 3 split over every device (2 -> rows 2, 1; 2x2 -> 1, 1, 1, 0).
    return {FIRST_INPUT[name]: "[[0]]" if mesh.ndim == 1 else "[[0, 1]]"}


def partition_cli(out, name, mesh, kind, dims=None):
    dims = dims or ({**DIMS[name], "batch": 3} if kind == "uneven" else DIMS[name])
    flags = [
        f for v, s in annotations(name, mesh, kind).items() for f in ("--annotate", f"{v}={s}")
    ]
    code = cli("partition", model_path(name), "--mesh", mesh, *dim_flags(dims), *flags, "-o", out)
    assert code == 0
    return dims


@pytest.mark.parametrize("kind", ["data", "tensor", "megatron", "uneven"])
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", list(DIMS))
def test_partition_verifies(tmp_path, capsys, name, mesh, kind):
    out = tmp_path / "out"
    dims = partition_cli(out, name, mesh, kind)
    capsys.readouterr()
    assert cli("verify", out, "--model", model_path(name), "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["devices"] == Mesh.parse(mesh).size
    graph = import_onnx(model_path(name), dims)
    assert list(report["outputs"]) == list(graph.outputs)
    for check in report["outputs"].values():
        assert check["max_rel_err"] <= 1e-5 and check["max_replica_err"] == 0
    assert_weights_round_trip(out, model_path(name), dims)
    manifest = json.loads((out / "manifest.json").read_text())
    if kind in ("tensor", "megatron"):
        assert manifest["collectives"], "tensor parallelism communicates"
        assert any(w["sharding"].strip("[], ") for w in manifest["weights"].values())


def test_uneven_batch_holds_an_empty_shard(tmp_path):
    out = tmp_path / "out"
    partition_cli(out, "gpt2", "2x2", "uneven")
    manifest = json.loads((out / "manifest.json").read_text())
    gather = manifest["collectives"][0]
    assert (gather["value"], gather["kind"], gather["to"]) == (
        "input_ids",
        "all_gather",
        "[[], []]",
    )
    assert gather["groups"] == [[0, 1, 2, 3]]
    assert cli("verify", out, "--model", model_path("gpt2")) == 0


def test_manifest_records_what_verify_needs(tmp_path):
    out = tmp_path / "out"
    partition_cli(out, "gpt2", "2x4", "tensor")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["mesh"] == {"shape": [2, 4], "axis_names": [], "name": "mesh0"}
    assert manifest["dims"] == {"batch": 4, "seq": 8}
    assert manifest["annotations"][0] == {
        "value": "lm.transformer.h.0.mlp.c_fc.weight",
        "sharding": "[[], [1]]",
        "required": True,
        "for": "result",
    }
    fc = "lm.transformer.h.0.mlp.c_fc.weight"
    assert manifest["weights"][fc] == {"dtype": "float32", "shape": [64, 256],
                                       "sharding": "[[], [1]]"}  # fmt: skip
    # Device 6 = (1, 2): third quarter of the columns.
    device = manifest["devices"][6]
    assert device["coordinates"] == [1, 2] and device["slices"][fc] == [[0, 64], [128, 192]]
    assert device["file"] == "weights/device-6.safetensors"
    data = (out / device["file"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == device["sha256"] and len(data) == device["bytes"]
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert header[fc] == {
        "dtype": "F32",
        "shape": [64, 64],
        "data_offsets": header[fc]["data_offsets"],
    }
    names = [k for k in header if k != "__metadata__"]
    assert names == sorted(names) and len(names) == len(manifest["weights"])
    reduce = [c for c in manifest["collectives"] if c["kind"] == "all_reduce"]
    assert reduce and reduce[0]["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert reduce[0]["bytes_per_device"] == 2 * 3 * (4 * 8 * 64 * 4) // 4


def test_running_twice_writes_the_same_bytes(tmp_path):
    for kind in ("megatron", "uneven"):
        first, second = tmp_path / f"{kind}1", tmp_path / f"{kind}2"
        partition_cli(first, "gpt2", "2x4", kind)
        partition_cli(second, "gpt2", "2x4", kind)
        files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
        steps = json.loads((first / "steps.json").read_text())
        segments = {s["run"] for d in steps["devices"] for s in d["steps"] if "run" in s}
        # manifest, spmd.mlir, steps.json, one weight file a device, each distinct segment once
        assert len(files) == 3 + 8 + len(segments)
        for path in files:
            assert (first / path).read_bytes() == (second / path).read_bytes(), path
    # Into the same folder again, on a smaller mesh: no stale device files are left behind.
    partition_cli(first, "gpt2", "2", "uneven")
    assert sorted(p.name for p in (first / "weights").iterdir()) == [
        "device-0.safetensors",
        "device-1.safetensors",
    ]
    steps = json.loads((first / "steps.json").read_text())
    segments = {s["run"] for d in steps["devices"] for s in d["steps"] if "run" in s}
    assert sorted(f"segments/{p.name}" for p in (first / "segments").iterdir()) == sorted(segments)


def test_seed_001_mlp_verifies(tmp_path):
    from .test_partition import write_seed_mlp

    model = write_seed_mlp(tmp_path / "mlp.onnx")
    spec = tmp_path / "annotations.json"
    spec.write_text(json.dumps({"annotations": [
        {"value": "x", "sharding": "[[], [], [0]]"},
        {"value": "y", "sharding": "[[]] partial = sum[0]"},
        {"value": "y", "sharding": "[[], [], [0]]", "for": "users"},
    ]}))  # fmt: skip
    out = tmp_path / "out"
    assert cli("partition", model, "--mesh", "2", "--annotations", spec, "-o", out) == 0
    kinds = [c["kind"] for c in json.loads((out / "manifest.json").read_text())["collectives"]]
    assert kinds == ["all_gather", "all_slice", "reduce_scatter"]
    assert cli("verify", out, "--model", model) == 0


def test_given_inputs_and_text_report(tmp_path, capsys):
    out = tmp_path / "out"
    partition_cli(out, "bert", "2x2", "tensor")
    graph = import_onnx(model_path("bert"), DIMS["bert"])
    inputs = random_inputs(graph, seed=7)
    inputs["attention_mask"][:, -3:] = 0  # padding: masked positions
    np.savez(tmp_path / "inputs.npz", **inputs)
    capsys.readouterr()
    assert (
        cli("verify", out, "--model", model_path("bert"), "--inputs", tmp_path / "inputs.npz") == 0
    )
    text = capsys.readouterr().out
    assert text.startswith(f"verify {out} on 4 devices: ok\n  last_hidden_state: max abs err ")
    assert "(tolerance 1e-05)  ok" in text


def test_a_wrong_weight_fails_verification(tmp_path, capsys):
    out = tmp_path / "out"
    partition_cli(out, "mlp", "2", "tensor")
    manifest = json.loads((out / "manifest.json").read_text())
    path = out / manifest["devices"][1]["file"]
    data = bytearray(path.read_bytes())
    data[-4:] = np.float32(1e3).tobytes()  # device 1's last weight element
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli("verify", out, "--model", model_path("mlp")) == 2
    assert "does not match the manifest's sha256" in capsys.readouterr().err
    manifest["devices"][1]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert cli("verify", out, "--model", model_path("mlp"), "--json") == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["outputs"]["y"]["max_rel_err"] > 1e-3


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda out, tmp: [tmp / "nothing", "--model", model_path("mlp")],
         "is not a partition folder: no manifest.json"),
        (lambda out, tmp: [out, "--model", model_path("cnn")],
         "is not the model this partition was made from"),
        (lambda out, tmp: [out, "--model", model_path("mlp"), "--dim", "batch=8"],
         "--dim batch=8 differs from the partition's batch=4"),
        (lambda out, tmp: [out, "--model", model_path("mlp"), "--inputs", tmp / "bad.npz"],
         "input 'x' has shape [2, 64]; the partition was made for [4, 64]"),
        (lambda out, tmp: [out, "--model", model_path("mlp"), "--inputs", tmp / "missing.npz"],
         "inputs file"),
    ],
)  # fmt: skip
def test_verify_errors_are_one_line(tmp_path, capsys, setup, message):
    out = tmp_path / "out"
    partition_cli(out, "mlp", "2", "data")
    np.savez(tmp_path / "bad.npz", x=np.zeros((2, 64), np.float32))
    capsys.readouterr()
    assert cli("verify", *setup(out, tmp_path)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("autoshard: error: ")


def test_shape_only_model_has_nothing_to_verify(tmp_path, capsys):
    out = tmp_path / "out"
    dims = {"batch": 2, "seq": 16}
    model = model_path("decoder_32l_shape_only")
    assert cli("partition", model, "--mesh", "2", *dim_flags(dims), "-o", out) == 0
    assert (
        "shape-only model (weight data absent): no weight files written" in capsys.readouterr().out
    )
    assert cli("verify", out, "--model", model) == 2
    assert "shape-only model: there are no weights to run" in capsys.readouterr().err


MLIR_OPT = shutil.which("mlir-opt-22")


@pytest.mark.skipif(MLIR_OPT is None, reason="mlir-opt-22 (Debian mlir-22-tools) is not installed")
@pytest.mark.parametrize(
    "name, mesh, kind", [("gpt2", "2x4", "megatron"), ("mlp", "2x2", "uneven")]
)
def test_spmd_ir_in_the_shard_dialect_verifies_upstream(tmp_path, name, mesh, kind):
    out = tmp_path / "out"
    dims = {**DIMS[name], "batch": 3} if kind == "uneven" else DIMS[name]
    flags = [
        f for v, s in annotations(name, mesh, kind).items() for f in ("--annotate", f"{v}={s}")
    ]
    args = ["partition", model_path(name), "--mesh", mesh, *dim_flags(dims), *flags]
    assert cli(*args, "--dialect", "shard", "-o", out) == 0
    text = (out / "spmd.mlir").read_text()
    assert "shard.grid @mesh0" in text
    result = subprocess.run(
        [MLIR_OPT, "--allow-unregistered-dialect", str(out / "spmd.mlir")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[:2000]


def test_external_data_weights_stream_in_chunks(tmp_path, monkeypatch):
    """A model whose weights live in an external file: each device's slices are read through
    a memory map and written a few rows at a time, and come back bit for bit."""
    from onnx import TensorProto, helper, numpy_helper

    import autoshard.weights as weights

    rng = np.random.default_rng(3)
    w1 = rng.standard_normal((16, 40)).astype(np.float32)
    w2 = rng.standard_normal((40, 16)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="up"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("MatMul", ["r", "w2"], ["y"], name="down"),
        ],
        "external",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    path = tmp_path / "external.onnx"
    onnx.save_model(model, path, save_as_external_data=True, location="external.bin",
                    size_threshold=0)  # fmt: skip
    imported = import_onnx(path)
    assert isinstance(weights.weight_array(imported.weights["w1"]), np.memmap)
    monkeypatch.setattr(weights, "CHUNK_BYTES", 100)  # a few rows of 40 floats at a time
    out = tmp_path / "out"
    args = ["--annotate", "w1=[[], [0]]", "--annotate", "w2=[[0]]"]
    assert cli("partition", path, "--mesh", "3", *args, "-o", out) == 0  # 40 rows: 14, 14, 12
    assert_weights_round_trip(out, path, {})
    assert cli("verify", out, "--model", path) == 0


def test_each_weight_is_read_once_for_all_devices(tmp_path, monkeypatch):
    import autoshard.weights as weights

    reads = []
    original = weights.weight_array
    monkeypatch.setattr(weights, "weight_array", lambda w: reads.append(w.name) or original(w))
    partition_cli(tmp_path / "out", "gpt2", "2x4", "megatron")
    graph = import_onnx(model_path("gpt2"), DIMS["gpt2"])
    assert sorted(reads) == sorted(graph.weights)  # once each, not once a device

"""`autoshard export`: a plan of block_dynamo.onnx on dp=2,tp=2 with its first up-projection
split tp-major over both axes and the second down-projection over tp, as DTensor placements,
JAX PartitionSpecs (run by JAX on 4 CPU devices when jax is installed) and ONNX IR v11 sharding
metadata (checked by onnx.checker and read back)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
from onnx import numpy_helper

from autoshard.cli.main import main
from autoshard.export import Target, export_plan
from autoshard.mesh import Mesh
from autoshard.sharding import Sharding

MODELS = Path(__file__).resolve().parents[2] / "models"
MESH = Mesh.parse("dp=2,tp=2")


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("export")
    shutil.copy(MODELS / "block_dynamo.onnx", folder)  # found beside the plan
    path = folder / "plan.json"
    code = main([
        "plan", str(folder / "block_dynamo.onnx"), "--mesh", str(MESH), "--dim", "batch=4",
        "--dim", "seq=8", "--annotate", "val_2=[[], [1, 0]]", "--annotate", "val_9=[[1], []]",
        "-o", str(path),
    ])  # fmt: skip
    assert code == 0
    return path


def test_dtensor(plan):
    document = export_plan(plan, Target.DTENSOR).document
    params = document["parameters"]
    # val_2 = 0.up.weight.T [32, 64] split [[], [1, 0]]: the Linear's dim 0, tp-major.
    assert params["0.up.weight"] == {
        "placements": ["_StridedShard(0, split_factor=2)", "Shard(0)"],
        "used": ["_StridedShard(0, split_factor=2)", "Shard(0)"], "style": "distribute",
        "onnx_weight": "val_2", "transposed": True, "source": "folded_from",
    }  # fmt: skip
    # Read split over both mesh dims: no DTensor parallel style (one dim each) applies.
    assert document["parallelize"] == {
        "tp": None, "fsdp": None, "modules": {},
        "fallback": "module 0.up reads parameters split over mesh dims dp, tp; DTensor's "
        "parallel styles take one",
    }  # fmt: skip
    assert params["1.down.weight"]["placements"] == ["Replicate()", "Shard(1)"]
    assert params["1.norm.weight"]["onnx_weight"] == "0.norm.weight"  # deduplicated
    assert document["mesh"] == {"shape": [2, 2], "dim_names": ["dp", "tp"]}
    assert len(params) == 10 and document["unnamed"] == {} and document["warnings"] == []


def test_dtensor_module_is_deterministic(plan):
    first, second = (export_plan(plan, Target.DTENSOR).payload for _ in range(2))
    assert first == second
    text = first.decode()
    assert '    "0.up.weight": (_StridedShard(0, split_factor=2), Shard(0),),\n' in text
    compile(text, "apply_plan.py", "exec")


def test_jax_specs(plan):
    params = export_plan(plan, Target.JAX).document["parameters"]
    assert params["0.up.weight"]["spec"] == [["tp", "dp"], None]
    assert params["0.up.weight"]["text"] == "PartitionSpec(('tp', 'dp'), None)"
    assert params["0.up.weight"]["shape"] == [64, 32]
    assert params["1.down.weight"]["text"] == "PartitionSpec(None, 'tp')"


JAX_CHECK = """
import json, sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
placed = {}
for path in sys.argv[1:]:  # each a jax export: its parameters placed, each device's region
    export = json.load(open(path))
    shape = export["mesh"]["shape"]
    mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape),
                tuple(export["mesh"]["axis_names"]))
    ids = {d.id: i for i, d in enumerate(mesh.devices.flat)}
    out = placed[path] = {}
    for name, entry in export["parameters"].items():
        spec = PartitionSpec(*(tuple(s) if isinstance(s, list) else s for s in entry["spec"]))
        array = jax.device_put(np.zeros(entry["shape"], np.float32), NamedSharding(mesh, spec))
        out[name] = {ids[s.device.id]: [[sl.start or 0, sl.stop if sl.stop is not None else n]
                                         for sl, n in zip(s.index, entry["shape"])]
                     for s in array.addressable_shards}
print(json.dumps(placed))
"""


def jax_placed(*paths: Path) -> dict[str, dict]:
    """Each jax export's parameters `device_put` by JAX on 4 CPU devices: per file, parameter
    and device, the region of the parameter that device holds."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu"}  # fmt: skip
    run = subprocess.run([sys.executable, "-c", JAX_CHECK, *map(str, paths)], env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(run.stdout)


def test_jax_places_the_plans_shards(plan, tmp_path):
    pytest.importorskip("jax")
    path = tmp_path / "jax.json"
    assert main(["export", str(plan), "--to", "jax", "-o", str(path)]) == 0
    placed = jax_placed(path)[str(path)]
    export = json.loads(path.read_text())
    document = json.loads(plan.read_text())
    for name, entry in export["parameters"].items():
        held = Sharding.parse(document["values"][entry["onnx_weight"]]["sharding"])
        onnx_shape = entry["shape"][::-1] if entry["transposed"] else entry["shape"]
        for device in MESH.devices():
            region = [list(r) for r in held.slices(MESH, onnx_shape, device)]
            region = region[::-1] if entry["transposed"] else region
            assert placed[name][str(MESH.linear_index(device))] == region, (name, device)


def _read_back(spec, mesh: Mesh, shape) -> dict[int, tuple[int, ...]]:
    """Device -> the shard index tuple a ShardingSpecProto gives it."""
    groups = {e.key: list(e.value) for e in spec.index_to_device_group_map}
    counts = [d.simple_sharding[0].num_shards for d in spec.sharded_dim]
    for d in spec.sharded_dim:
        assert d.simple_sharding[0].dim_value == shape[d.axis]
    out = {}
    for flat, key in enumerate(spec.device):
        index, rest = [], flat
        for count in reversed(counts):
            index.append(rest % count)
            rest //= count
        for device in groups.get(key, [key]):
            out[device] = tuple(reversed(index))
    assert sorted(out) == list(range(mesh.size))
    return out


def test_onnx_sharding_metadata(plan, tmp_path):
    from autoshard.document.plan_document import read_document
    from autoshard.export.held import held_params
    from autoshard.export.to_onnx import shard_index

    out = tmp_path / "sharded.onnx"
    assert main(["export", str(plan), "--to", "onnx", "-o", str(out)]) == 0
    model = onnx.load(out)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 11
    assert [(c.name, c.num_devices) for c in model.configuration] == [("autoshard", 4)]
    held = held_params(read_document(plan), plan.parent / "block_dynamo.onnx")
    checked = 0
    for node in model.graph.node:
        op = held.graph.op_by_name[node.name]
        (config,) = node.device_configurations
        specs = {s.tensor_name: s for s in config.sharding_spec}
        for i, name in enumerate(op.inputs):
            shape = held.graph.values[name].shape
            needs = held.plan.needs[(op.name, i)]
            got = _read_back(specs[name], MESH, shape)
            for device in MESH.devices():
                assert got[MESH.linear_index(device)] == shard_index(needs, MESH, device)
            checked += bool(needs.split_axes)
    assert checked >= 2
    matmul = next(n for n in model.graph.node if "val_2" in n.input)
    (config,) = matmul.device_configurations
    spec = next(s for s in config.sharding_spec if s.tensor_name == "val_2")
    # dim 1 over tp then dp: device (dp=i, tp=j) holds shard 2j + i; one device per shard.
    assert [(d.axis, d.simple_sharding[0].num_shards) for d in spec.sharded_dim] == [(1, 4)]
    assert list(spec.device) == [0, 2, 1, 3]
    # Otherwise the model is the original, and onnx_ir reads the export back unchanged.
    original = onnx.load(plan.parent / "block_dynamo.onnx")
    assert [(n.op_type, n.input, n.output, n.attribute) for n in model.graph.node] == [
        (n.op_type, n.input, n.output, n.attribute) for n in original.graph.node
    ]
    assert [(t.name, numpy_helper.to_array(t).tobytes()) for t in model.graph.initializer] == [
        (t.name, numpy_helper.to_array(t).tobytes()) for t in original.graph.initializer
    ]
    assert ir.to_proto(ir.from_proto(model)) == model


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--to", "onnx"], "--to onnx writes a model: give -o OUT.onnx"),
        (["--to", "jax", "--model", "MODELS/mlp.onnx"],
         "model 'MODELS/mlp.onnx' is not the one plan PLAN was made from (sha256 differs)"),
        (["--to", "jax", "--model", "nope.onnx"],
         "cannot read ONNX model 'nope.onnx': no such file"),
        (["--to", "jax", "--checkpoint", "nope.pt"],
         "cannot read checkpoint 'nope.pt': no such file"),
    ],
)  # fmt: skip
def test_errors(plan, capsys, args, message):
    args = [a.replace("MODELS", str(MODELS)) for a in args]
    assert main(["export", str(plan), *args]) == 2
    expected = message.replace("MODELS", str(MODELS)).replace("PLAN", str(plan))
    assert capsys.readouterr().err == f"autoshard: error: {expected}\n"


def test_the_model_must_be_found(tmp_path, plan, capsys):
    lone = tmp_path / "plan.json"
    shutil.copy(plan, lone)
    assert main(["export", str(lone), "--to", "jax"]) == 2
    assert capsys.readouterr().err == (
        f"autoshard: error: plan {lone} was made from block_dynamo.onnx, which is not beside it "
        "nor here: give it with --model\n"
    )


def test_what_the_targets_cannot_hold_is_warned(tmp_path):
    """6 columns over 2x2 ([[], [0, 1]]): the plan cuts 2/2/2/0, DTensor's nested chunks
    2/1/2/1, JAX refuses."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.arange(36, dtype=np.float32).reshape(6, 6), "fc.weight")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "fc.weight"], ["y"], name="/fc/MatMul")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6])], [weight],
    )  # fmt: skip
    model = tmp_path / "fc.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    plan = tmp_path / "plan.json"
    assert main(["plan", str(model), "--mesh", "2x2", "--annotate", "fc.weight=[[], [0, 1]]",
                 "-o", str(plan)]) == 0  # fmt: skip
    dtensor = export_plan(plan, Target.DTENSOR).document
    assert dtensor["parameters"]["fc.weight"]["placements"] == ["Shard(1)", "Shard(1)"]
    assert dtensor["warnings"] == [
        "fc.weight: [[], [0, 1]] on shape [6, 6] is uneven; DTensor cuts it by nested "
        "torch.chunk, not the plan's ceil-div"
    ]
    assert export_plan(plan, Target.JAX).document["warnings"] == [
        "fc.weight: dim 1 of 6 does not divide over axis0, axis1; JAX shards evenly only"
    ]
    # The MatMul reads it gathered over axis 1 (`[[], [0]]`, even): nothing for ONNX to say.
    assert export_plan(plan, Target.ONNX).document["warnings"] == []


@pytest.fixture(scope="module")
def training_plan(tmp_path_factory) -> Path:
    """A training step of models/mlp.onnx on dp=2,tp=2: 0.weight stored split over tp and dp
    (read over tp alone: tp+fsdp), 2.weight over tp as read (tp), 2.bias whole with its
    optimizer state split (zero).

    Holding the weights so is not enough to get these reads: the search's cheapest plan on so
    small a model gathers the hidden activation and 2.weight over tp and runs the second Gemm
    whole (fsdp), and keeps 2.bias's state whole (replicated). So the Megatron reads are pinned
    on the activations (the first Gemm's output split over tp, the second Gemm reading it so),
    not on the weights: a weight's `users` annotation would pin its Update's read too (and
    gather its optimizer state). 2.bias's state, a value of its own, is pinned split."""
    folder = tmp_path_factory.mktemp("training")
    shutil.copy(MODELS / "mlp.onnx", folder)
    path, notes = folder / "plan.json", folder / "annotations.json"
    pins = [
        ("0.weight", "[[1], [0]]", "result"),
        ("0.bias", "[[1, 0]]", "result"),
        ("2.weight", "[[], [1]]", "result"),
        ("2.bias", "[[]]", "result"),
        ("/0/Gemm_output_0", "[[], [1]]", "result"),
        ("/1/Relu_output_0", "[[], [1]]", "users"),
        ("2.bias@state", "[[], [1]]", "result"),
    ]
    notes.write_text(json.dumps({"annotations": [
        {"value": v, "sharding": s, "required": True, "for": f} for v, s, f in pins
    ]}))  # fmt: skip
    code = main([
        "plan", str(folder / "mlp.onnx"), "--mesh", str(MESH), "--dim", "batch=8",
        "--mode", "training", "--annotations", str(notes), "-o", str(path),
    ])  # fmt: skip
    assert code == 0
    return path


def test_training_plan_exports_what_is_stored(training_plan):
    strategy = json.loads(training_plan.read_text())["strategy"]["weights"]
    assert strategy["0.weight"]["strategy"] == "tp+fsdp"
    assert strategy["2.bias"] == {"stored": "[[]]", "used": "[[]]", "state": "[[1]]",
                                  "strategy": "zero"}  # fmt: skip
    dtensor = export_plan(training_plan, Target.DTENSOR).document
    weight, bias = dtensor["parameters"]["0.weight"], dtensor["parameters"]["2.bias"]
    # Gemm weights are [out, in] as torch holds them: stored [[1], [0]], read [[1], []].
    assert (weight["placements"], weight["used"]) == (["Shard(1)", "Shard(0)"],
                                                      ["Replicate()", "Shard(0)"])  # fmt: skip
    assert (weight["style"], weight["strategy"]) == ("colwise+fsdp", "tp+fsdp")
    assert weight["optimizer_state"] == ["Shard(1)", "Shard(0)"]
    assert bias["placements"] == ["Replicate()", "Replicate()"]
    assert (bias["strategy"], bias["optimizer_state"]) == ("zero", ["Replicate()", "Shard(0)"])
    assert dtensor["parallelize"]["modules"]["0"] == {
        "style": "colwise", "fsdp_dims": {"bias": 0, "weight": 1}, "reshard_after_forward": True
    }  # fmt: skip
    jax = export_plan(training_plan, Target.JAX).document["parameters"]
    assert jax["0.weight"]["text"] == "PartitionSpec('tp', 'dp')"
    assert jax["0.bias"]["text"] == "PartitionSpec(('tp', 'dp'))"
    assert (jax["2.bias"]["text"], jax["2.bias"]["optimizer_state"]) == (
        "PartitionSpec(None)", "PartitionSpec('tp')"
    )  # fmt: skip
    assert jax["2.bias"]["strategy"] == "zero"


def test_inference_plan_has_no_strategy(plan):
    entry = export_plan(plan, Target.JAX).document["parameters"]["0.up.weight"]
    assert "strategy" not in entry and "optimizer_state" not in entry


def test_a_norm_split_on_another_dim_than_tp_keeps_the_styles(tmp_path):
    """The blocks' weights split Megatron-wise over tp, their input's sequence over dp: the
    linears keep their styles; the norms, split on a dim no style of tp holds, replicate."""
    shutil.copy(MODELS / "block_dynamo.onnx", tmp_path)
    plan = tmp_path / "plan.json"
    notes = ["x=[[], [0], []]", "val_2=[[], [1]]", "0.up.bias=[[1]]", "val_4=[[1], []]",
             "val_7=[[], [1]]", "1.up.bias=[[1]]", "val_9=[[1], []]"]  # fmt: skip
    assert main(["plan", str(tmp_path / "block_dynamo.onnx"), "--mesh", str(MESH),
                 "--dim", "batch=4", "--dim", "seq=8",
                 *(a for n in notes for a in ("--annotate", n)), "-o", str(plan)]) == 0  # fmt: skip
    document = export_plan(plan, Target.DTENSOR).document
    assert {k: v for k, v in document["parallelize"].items() if k != "modules"} == {
        "tp": "tp", "fsdp": None, "fallback": None
    }  # fmt: skip
    styles = {name: entry["style"] for name, entry in document["parameters"].items()}
    assert styles == {
        "0.down.weight": "rowwise", "0.norm.bias": "replicate", "0.norm.weight": "replicate",
        "0.up.bias": "colwise", "0.up.weight": "colwise", "1.down.weight": "rowwise",
        "1.norm.bias": "replicate", "1.norm.weight": "replicate", "1.up.bias": "colwise",
        "1.up.weight": "colwise",
    }  # fmt: skip


# ---- the JAX file as the docs describe it --------------------------------------------------------

DOCS = MODELS.parent / "docs"
READ_BACK = """
params = {n: np.zeros(e["shape"], np.float32) for n, e in specs["parameters"].items()}
"""
"""Zeros for the parameters, which the docs' snippet places (its `params` are the user's)."""


def _block(text: str, language: str) -> str:
    """The first fenced block of `language` in `text`."""
    start = text.index(f"```{language}\n") + len(language) + 4
    return text[start : text.index("\n```\n", start)]


def _documented_fields(page: Path) -> set[str]:
    """The JSON fields a page names in backquotes: `spec`, `mesh.shape`, `parameters.*.text`."""
    import re

    return {f for m in re.findall(r"`([a-z_.*]+)`", page.read_text()) for f in m.split(".")}


def _keys(document: dict) -> set[str]:
    keys = set(document) | set(document["mesh"])
    for entry in document["parameters"].values():
        keys |= set(entry)
    return keys


def test_jax_file_is_the_documented_one(tmp_path):
    """docs/concepts/exports.md shows the file `export --to jax -o` writes for models/mlp.onnx,
    made by the commands it shows; both pages name every field (a training plan's too); and the
    page's JAX snippet places every parameter (with jax installed)."""
    page = (DOCS / "concepts" / "exports.md").read_text()
    section = page[page.index("### The JSON file") :]
    shutil.copy(MODELS / "mlp.onnx", tmp_path)
    model, plan, specs = tmp_path / "mlp.onnx", tmp_path / "plan.json", tmp_path / "specs.json"
    flags = ["--mesh", "dp=2,tp=2", "--dim", "batch=8", "-q"]
    assert main(["plan", str(model), *flags, "--memory", "100KB", "-o", str(plan)]) == 0
    assert main(["export", str(plan), "--to", "jax", "-o", str(specs)]) == 0
    assert json.loads(specs.read_text()) == json.loads(_block(section, "json"))
    training = tmp_path / "training.json"
    argv = ["plan", str(model), *flags, "--mode", "training", "--memory", "300KB"]
    assert main([*argv, "-o", str(training)]) == 0
    keys = _keys(json.loads(specs.read_text())) | _keys(export_plan(training, Target.JAX).document)
    for name in ("concepts/exports.md", "guide/export.md"):
        assert sorted(keys - _documented_fields(DOCS / name)) == [], name
    if importlib.util.find_spec("jax") is None:
        return
    snippet = _block(section, "python").replace("\nparams = {", READ_BACK + "params = {", 1)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    script = snippet + "\nprint(sorted(n for n, p in params.items() if p.sharding == sharding(n)))"
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout == "['0.bias', '0.weight', '2.bias', '2.weight']\n"

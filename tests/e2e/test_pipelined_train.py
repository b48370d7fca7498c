"""The training step of a pipelined plan partitioned stage by stage and run on gloo, one
process per device of the whole mesh, each stage's forward and backward passes in its
schedule's order, against PyTorch autograd on the whole model (loss, every gradient, weight
and Adam state within 1e-5 after each step); the schedule, ZB-H1's split backward included,
changes no rounding; a gradient sent back wrong is named by step and rank; bad requests
refused in one line.

Each run starts 4 ranks (seconds each on a loaded host): one 4-layer MLP, one partition per
mesh and schedule (`partitions`), shared by the tests that run them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from autoshard.cli.main import main

from .test_pipelined_run import SLOW, mlp

pytest.importorskip("torch")

# Data parallel stages: the activations pinned split over the batch (axis 1 of pp=2,dp=2).
DATA_PARALLEL = [f"--annotate={v}=[[1],[]]" for v in ("x", "h0", "h1", "h2", "h3", "h4", "y")]


@pytest.fixture(scope="module")
def partitions(tmp_path_factory):
    """The MLP and the partitions of its pipelined training plans, by name: pp=2,tp=2 (the
    search splits each stage's layers over tp; 1F1B, 4 micro-batches), the same under ZB-H1
    (zb-h1) and pp=2,dp=2 (GPipe, 2 micro-batches)."""
    root = tmp_path_factory.mktemp("pptrain")
    onnx = mlp(root)
    cluster = root / "slow.json"
    cluster.write_text(json.dumps(SLOW))
    tp = ["--mesh", "pp=2,tp=2", "--cluster", str(cluster), "--micro-batches", "4"]
    dp = DATA_PARALLEL
    asks = {
        "pp=2,tp=2": [*tp, "--schedule", "1f1b"],
        "zb-h1": [*tp, "--schedule", "zb-h1"],
        "pp=2,dp=2": ["--mesh", "pp=2,dp=2", "--schedule", "gpipe", "--micro-batches", "2", *dp],
    }
    folders = {}
    for name, flags in asks.items():
        plan, out = root / f"{name}.json", root / name
        assert main(["plan", str(onnx), "--mode", "training", "--precision", "fp32", "--dim",
                     "batch=4", *flags, "-q", "-o", str(plan)]) == 0  # fmt: skip
        assert main(["partition", str(onnx), "--plan", str(plan), "-o", str(out)]) == 0
        folders[name] = out
    return onnx, folders


def _collectives(out: Path, stage: int) -> list[tuple[str, str]]:
    steps = json.loads((out / f"stage-{stage}" / "steps.json").read_text())
    return [(c["kind"], c["source"]) for c in steps["collectives"]]


def test_tensor_parallel_stages_train_1f1b_and_gpipe_to_the_same_roundings(partitions, tmp_path):
    from autoshard.run.pipetrain import run_pipelined_training

    onnx, folders = partitions
    out = folders["pp=2,tp=2"]
    pipeline = json.loads((out / "manifest.json").read_text())["pipeline"]
    assert pipeline["training"]["precision"] == "fp32" and pipeline["micro_batches"] == 4
    # Stage 0 takes the gradient of h2, its send, from stage 1, which sends it back: the
    # output of its step holding h2's gradient, held as h2 is (its features split over tp).
    first, second = pipeline["stages"]
    assert first["seeded"] == ["h2"] and first["sent_back"] == {}
    assert second["seeded"] == [] and list(second["sent_back"]) == ["h2"]
    assert pipeline["boundary"]["h2"]["sharding"] == "[[], [0]]"
    mlir = (out / "pipeline.mlir").read_text()  # stage 1 sends h2's gradient back to stage 0
    assert (
        "mesh.send %arg0 on @mesh0 mesh_axes = [0] destination = [0] : (tensor<4x32xf32>) "
        '-> tensor<4x32xf32> loc("h2@grad0")' in mlir
    )
    assert (
        "mesh.recv %r0 on @mesh0 mesh_axes = [0] source = [1] : (tensor<4x32xf32>) -> "
        'tensor<4x32xf32> loc("h2@grad0")' in mlir
    )
    # Each stage's backward reduce-scatters its layers' input gradients over tp.
    assert ("reduce_scatter", "h2@grad0") in _collectives(out, 1)
    assert ("reduce_scatter", "h0@grad0") in _collectives(out, 0)
    report = run_pipelined_training(out, onnx, steps=3, timeout_s=120)
    assert report.ok, [c.line() for c in report.failures]
    assert {c.step for c in report.checks} == {1, 2, 3}
    assert [c.what for c in report.checks].count("loss") == 3  # the last stage's, each step
    trained = {c.name for c in report.checks if c.what == "weight"}
    assert trained == {"embed", "head", *(f"{k}{i}" for k in "wb" for i in range(4))}
    assert max(c.max_rel_err for c in report.checks) <= 1e-5
    # The same partition in GPipe's order (stage 0: F0 F1 F2 F3 B0 .. B3, not 1F1B's F0 F1
    # B0 F2 B1 F3 B2 B3): every backward runs in micro-batch order either way, so the
    # gradients sum in the same order and step 1 is the same to the last bit.
    gpipe = tmp_path / "gpipe"
    shutil.copytree(out, gpipe)
    manifest = json.loads((gpipe / "manifest.json").read_text())
    manifest["pipeline"]["schedule"] = "gpipe"
    (gpipe / "manifest.json").write_text(json.dumps(manifest))
    again = run_pipelined_training(gpipe, onnx, steps=1, timeout_s=120)
    assert again.ok
    assert again.checks == tuple(c for c in report.checks if c.step == 1)
    # The same plan under ZB-H1 (stage 0: F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3): each
    # backward's input gradient sent back at once, its weight gradients later, still in
    # micro-batch order, so the gradients sum, sync and update to the same bits.
    zero_bubble = folders["zb-h1"]
    assert json.loads((zero_bubble / "manifest.json").read_text())["pipeline"]["schedule"] == (
        "zb-h1"
    )
    split = run_pipelined_training(zero_bubble, onnx, steps=2, timeout_s=120)
    assert split.ok
    assert split.checks == tuple(c for c in report.checks if c.step <= 2)


def test_data_parallel_stages_sync_their_gradients_and_verify(partitions, capsys):
    onnx, folders = partitions
    out = folders["pp=2,dp=2"]
    pipeline = json.loads((out / "manifest.json").read_text())["pipeline"]
    assert pipeline["boundary"]["h2"]["local_shapes"] == [[2, 64], [2, 64]]  # the batch split
    # The embedding's and the head's gradients reduce-scattered over dp, each in its stage.
    assert ("reduce_scatter", "embed@grad0") in _collectives(out, 0)
    assert ("reduce_scatter", "head@grad0") in _collectives(out, 1)
    capsys.readouterr()
    assert main(["verify", str(out), "--model", str(onnx), "--steps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"verify {out}: 1 training steps on 4 devices as 4 processes (gloo) against torch "
        "autograd: ok"
    )


def test_a_gradient_sent_back_wrong_is_named_by_step_and_rank(partitions, tmp_path, capsys):
    """Stage 1 sends back h2 itself, not its gradient (its step manifest's output, edited):
    stage 0's gradients differ from autograd, named by step, whole-mesh rank and parameter;
    stage 1's own are right."""
    onnx, folders = partitions
    out = tmp_path / "bad"
    shutil.copytree(folders["pp=2,dp=2"], out)
    steps = json.loads((out / "stage-1" / "steps.json").read_text())
    entry = next(o for o in steps["outputs"] if o["name"] == "h2@grad0")
    entry["tensor"] = "h2"
    (out / "stage-1" / "steps.json").write_text(json.dumps(steps))
    capsys.readouterr()
    assert main(["verify", str(out), "--model", str(onnx), "--steps", "1", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    failures = report["failures"]
    assert failures and all(re.match(r"step 1, rank [01]: ", line) for line in failures)
    pattern = r"step 1, rank [01]: gradient of w1 differs from torch autograd by \d"
    assert any(re.match(pattern, line) for line in failures), failures
    assert not any(f" of {w} " in line for line in failures for w in ("w2", "w3", "head"))


def test_bad_requests_of_a_pipelined_training_partition_are_one_line(partitions, capsys):
    onnx, folders = partitions
    out = str(folders["pp=2,dp=2"])
    cases = [
        (["verify", out, "--model", str(onnx), "--rtol", "1e-3"], "--rtol is for forward passes"),
        (["run", out], "is a pipelined training step: give --check MODEL"),
        (["run", out, "--check", str(onnx), "--backend", "nccl"], "runs on gloo"),
        (["run", out, "--check", str(onnx), "--steps", "0"], "--steps must be at least 1"),
        (["run", out, "--check", str(onnx), "--loss", "cross-entropy"], "disagrees with"),
    ]
    for argv, said in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert said in err and "\n" not in err, err
    plain = Path(out).parent / "plain"
    assert main(["partition", str(onnx), "--mesh", "2x2", "--forward", "-o", str(plain)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--forward partitions a pipelined plan's forward only" in err and "\n" not in err


def test_a_gpt2_export_trains_over_2_stages_of_2_way_tensor_parallelism(tmp_path, capsys):
    """GPT-2 (1F1B, 2 micro-batches, SGD: Adam's first step moves an element whose exact
    gradient is zero, the key bias's, by the learning rate times the sign of its rounding)."""
    gpt2, _, out = _gpt2_over_two_stages("gpt2", tmp_path)
    _trains_two_steps_as_autograd(gpt2, out, capsys)


def test_gpt2_trains_under_zb_h1_its_weight_gradients_deferred(tmp_path, capsys):
    """gpt2_dynamo under ZB-H1 (the search's pick for pipelined training where it is the
    fastest): each stage's weight gradients, the tied table's included, run apart from and
    after its input gradients; 2 SGD steps equal to autograd, both tied copies checked."""
    gpt2, plan, out = _gpt2_over_two_stages("gpt2_dynamo", tmp_path, "zb-h1")
    assert json.loads(plan.read_text())["pipeline"]["schedule"] == "zb-h1"
    _trains_two_steps_as_autograd(gpt2, out, capsys)


def _gpt2_over_two_stages(
    name: str, tmp_path: Path, schedule: str = "1f1b"
) -> tuple[Path, Path, Path]:
    """The model `name`'s training step planned on pp=2,tp=2 (`schedule`, 2 micro-batches,
    fp32 SGD, batch 2, seq 16) and partitioned: the model, the plan and the partition."""
    from .helpers import model_path

    model = model_path(name)
    cluster, plan, out = tmp_path / "slow.json", tmp_path / "plan.json", tmp_path / "out"
    cluster.write_text(json.dumps(SLOW))
    flags = ["--precision", "fp32", "--optimizer", "sgd", "--micro-batches", "2", "--schedule",
             schedule, "--dim", "batch=2", "--dim", "seq=16", "-q"]  # fmt: skip
    assert main(["plan", str(model), "--cluster", str(cluster), "--mesh", "pp=2,tp=2", "--mode",
                 "training", *flags, "-o", str(plan)]) == 0  # fmt: skip
    assert main(["partition", str(model), "--plan", str(plan), "-o", str(out)]) == 0
    return model, plan, out


def _trains_two_steps_as_autograd(model: Path, out: Path, capsys) -> None:
    capsys.readouterr()
    assert main(["run", str(out), "--check", str(model), "--steps", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["steps"] == 2
    assert max(report["max_rel_err"].values()) <= 1e-5


def test_an_interleaved_plan_trains_chunk_by_chunk(partitions, tmp_path):
    """Interleaved 1F1B with 2 virtual stages: the 4 layers in 4 chunks, chunk c on the
    pipeline position c % 2 (as the plan records them), each device running its 2 chunks' passes in
    Megatron's order; the boundary between chunks 1 and 2 goes from position 1 back to 0."""
    from autoshard.run.pipetrain import run_pipelined_training

    onnx, _ = partitions
    cluster, plan, out = tmp_path / "slow.json", tmp_path / "plan.json", tmp_path / "out"
    cluster.write_text(json.dumps(SLOW))
    assert main(["plan", str(onnx), "--cluster", str(cluster), "--mesh", "pp=2,tp=2", "--mode",
                 "training", "--precision", "fp32", "--dim", "batch=4", "--schedule",
                 "interleaved:2", "--micro-batches", "2", "-q", "-o", str(plan)]) == 0  # fmt: skip
    recorded = json.loads(plan.read_text())["pipeline"]["chunks"]  # the plan says where
    placed = [{"layers": c["layers"], "stage": c["stage"]} for c in recorded]
    assert placed == [{"layers": [c, c + 1], "stage": c % 2} for c in range(4)]
    assert main(["partition", str(onnx), "--plan", str(plan), "-o", str(out)]) == 0
    pipeline = json.loads((out / "manifest.json").read_text())["pipeline"]
    assert pipeline["virtual"] == 2
    chunks = [(s["layers"], s["position"], s["devices"]) for s in pipeline["stages"]]
    assert chunks == [([0, 1], 0, [0, 1]), ([1, 2], 1, [2, 3]), ([2, 3], 0, [0, 1]),
                      ([3, 4], 1, [2, 3])]  # fmt: skip
    assert pipeline["stages"][2]["receives"] == ["h2"] and pipeline["stages"][2]["seeded"] == ["h3"]
    mlir = (out / "pipeline.mlir").read_text()
    assert "// chunk 2: layers 2..2 on devices [0, 1]" in mlir
    report = run_pipelined_training(out, onnx, steps=1, timeout_s=120)
    assert report.ok, [c.line() for c in report.failures]
    assert max(c.max_rel_err for c in report.checks) <= 1e-5


def test_a_tied_embedding_trains_on_both_ends_and_stays_equal(tmp_path, capsys):
    """gpt2_dynamo keeps GPT-2's token table tied to its LM head: stage 0 (the embedding) and
    stage 1 (the head) each hold a copy, and each pair of devices at one place in the stages
    all-reduces its two gradients before the update (Megatron's embedding group): 2 SGD
    steps equal to autograd, both copies checked. The forward-only partition of the same plan
    gives both stages the same shard of the weight."""
    from autoshard.weights import read_safetensors

    tied = "lm.lm_head.weight"
    gpt2, plan, out = _gpt2_over_two_stages("gpt2_dynamo", tmp_path)
    (priced,) = json.loads(plan.read_text())["pipeline"]["tied"]
    assert priced["weight"] == tied and priced["stages"] == [0, 1]
    (entry,) = json.loads((out / "manifest.json").read_text())["pipeline"]["tied"]
    assert entry["gradient"] == f"{tied}@grad" and entry["groups"] == [[0, 2], [1, 3]]
    mlir = (out / "pipeline.mlir").read_text()  # stage 1 adds stage 0's gradient to its own
    assert f"// {tied} is tied: its gradient summed over stages [0, 1]" in mlir
    assert re.search(r"%tied0_recv0 = mesh\.recv %tied0_e0 on @mesh0 mesh_axes = \[0\] "
                     r"source = \[0\] .*\n.*%tied0_sum0 = arith\.addf %tied0_recv0, "
                     r"%tied0_in", mlir)  # fmt: skip
    from autoshard.mlir.parse import parse_module  # autoshard's MLIR reader takes it back

    added = [op for op in parse_module(mlir).ops if op.name == "arith.addf"]
    assert len(added) == 2  # one sum on each stage
    _trains_two_steps_as_autograd(gpt2, out, capsys)
    forward = tmp_path / "forward"
    assert main(["partition", str(gpt2), "--plan", str(plan), "--forward", "-o",
                 str(forward)]) == 0  # fmt: skip
    for device in (0, 1):
        name = f"device-{device}.safetensors"
        files = [forward / f"stage-{s}" / "weights" / name for s in (0, 1)]
        copies = [read_safetensors(f)[tied] for f in files]
        assert copies[0].tobytes() == copies[1].tobytes()

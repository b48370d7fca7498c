"""`autoshard run` and `verify --distributed`: separate processes talking only through
torch.distributed (gloo on CPU). Each run starts its ranks in a few seconds, so the set is
small: models on meshes 2, 2x2 and 2x4 (8 processes), every collective kind and reduction kind
in one run against the in-process simulator, and the failures (a bad weight file, a failing
segment, a rank killed mid-run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from autoshard.collectives import Collective, CollectiveKind
from autoshard.execute.simulate import run_collective
from autoshard.mesh import Mesh
from autoshard.passes.partition import collective_groups, device_slices
from autoshard.sharding import ReductionKind, Sharding

from .helpers import model_path
from .test_verify import cli, partition_cli

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "name, mesh, kind",
    [("mlp", "2", "tensor"), ("gpt2", "2x2", "megatron"), ("bert", "2x4", "data"),
     ("cnn", "2x2", "uneven")],
)  # fmt: skip
def test_distributed_verify_equals_onnxruntime(tmp_path, capsys, name, mesh, kind):
    out = tmp_path / "out"
    partition_cli(out, name, mesh, kind)
    capsys.readouterr()
    assert cli("verify", out, "--model", model_path(name), "--distributed", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["devices"] == Mesh.parse(mesh).size
    for check in report["outputs"].values():
        assert check["max_rel_err"] <= 1e-5 and check["max_replica_err"] == 0
    ranks = report["timing"]["ranks"]
    assert [r["rank"] for r in ranks] == list(range(Mesh.parse(mesh).size))
    kinds = {c["kind"] for c in json.loads((out / "manifest.json").read_text())["collectives"]}
    assert set(ranks[0]["collectives"]) == kinds


def test_run_reports_outputs_and_timings_per_kind(tmp_path, capsys):
    out = tmp_path / "out"
    partition_cli(out, "gpt2", "2", "tensor")
    steps = json.loads((out / "steps.json").read_text())
    segments = {s["run"] for d in steps["devices"] for s in d["steps"] if "run" in s}
    assert sorted(p.name for p in (out / "segments").iterdir()) == sorted(
        Path(s).name for s in segments
    )
    capsys.readouterr()
    assert cli("run", out, "--check", model_path("gpt2")) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"ran {out} as 2 processes (gloo): ok\n  logits: max abs err ")
    assert "rank 1: compute " in text and "all_reduce 1x" in text


# ---- every collective kind, by the simulator ------------------------------------------------

MESH = Mesh((2, 2))


def _case(kind, axes, shape, dtype, **kw):
    return kind, tuple(axes), tuple(shape), dtype, kw


# Each case's input is split over every device on dim 0 (each device holds different rows),
# then one collective runs on those locals. Axes [1, 0] order the group unlike torch's ranks.
CASES = [
    _case(CollectiveKind.ALL_GATHER, [0, 1], (3, 2), "float32", dim=0),  # rows 1, 1, 1, 0
    _case(CollectiveKind.ALL_GATHER, [1, 0], (8, 3), "int64", dim=1),
    _case(CollectiveKind.ALL_SLICE, [1], (4, 5), "float32", dim=1),  # 3, 2
    _case(CollectiveKind.ALL_TO_ALL, [1, 0], (4, 3), "float32", dim=1, to_dim=0),  # 1, 1, 1, 0
    _case(CollectiveKind.ALL_TO_ALL, [0], (8, 4), "int32", dim=1, to_dim=0),
    _case(CollectiveKind.REDUCE_SCATTER, [0, 1], (4, 3), "float32", dim=1,
          reduction=ReductionKind.SUM),
    _case(CollectiveKind.REDUCE_SCATTER, [1, 0], (4, 6), "float32", dim=1,
          reduction=ReductionKind.MAX),
    *[_case(CollectiveKind.ALL_REDUCE, [0, 1], (4, 3), "float32", reduction=r)
      for r in (ReductionKind.SUM, ReductionKind.MAX, ReductionKind.MIN, ReductionKind.PRODUCT,
                ReductionKind.AVERAGE)],
    *[_case(CollectiveKind.ALL_REDUCE, [1], (4, 3), "int32", reduction=r)
      for r in (ReductionKind.BITWISE_AND, ReductionKind.BITWISE_OR, ReductionKind.BITWISE_XOR,
                ReductionKind.SUM)],
    *[_case(CollectiveKind.ALL_REDUCE, [0], (4, 3), "bool", reduction=r)
      for r in (ReductionKind.SUM, ReductionKind.MIN, ReductionKind.MAX)],
    _case(CollectiveKind.PERMUTE, [0, 1], (4, 2), "float32", pairs=((0, 3), (3, 0), (1, 2))),
]  # fmt: skip


def _manifest(tmp_path):
    """A step manifest of collectives alone: case k moves input `x{k}` into `y{k}`."""
    rng = np.random.default_rng(1)
    split = Sharding(((0, 1),))
    devices = list(MESH.devices())
    feed, expected, collectives, inputs = {}, {}, [], []
    for k, (kind, axes, shape, dtype, kw) in enumerate(CASES):
        name = f"x{k}"
        if dtype == "bool":
            array = rng.integers(0, 2, shape).astype(bool)
        else:  # small integers: sums and products are exact in any order
            array = rng.integers(1, 4, shape).astype(dtype)
        feed[name] = array
        regions = device_slices(split, shape, MESH)
        local = {
            d: array[tuple(slice(a, b) for a, b in r)]
            for d, r in zip(devices, regions, strict=True)
        }
        collective = Collective(kind, axes, split, split, shape, 0, **kw)
        result = run_collective(collective, MESH, local)
        expected[f"y{k}"] = [result[d] for d in devices]
        inputs.append({"name": name, "dtype": dtype, "shape": list(shape), "sharding": "[[0, 1]]",
                       "high": None})  # fmt: skip
        collectives.append(
            {"source": name, "target": f"y{k}", **collective.to_json(),
             "groups": [list(g) for g in collective_groups(collective, MESH)],
             "source_shapes": [list(local[d].shape) for d in devices],
             "target_shapes": [list(result[d].shape) for d in devices]}
        )  # fmt: skip
    manifest = {
        "format": "autoshard-steps/1",
        "mesh": {"shape": [2, 2], "axis_names": []},
        "inputs": inputs,
        "weights": [],
        "outputs": [{"name": f"y{k}", "tensor": f"y{k}"} for k in range(len(CASES))],
        "collectives": collectives,
        "devices": [
            {"index": i, "weights": None,
             "inputs": {f"x{k}": [list(r) for r in device_slices(split, CASES[k][2], MESH)[i]]
                        for k in range(len(CASES))},
             "steps": [{"collective": k} for k in range(len(CASES))]}
            for i in range(MESH.size)
        ],
    }  # fmt: skip
    return manifest, feed, expected


def test_every_collective_kind_equals_the_simulator(tmp_path):
    from autoshard.run.launch import launch

    manifest, feed, expected = _manifest(tmp_path)
    gathered = launch(tmp_path, manifest, feed, "gloo", 30.0, [None] * MESH.size)
    for k, (kind, axes, *_rest) in enumerate(CASES):
        for rank, (outputs, _timing) in enumerate(gathered):
            got, want = outputs[f"y{k}"], expected[f"y{k}"][rank]
            assert got.dtype == want.dtype and got.shape == want.shape, (k, kind, rank)
            assert np.array_equal(got, want), (k, kind, axes, rank, got, want)
    timing = gathered[0][1]["collectives"]
    assert timing["all_reduce"]["count"] == 12 and timing["permute"]["count"] == 1


# ---- failures -------------------------------------------------------------------------------


def test_a_bad_weight_file_stops_every_rank_naming_it(tmp_path, capsys):
    out = tmp_path / "out"
    partition_cli(out, "mlp", "2x2", "tensor")
    (out / "weights" / "device-2.safetensors").write_bytes(b"broken")
    capsys.readouterr()
    started = time.monotonic()
    assert cli("run", out) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - started < 30
    assert err.startswith("autoshard: error: rank 2 failed at loading: weight file ")
    assert "does not match the manifest's sha256 (all 4 ranks stopped)" in err
    assert err.count("\n") == 1


def test_a_failing_segment_names_rank_and_step(tmp_path, capsys):
    out = tmp_path / "out"
    partition_cli(out, "mlp", "2", "tensor")
    steps = json.loads((out / "steps.json").read_text())
    step = next(i for i, s in enumerate(steps["devices"][1]["steps"]) if "run" in s)
    # Device 1 asks its segment for a result it does not compute: onnxruntime raises.
    steps["devices"][1]["steps"][step]["outputs"].append("nonexistent")
    (out / "steps.json").write_text(json.dumps(steps))
    capsys.readouterr()
    assert cli("run", out) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"autoshard: error: rank 1 failed at step {step} (segment segments/")


_KILL = """
import os, signal
import autoshard.run.rank as rank

_execute = rank.execute

def execute(folder, manifest, r, feed, collectives, progress=None, sha256=None):
    if r == 1:
        progress[r] = 0
        os.kill(os.getpid(), signal.SIGKILL)
    return _execute(folder, manifest, r, feed, collectives, progress, sha256)

rank.execute = execute
"""


def test_a_killed_rank_ends_the_run_within_seconds(tmp_path):
    out = tmp_path / "out"
    partition_cli(out, "mlp", "2x2", "data")
    # Every rank imports sitecustomize at start: rank 1 kills itself before its first step.
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_KILL)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path / "site"), str(REPO), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "autoshard", "run", str(out), "--timeout", "90"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # Long before its timeout: the ranks' start (torch imported by four processes) takes most
    # of it, and a loaded machine is slower.
    assert time.monotonic() - started < 60
    assert done.returncode == 2, done.stderr
    assert "autoshard: error: rank 1 died at step 0 (" in done.stderr
    assert "killed by SIGKILL (all 4 ranks stopped)" in done.stderr
    leftovers = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True)
    assert leftovers.stdout == ""


LAUNCHER = """import sys

from autoshard.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
"""
"""What pip writes as the `autoshard` script, in short."""


def test_run_from_a_folder_holding_an_autoshard_folder(tmp_path):
    """Run from the parent of a clone: the working directory holds an `autoshard/` folder (here
    one that cannot be imported). The ranks import the autoshard of the command, not that one.
    The command starts as the installed `autoshard` script does: its own folder first on the
    path, not the working directory. The ranks never run the script again (multiprocessing
    would, per rank: `launch.without_main_script`): it runs once, counted in a file."""
    out = tmp_path / "out"
    partition_cli(out, "mlp", "2", "data")
    cwd = tmp_path / "cwd"
    (cwd / "autoshard").mkdir(parents=True)
    (cwd / "autoshard" / "__init__.py").write_text("raise RuntimeError('the wrong autoshard')\n")
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin" / "autoshard-script.py"
    runs = tmp_path / "runs.txt"
    script.write_text(f"open({str(runs)!r}, 'a').write('ran\\n')\n" + LAUNCHER)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, str(script), "run", str(out), "--check", str(model_path("mlp"))],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"ran {out} as 2 processes (gloo): ok\n")
    assert "the wrong autoshard" not in done.stderr
    assert runs.read_text() == "ran\n"


SEEDS = {
    # The MLP of docs/design/lowering.md: mesh [2], x split on its last dim, y reduce-scattered
    # back to it.
    "001": ("2", [
        {"value": "x", "sharding": "[[], [], [0]]"},
        {"value": "y", "sharding": "[[]] partial = sum[0]"},
        {"value": "y", "sharding": "[[], [], [0]]", "for": "users"},
    ], {"all_gather": 1, "all_slice": 1, "reduce_scatter": 1}),
    # The 2-D weight-stationary MLP (docs/design/propagation.md) on 2x2x2 (8 processes). h's
    # all_reduce over [0] stays one all_reduce (split into reduce_scatter + all_gather it would
    # send no fewer bytes); the constant is sliced over [1, 2, 0], a group order unlike torch's
    # rank order.
    "004": ("2x2x2", [
        {"value": "x", "sharding": "[[], [], [0, 1, 2]]"},
        {"value": "h", "sharding": "[[], [], [1, 2]] partial = sum[0]"},
        {"value": "y", "sharding": "[[], [], [0]] partial = sum[1, 2]"},
        {"value": "y", "sharding": "[[], [], [0, 1, 2]]", "for": "users"},
    ], {"all_gather": 1, "all_slice": 1, "all_reduce": 1, "reduce_scatter": 1}),
}  # fmt: skip


@pytest.mark.parametrize("seed", list(SEEDS))
def test_seed_mlps_run_as_separate_processes(tmp_path, capsys, seed):
    from .test_partition import write_seed_mlp

    mesh, annotations, kinds = SEEDS[seed]
    model = write_seed_mlp(tmp_path / "mlp.onnx")
    spec = tmp_path / "annotations.json"
    spec.write_text(json.dumps({"annotations": annotations}))
    out = tmp_path / "out"
    assert cli("partition", model, "--mesh", mesh, "--annotations", spec, "-o", out) == 0
    capsys.readouterr()
    assert cli("run", out, "--check", model, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["outputs"]["y"]["max_rel_err"] <= 1e-5
    for rank in report["timing"]["ranks"]:
        assert {k: v["count"] for k, v in rank["collectives"].items()} == kinds


def test_as_torchrun_workers_a_failing_rank_stops_the_others(tmp_path):
    """The command as torchrun's workers run it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
    rank 0 serves the store): no launcher of ours watches them, so the failing rank's message
    in the store, or the peer it leaves, ends the others long before the collective timeout.
    Two fresh interpreters importing torch: the seconds here are theirs."""
    import socket

    out = tmp_path / "out"
    partition_cli(out, "mlp", "2", "tensor")
    (out / "weights" / "device-1.safetensors").write_bytes(b"broken")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    started = time.monotonic()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "autoshard", "run", str(out), "--timeout", "60"],
            env=dict(
                os.environ,
                PYTHONPATH=path,
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    errors = [rank.communicate(timeout=90)[1] for rank in ranks]
    assert time.monotonic() - started < 30  # not the 60 s collective timeout
    assert ranks[1].returncode == 2, errors
    cause = "rank 1 failed at loading: weight file "
    assert errors[1].startswith(f"autoshard: error: {cause}")
    # Rank 0 stops on the message in the store (exit 1) or on its lost peer (exit 2).
    assert ranks[0].returncode in (1, 2), errors
    assert errors[0].startswith("autoshard: error: rank 0 "), errors


@pytest.mark.parametrize(
    "args, message",
    [
        (lambda out, tmp: [tmp / "nothing"], "is not a partition folder: no manifest.json"),
        (lambda out, tmp: [out, "--check", model_path("cnn")],
         "is not the model this partition was made from"),
        (lambda out, tmp: [out, "--inputs", tmp / "bad.npz"],
         "input 'x' has shape [2, 64]; the partition was made for [4, 64]"),
    ],
)  # fmt: skip
def test_run_errors_are_one_line(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    partition_cli(out, "mlp", "2", "data")
    np.savez(tmp_path / "bad.npz", x=np.zeros((2, 64), np.float32))
    capsys.readouterr()
    assert cli("run", *args(out, tmp_path)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("autoshard: error: ")

"""ZB-H1's backward split as `autoshard run` executes it: each stage's weight-gradient ops
(`W`) as the search priced them, and the entries of each device's step list its `W` pass
runs (the gradient syncs and the update after them, the collectives only they read). The
runs themselves: tests/e2e/test_pipelined_train.py."""

from __future__ import annotations

import json

import pytest

from autoshard.cli.main import main
from autoshard.document.plan_document import read_document
from autoshard.execute.stage_training import training_partition
from autoshard.execute.steps import read_steps
from autoshard.execute.train_verify import segment_nodes
from autoshard.run.stage_device import StageDevice

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """The 4-layer MLP's pp=2,tp=2 training plan under zb-h1 (4 micro-batches), partitioned:
    the stages (rebuilt as `run` does) and their folders."""
    from tests.e2e.test_pipelined_run import SLOW, mlp

    root = tmp_path_factory.mktemp("zbsplit")
    onnx, cluster, plan, out = mlp(root), root / "slow.json", root / "plan.json", root / "out"
    cluster.write_text(json.dumps(SLOW))
    assert main(["plan", str(onnx), "--mesh", "pp=2,tp=2", "--cluster", str(cluster), "--mode",
                 "training", "--precision", "fp32", "--dim", "batch=4", "--schedule", "zb-h1",
                 "--micro-batches", "4", "-q", "-o", str(plan)]) == 0  # fmt: skip
    assert main(["partition", str(onnx), "--plan", str(plan), "-o", str(out)]) == 0
    staged, _ = training_partition(read_document(plan), plan, onnx, {"batch": 4})
    return staged, [out / f"stage-{s}" for s in range(2)]


def test_each_stage_s_weight_gradients_are_those_priced(split):
    """Each layer's dW (`Grad[operand=1]` of its MatMul) and bias gradient, and the embedding's
    and the head's dW, as the step of the whole MLP prices them (test_pipeline_zero_bubble);
    layer 0's input gradient stays in `B` though only the embedding's dW reads it: in the
    priced step the embedding is another part."""
    staged, _ = split
    found = [set(stage.weight_ops) for stage in staged.stages]
    layers = [[0, 1], [2, 3]]
    ends = ["embed@grad1", "head@grad1"]
    assert found == [
        {ends[s], *(f"l{j}.{op}@grad1" for j in layers[s] for op in ("mm", "add"))}
        for s in range(2)
    ]
    assert "l0.mm@grad0" not in found[0]


def _deferred(stage, folder, device):
    steps = read_steps(folder)
    entries = steps["devices"][device]["steps"]
    nodes = segment_nodes(folder, steps)
    runner = StageDevice(stage.built.partitioned, device, entries, stage.built.graph)
    runner.split_backward(stage.weight_ops, nodes)
    items = sorted(runner.weight_items)
    collectives = [steps["collectives"][int(entries[p]["collective"])]["source"]
                   for p, k in items if k < 0]  # fmt: skip
    ops = {nodes[entries[p]["run"]][k][0] for p, k in items if k >= 0}
    return collectives, ops


@pytest.mark.parametrize("device", [0, 1])
def test_the_weight_pass_takes_the_syncs_updates_and_collectives_only_it_reads(split, device):
    """Stage 0 reduce-scatters h0's gradient, which only the embedding's dW reads (nothing
    before it to send back to): `W`. Stage 1 gathers h2 again for layer 2's dW: `W`; it
    reduce-scatters h2's gradient, which it sends back: `B`. Every sync and update reads a
    `W` gradient: `W`; no forward op is."""
    staged, folders = split
    layers = [[0, 1], [2, 3]]
    ends = ["embed", "head"]
    for s, (stage, folder) in enumerate(zip(staged.stages, folders, strict=True)):
        collectives, ops = _deferred(stage, folder, device)
        assert collectives == [["h0@grad0"], ["h2"]][s]
        weights = [ends[s], *(f"{k}{j}" for j in layers[s] for k in "wb")]
        synced = {f"{w}@{what}" for w in weights for what in ("sync", "update")}
        assert ops == set(stage.weight_ops) | synced

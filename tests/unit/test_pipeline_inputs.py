"""A pipeline's inputs: bad ones from `sweep` (a point's row names the culprit in one line,
as `plan` and the REST API do: tests/unit/test_pipesearch.py, tests/api/test_api.py) and a
global batch's (`--global-batch`); the micro-batches the search picks for a global batch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autoshard.annotations import parse_annotate_flag
from autoshard.cli.main import main
from autoshard.cost.cluster import make_cluster
from autoshard.document.plan_document import document_text
from autoshard.pipeline import PlanRequest, plan_request
from autoshard.search.microbatch import GlobalBatch, divisors
from autoshard.search.pipelined import pipeline_ask
from autoshard.training import Training

MODELS = Path(__file__).resolve().parents[2] / "models"
GPT2 = MODELS / "gpt2.onnx"
TRAINING = ["--mode", "training", "--dim", "batch=2", "--dim", "seq=16"]


def _rows(tmp_path, *argv):
    out = tmp_path / "out"
    argv = ["sweep", str(GPT2), "-o", str(out), *argv, "--executor", "local", "--workers", "1",
            "-q"]  # fmt: skip
    assert main(argv) == 0
    return json.loads((out / "points.json").read_text())["points"]


def test_a_sweep_point_with_more_stages_than_layers_is_its_row(tmp_path, capsys):
    (row,) = _rows(tmp_path, "--mesh", "4x1", "--pipeline-axis", "0", *TRAINING)
    assert row["status"] == "error"
    assert row["error"] == (
        "pipeline axis 0 has 4 stages but the model has 2 repeated layers; choose a pipeline "
        "axis of at most 2"
    )


def test_the_micro_batches_are_the_fastest_divisor_of_the_global_batch():
    # The oracle: each divisor m of the global batch 8 planned on its own (micro-batch 8 / m,
    # m micro-batches); the search must keep the fastest and say what the others cost.
    cluster = make_cluster("pp=2,dp=1")
    ask = pipeline_ask(cluster.mesh, None, None)

    def planned(dims, training, batch=None):
        return plan_request(PlanRequest(model_path=GPT2, cluster=cluster, dims=dims,
                                        pipeline=ask, training=training,
                                        global_batch=batch))  # fmt: skip

    alone = {
        m: planned({"batch": 8 // m, "seq": 16}, Training(micro_batches=m)).document.pipeline
        for m in divisors(8)
    }
    steps = {m: block["step_time_s"] for m, block in alone.items()}
    best = min(steps, key=lambda m: steps[m])
    chosen = planned({"seq": 16}, Training(), GlobalBatch("batch", 8)).document
    block = chosen.pipeline
    assert block["micro_batches"] == best
    assert block["step_time_s"] == pytest.approx(steps[best], rel=1e-9)
    assert [c["micro_batches"] for c in block["micro_batches_considered"]] == [1, 2, 4, 8]
    for c in block["micro_batches_considered"]:
        assert c["step_time_s"] == pytest.approx(steps[c["micro_batches"]], rel=1e-9)
    head = f"micro-batches: {best} of global batch batch=8 (micro-batch {8 // best}), chosen over "
    assert chosen.story.startswith(head)
    assert all(f"{m}: " in chosen.story for m in steps if m != best)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--global-batch", "batch=8", "--micro-batches", "3"],
         "--micro-batches 3 does not divide the global batch batch=8 (a micro-batch is the "
         "global batch / micro-batches); choose one of: 1, 2, 4, 8"),
        (["--global-batch", "batch=8", "--dim", "batch=2"],
         "--global-batch batch=8 sets dim batch: drop its --dim"),
        (["--global-batch", "eight"], "--global-batch 'eight' is not DIM=SIZE"),
    ],
)  # fmt: skip
def test_a_global_batch_refused_in_one_line(argv, message, capsys):
    base = ["plan", str(GPT2), "--mesh", "pp=2,dp=1", "--mode", "training", "--dim", "seq=16"]
    assert main([*base, *argv, "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_sweep_of_global_batches(tmp_path):
    # --dim batch=8 read as the global batch: 3 micro-batches do not divide it (the row says
    # so); 2 do (a micro-batch of 4); with a pipeline and none given, the search picks.
    flags = ["--mesh", "2x1", "--pipeline-axis", "0", "--mode", "training", "--dim", "batch=8",
             "--dim", "seq=16", "--global-batch", "batch"]  # fmt: skip
    bad, good = _rows(tmp_path, *flags, "--micro-batches", "3,2")
    assert (bad["status"], good["status"]) == ("error", "ok"), (bad, good)
    assert bad["error"].startswith("--micro-batches 3 does not divide the global batch batch=8")
    (searched,) = _rows(tmp_path / "searched", *flags)
    assert searched["status"] == "ok"
    for row in (good, searched):  # the pipeline's step, over the global batch's tokens
        assert row["strategy"].startswith("micro-batches: " if row is searched else "pipeline")
        tokens = row["tokens_per_s_per_device"] * row["step_time_s"] * row["devices"]
        assert tokens == pytest.approx(8 * 16, rel=1e-9)


def test_a_named_pipeline_builds_no_whole_training_step(monkeypatch):
    # Only the stage model is planned: the whole model's step is built where an annotation is
    # to be checked against its values (a gradient), never else; and the plan is the one
    # made with the whole step at hand (its forward and micro-batches are all it reads).
    import autoshard.pipeline.request as pipeline
    import autoshard.pipeline.stages as stages

    cluster = make_cluster("pp=2,dp=1")
    training, dims = Training(micro_batches=2), {"batch": 2, "seq": 16}
    forward, whole = pipeline.load_graphs(GPT2, dims, training)
    built: list[int] = []
    step = pipeline.training_graph
    for module in (pipeline, stages):  # the step is built where the graphs are imported
        monkeypatch.setattr(
            module, "training_graph", lambda g, *a: built.append(len(g.ops)) or step(g, *a)
        )
    request = PlanRequest(model_path=GPT2, cluster=cluster, dims=dims, training=training,
                          pipeline=pipeline_ask(cluster.mesh, 0, None))  # fmt: skip
    lean = plan_request(request).document
    stood, graph, _ = pipeline._plan_inputs(request)
    assert built == [] and graph is stood and stood.fused == forward.fused
    grad = next(name for name in whole.values if name.endswith("@grad"))
    pinned = dataclasses.replace(request, annotations=(parse_annotate_flag(f"{grad}=[[]]"),))
    assert pipeline._plan_inputs(pinned)[1].values.keys() == whole.values.keys()
    assert built
    built.clear()
    load = pipeline.load_graphs
    monkeypatch.setattr(pipeline, "load_graphs", lambda *a, forward_only=False: load(*a))
    at_hand = plan_request(request).document
    assert built and _untimed(at_hand) == _untimed(lean)


def _untimed(document) -> dict:
    return {k: v for k, v in json.loads(document_text(document)).items() if k != "timing"}

"""A training plan's step time is its program's schedule (`cost.overlap`): the plan document
says what the schedule of the materialized program computes, with the overlap the plan asked
for; nothing overlapped, it is the objective; the objective stays compute plus communication.

The plan: the MLP's two Gemm layers split tensor-parallel on 2x2 (the weights pinned split), so
its collectives are a TP all_gather into the second Gemm and a reduce_scatter out of its
gradient, plus the input's gather: on the critical path unless async TP runs them inside their
matmuls."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autoshard.annotations import parse_annotate_flag
from autoshard.cli.main import main
from autoshard.cost.cluster import make_cluster
from autoshard.cost.overlap import Role, tasks
from autoshard.cost.price import price, served_ops
from autoshard.document.plan_document import PlanDocument
from autoshard.pipeline import PlanRequest, lower_document, plan_request
from autoshard.training import Training
from autoshard.training.options import Overlap

MLP = Path(__file__).resolve().parents[2] / "models" / "mlp.onnx"
PINS = ("x=[[0, 1]]", "0.weight=[[0, 1]]", "2.weight=[[0, 1]]")


def _request(overlap: Overlap) -> PlanRequest:
    return PlanRequest(
        model_path=MLP, cluster=make_cluster("2x2"), dims={"batch": 64},
        annotations=tuple(parse_annotate_flag(p) for p in PINS),
        training=Training.parse(recompute="none", **overlap.to_json()),
    )  # fmt: skip


@pytest.fixture(scope="module")
def planned():
    return {
        name: plan_request(_request(overlap))
        for name, overlap in [("default", Overlap()), ("async", Overlap(async_tp=True)),
                              ("none", Overlap(enabled=False))]
    }  # fmt: skip


def test_the_documents_step_time_is_the_materialized_programs_schedule(planned):
    for name, found in planned.items():
        document = PlanDocument.from_json(json.loads(json.dumps(found.document.to_json())))
        lowered = lower_document(document, MLP)
        assert document.training is not None
        again = price(
            lowered.program, lowered.graph, found.cluster, overlap=document.training.overlap
        )
        assert document.cost is not None and again.schedule is not None
        assert document.cost.step_time_s == again.schedule.step_time_s, name
        assert document.cost.objective == found.planned.cost.objective, name


def test_tp_collectives_sit_on_the_critical_path_unless_async(planned):
    default, fast, serial = (planned[n].planned.cost for n in ("default", "async", "none"))
    assert default.comm_time_s > 0
    assert serial.step_time_s == pytest.approx(serial.objective, rel=1e-12)
    assert default.step_time_s == pytest.approx(default.objective, rel=1e-12)  # all in place
    assert fast.step_time_s < default.step_time_s
    found = planned["async"]
    program, graph = found.planned.program, found.graph
    seconds = [0.0] * len(program.steps)
    roles = [t.role for t in tasks(program, graph, found.cluster, seconds, served_ops(program))
             if hasattr(t, "role")]  # fmt: skip
    assert Role.ASYNC_TP in roles


def test_each_phases_exposed_and_hidden_add_up_to_its_communication(planned):
    cost = planned["async"].planned.cost
    assert cost.schedule is not None
    for name, phase in cost.phases.items():
        ran = cost.schedule.phases[name]
        assert ran.exposed_s + ran.hidden_s == pytest.approx(phase.comm_time_s, abs=1e-15)


def test_overlap_flags_reach_the_plans_training_block(tmp_path, capsys):
    out = tmp_path / "plan.json"
    flags = [a for p in PINS for a in ("--annotate", p)]
    code = main(["plan", str(MLP), "--mesh", "2x2", "--dim", "batch=64", "--mode", "training",
                 "--recompute", "none", "--prefetch", "2", "--bucket-mb", "4", "--async-tp",
                 *flags, "-q", "-o", str(out)])  # fmt: skip
    assert code == 0
    block = json.loads(out.read_text())["training"]
    assert (block["prefetch"], block["bucket_mb"], block["async_tp"], block["overlap"]) == (
        2, 4.0, True, True)  # fmt: skip
    assert "step time (critical path" in capsys.readouterr().out


def test_overlap_flags_without_training_say_so(capsys):
    assert main(["plan", str(MLP), "--mesh", "2x2", "--dim", "batch=8", "--prefetch", "2"]) != 0
    assert "--prefetch plans a training step: add --mode training" in capsys.readouterr().err


def test_a_training_block_from_before_the_schedule_reads_as_the_defaults():
    old = {"optimizer": "adam", "precision": "bf16-mixed", "micro_batches": 1, "recompute": "none"}
    assert Training.parse(**old).overlap == Overlap()
    assert dataclasses.replace(Training(), overlap=Overlap(prefetch=0)).to_json()["prefetch"] == 0


def test_a_bad_bucket_size_is_one_line(capsys):
    args = ["plan", str(MLP), "--mesh", "2x2", "--dim", "batch=8", "--mode", "training"]
    assert main([*args, "--bucket-mb", "-1", "-q"]) == 2
    err = capsys.readouterr().err
    assert err == "autoshard: error: bucket MB must be a finite number >= 0, got -1.0\n"

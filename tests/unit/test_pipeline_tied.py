"""A weight tied across pipeline stages (gpt2_dynamo's token table, also its LM head: read by
the first stage and the last): priced as Megatron runs it, each stage its copy and an
all-reduce of the two gradients before the update, and said in the plan document."""

import dataclasses
from pathlib import Path

import pytest

from autoshard.cost.cluster import make_cluster
from autoshard.cost.price import tied_sync_time
from autoshard.cost.schedule import Pipeline, Schedule, StageTime, simulate
from autoshard.ir.dtypes import numpy_dtype
from autoshard.mesh import Mesh
from autoshard.pipeline import PlanRequest, plan_request
from autoshard.search.pipelined import PipelineAsk, layer_costs, pipeline_ask, price_stages
from autoshard.sharding import Sharding
from autoshard.training import Training
from autoshard.training.options import Optimizer

MODELS = Path(__file__).resolve().parents[2] / "models"
TIED = "lm.lm_head.weight"


def test_the_sum_of_two_copies_is_a_ring_all_reduce_of_two():
    cluster = make_cluster("pp=4,tp=2", bandwidth=["10GB/s", "100GB/s"], latency=["5us", "1us"])
    # Two devices: 2 (n - 1) = 2 latency-bound steps, each sending half of 1 MB on the pp link.
    assert tied_sync_time(10**6, 2, (0,), cluster) == pytest.approx(2 * 5e-6 + 10**6 / 10e9)
    assert tied_sync_time(0, 2, (0,), cluster) == 0.0
    assert tied_sync_time(10**6, 1, (0,), cluster) == 0.0


@pytest.fixture(scope="module")
def planned():
    cluster = make_cluster("pp=2,tp=2", bandwidth=["1GB/s", "100GB/s"], latency=["10us", "1us"])
    ask = pipeline_ask(cluster.mesh, None, "1f1b")
    training = Training(micro_batches=2, optimizer=Optimizer("sgd"))
    dims = {"batch": 2, "seq": 16}
    request = PlanRequest(model_path=MODELS / "gpt2_dynamo.onnx", cluster=cluster, dims=dims,
                          training=training, pipeline=ask)  # fmt: skip
    return cluster, plan_request(request)


def test_the_tied_weight_is_priced_on_both_ends(planned):
    cluster, requested = planned
    block = requested.document.to_json()["pipeline"]
    (tied,) = block["tied"]
    assert tied["weight"] == TIED and tied["stages"] == [0, 1]
    # The gradient as a stage's plan holds it: [512, 64] (bf16-mixed: bfloat16), split or
    # not over tp.
    data = requested.document.to_json()
    held = Sharding.parse(data["values"][f"{TIED}@grad"]["sharding"])
    mesh = Mesh.parse(data["mesh"])
    local = held.local_shape(mesh, (512, 64), next(iter(mesh.devices())))
    sync = tied["sync"]
    size = numpy_dtype(requested.graph.values[f"{TIED}@grad"].dtype).itemsize
    assert sync["bytes_per_device"] == local[0] * local[1] * size
    # A ring all-reduce of two on the pipeline axis's link (1 GB/s, 10 us): 2 steps.
    assert sync["time_s"] == pytest.approx(2 * 10e-6 + sync["bytes_per_device"] / 1e9)
    # Both ends wait for it before their update; the step is the schedule, then the update.
    stages = block["stages"]
    times = [StageTime(s["compute"]["forward_s"], s["compute"]["backward_s"]) for s in stages]
    timeline = simulate(Pipeline(2, 2, Schedule()), times, block["p2p"]["time_s"])
    updates = [s["compute"]["update_s"] for s in stages]
    assert block["step_time_s"] == pytest.approx(timeline.step_s + max(updates))
    # Against the same stages with no tie: each end's update and the step take the sum's
    # time longer, and the last stage holds the second copy (weight, gradient, state).
    costs = layer_costs(requested.graph, requested.planned.plan, requested.planned.program,
                        requested.planned.cost)  # fmt: skip
    ask = PipelineAsk(0, Schedule())
    tied_price = price_stages(costs, cluster, ask, 2, 2)
    untied = price_stages(dataclasses.replace(costs, tied=()), cluster, ask, 2, 2)
    assert tied_price.to_json()["tied"] == block["tied"]
    assert tied_price.step_s - untied.step_s == pytest.approx(sync["time_s"], rel=1e-6)
    pairs = list(zip(tied_price.stages, untied.stages, strict=True))
    for a, b in pairs:
        assert a.update_s - b.update_s == pytest.approx(sync["time_s"], rel=1e-6)
    kept = [a.held_bytes - b.held_bytes for a, b in pairs]
    assert kept == [0, tied["copy_bytes_per_device"]]
    assert tied["copy_bytes_per_device"] >= 2 * sync["bytes_per_device"]  # weight + gradient
    # The story says it.
    assert (f"bubble {round(block['bubble'] * 100)} %; the tied {TIED} held on stages 0 and 1, "
            "its gradients summed after the backward)") in " ".join(
        requested.document.story.split())  # fmt: skip

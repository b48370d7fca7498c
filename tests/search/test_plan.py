"""`autoshard plan` end to end: the plans it finds, against hand plans priced by the same cost
model, executed and compared with onnxruntime."""

import functools
import json
import math
import pickle
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from autoshard.annotations import Annotation
from autoshard.cli.main import main
from autoshard.collectives import ring_bytes
from autoshard.cost.cluster import make_cluster
from autoshard.cost.liveness import memory
from autoshard.cost.price import price
from autoshard.document.plan_document import describe
from autoshard.execute.verify import model_weights, verify
from autoshard.ir.onnx_import import import_onnx
from autoshard.passes.lower import lower
from autoshard.passes.partition import LocalCollective, partition
from autoshard.propagate import propagate
from autoshard.search.baselines import data_parallel, dp_tp, megatron
from autoshard.search.budget import NoPlanFits, auto_plan
from autoshard.search.problem import build_search
from autoshard.search.solver import lowest as lowest_module
from autoshard.search.solver import solve as ilp
from autoshard.search.solver.lowest import lowest_budget
from autoshard.search.solver.outcome import InfeasibleError
from autoshard.sharding import Sharding, ShardingOption

MODELS = Path(__file__).resolve().parents[2] / "models"


def write_mlp(path: Path, tokens: int, hidden: int, ffn: int) -> Path:
    """x [tokens, hidden] -> MatMul w1 -> Relu -> MatMul w2 -> y, float32 weights."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2"),
    ]
    weights = [
        numpy_helper.from_array(rng.standard_normal((hidden, ffn)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((ffn, hidden)).astype(np.float32), "w2"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [tokens, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [tokens, hidden])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """2048 tokens, hidden 1024, FFN 4096: 32 MiB of float32 weights."""
    return write_mlp(tmp_path_factory.mktemp("mlp") / "mlp.onnx", 2048, 1024, 4096)


@pytest.fixture(scope="module")
def small_mlp(tmp_path_factory):
    """256 tokens, hidden 256, FFN 1024: two 1 MiB float32 weights."""
    return write_mlp(tmp_path_factory.mktemp("small_mlp") / "mlp.onnx", 256, 256, 1024)


def collectives(program):
    return [str(s.collective) for s in program.communications]


def sent_by_devices(parts):
    """The most bytes a device sends, from the local shapes of the partitioned program."""
    most = 0
    for device in parts.devices:
        sent = 0
        for step in device.steps:
            if isinstance(step, LocalCollective) and step.group:
                local = math.prod(device.shapes[step.source]) * 4  # float32
                sent += ring_bytes(step.collective.kind, len(step.group), local)
        most = max(most, sent)
    return most


def test_unbounded_memory_gives_data_parallel(mlp):
    planned = auto_plan(import_onnx(mlp), make_cluster(mesh="8"))
    assert {k: str(v) for k, v in planned.plan.options.items()} == {
        "fc1": "[[0]]", "relu": "[[0]]", "fc2": "[[0]]"}  # fmt: skip
    assert collectives(planned.program) == []


def test_a_budget_below_the_replicated_weights_gives_megatron(mlp):
    """32 MiB of weights replicated do not fit 30 MiB: W1 column-split, W2 row-split, one
    all_reduce of y (the 7 MiB ring of a 8 MiB result: 2 * 7/8 * 8 MiB)."""
    planned = auto_plan(import_onnx(mlp), make_cluster(mesh="8", memory="30MiB"))
    plan = planned.plan
    assert (str(plan.values["w1"]), str(plan.values["w2"])) == ("[[], [0]]", "[[0]]")
    assert collectives(planned.program) == ["all_reduce mesh_axes = [0] reduction = sum"]
    assert planned.cost.comm_bytes_per_device == 2 * 7 * 2**20
    assert planned.cost.memory_bytes_per_device <= 30 * 2**20


def test_the_lowest_budget_a_solve_worked_out_is_the_errors(mlp, monkeypatch):
    """Where the relaxation finds no plan, the solve works out the least peak to see whether
    any plan fits; the error names that one, not one worked out again."""
    monkeypatch.setattr(ilp, "dual", lambda problem, **_: None)
    calls = []

    def counted(f, *args, **kwargs):
        calls.append(f.__name__)
        return f(*args, **kwargs)

    # (`budget` imports it where it calls it: the one patched is the one it calls)
    wrapped = functools.partial(counted, lowest_module.lowest_budget)
    monkeypatch.setattr(lowest_module, "lowest_budget", wrapped)
    with pytest.raises(NoPlanFits) as error:
        auto_plan(import_onnx(mlp), make_cluster(mesh="8", memory="16MiB"))
    lowest = error.value.lowest
    assert (lowest.peak, lowest.status) == (22020096, "OPTIMAL")
    assert calls == ["lowest_budget"]


def test_an_infeasible_budget_names_the_lowest_one(mlp):
    """The least memory is Megatron's at the all_reduce of y: the returned y (8 MiB) next to
    the partial y it reduces (8 MiB), the 16 + 16 MiB of weights split 8 ways, and x held
    split 8 ways (gathered before fc1, that buffer gone by then): 21 MiB, proven by the ILP
    whose objective is the peak. The error carries that answer (the benchmarks read it), also
    across processes (the service's workers)."""
    with pytest.raises(NoPlanFits) as error:
        auto_plan(import_onnx(mlp), make_cluster(mesh="8", memory="16MiB"))
    lowest = error.value.lowest
    assert (lowest.peak, lowest.bound, lowest.status) == (22020096, 22020096, "OPTIMAL")
    again = pickle.loads(pickle.dumps(error.value))
    assert isinstance(again, InfeasibleError)
    assert (str(again), again.lowest) == (str(error.value), lowest)
    assert str(error.value) == (
        "infeasible budget: no plan fits 16777216 bytes (16.00 MiB) per device; the lowest "
        "feasible budget is "
        "22020096 bytes (21.00 MiB, proven optimal; --memory 22020096); the largest tensors "
        "live at its peak: y (8.00 MiB), y~1 (8.00 MiB), w1 (2.00 MiB), w2 (2.00 MiB), "
        "x (1.00 MiB)"
    )


def test_plan_command_is_deterministic_and_its_bytes_are_the_programs(mlp, tmp_path, capsys):
    """Two runs write the same bytes up to the wall-clock figures, all in `timing`, the last
    block; the plan's communication bytes are those of the collectives of its partitioned
    program."""
    args = ["plan", str(mlp), "--mesh", "8", "--memory", "30MiB"]
    assert main([*args, "-o", str(tmp_path / "a.json")]) == 0
    assert main([*args, "-o", str(tmp_path / "b.json")]) == 0
    texts = [(tmp_path / f).read_text() for f in ("a.json", "b.json")]
    untimed = [text.split('\n  "timing": ')[0] for text in texts]
    assert untimed[0] == untimed[1] and len(untimed[0]) > 1000
    a, b = (json.loads(text) for text in texts)
    assert list(a)[-1] == "timing" and set(a["timing"]) == {"build_s", "solve_s"}
    assert a["schema"] == "autoshard.plan/1"
    assert set(a["cost"]) >= {"objective", "comm_bytes_per_device", "comm_time_s",
                              "compute_time_s", "memory_bytes_per_device"}  # fmt: skip
    assert set(a["solver"]) == {"status", "objective", "bound", "gap", "variables",
                                "constraints"}  # fmt: skip
    # Per op, what a device spends; they add up to the plan's compute. fc1, column-split 8
    # ways: M 2048, N 512, K 1024 float32, compute-bound at 67e12 · 0.8 · s(M) s(N) s(K).
    ops = a["ops"]
    assert math.fsum(o["compute_s"] for o in ops.values()) == pytest.approx(
        a["cost"]["compute_time_s"], rel=1e-12
    )
    efficiency = 0.8 * (2048 / 2112) * (512 / 576) * (1024 / 1088)
    assert ops["fc1"] == {
        "type": "MatMul", "sharding_option": "[[], [0]]", "flops": 2 * 2048 * 512 * 1024,
        "bytes": (2048 * 1024 + 1024 * 512 + 2048 * 512) * 4,
        "compute_s": pytest.approx(2 * 2048 * 512 * 1024 / (67e12 * efficiency) + 2e-6),
    }  # fmt: skip
    graph = import_onnx(mlp)
    planned = auto_plan(graph, make_cluster(mesh="8", memory="30MiB"))
    parts = partition(planned.program, graph)
    assert a["cost"]["comm_bytes_per_device"] == sent_by_devices(parts)
    out = capsys.readouterr().out
    assert "solver OPTIMAL, gap 0.00%" in out


def test_gpt2_on_4x8_beats_the_hand_plans_and_verifies(tmp_path):
    """GPT-2 on 4x8 under a memory budget: the plan costs no more than data parallel, Megatron
    and DP x TP priced by the same model, and its partition computes what onnxruntime does."""
    model = MODELS / "gpt2.onnx"
    graph = import_onnx(model, {"batch": 32, "seq": 16})
    free = make_cluster(mesh="4x8")
    replicated = price(lower(graph, propagate(graph, free.mesh, data_parallel(graph, free.mesh))),
                       graph, free).memory_bytes_per_device  # fmt: skip
    cluster = make_cluster(mesh="4x8", memory=str(replicated))
    mesh = cluster.mesh
    hand = {
        "dp": data_parallel(graph, mesh, (0, 1)),
        "megatron": megatron(graph, mesh, 1),
        "dp_tp": dp_tp(graph, mesh, 0, 1),
    }
    costs = {}
    for name, annotations in hand.items():
        program = lower(graph, propagate(graph, mesh, annotations))
        cost = price(program, graph, cluster)
        if cost.memory_bytes_per_device <= cluster.memory:
            costs[name] = cost.objective
    assert costs, "no hand plan fits: the budget is wrong"
    planned = auto_plan(graph, cluster)
    assert planned.cost.memory_bytes_per_device <= cluster.memory
    assert planned.cost.objective <= min(costs.values()) * (1 + 1e-9)
    parts = partition(planned.program, graph)
    report = verify(parts, graph, model, model_weights(graph, parts))
    assert report.ok, report.to_json()


def test_partition_of_a_plan_file_verifies(mlp, tmp_path, capsys):
    """plan -o, then partition --plan and verify: the Megatron plan's weights are split (W1 by
    columns, W2 by rows) and the partition computes what onnxruntime does."""
    plan = tmp_path / "plan.json"
    out = tmp_path / "out"
    assert main(["plan", str(mlp), "--mesh", "8", "--memory", "30MiB", "-o", str(plan)]) == 0
    assert main(["partition", str(mlp), "--mesh", "8", "--plan", str(plan), "-o", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["bytes_per_device"] == json.loads(plan.read_text())["cost"][
        "comm_bytes_per_device"]  # fmt: skip
    capsys.readouterr()
    assert main(["verify", str(out), "--model", str(mlp), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["devices"] == 8
    assert main(["partition", str(mlp), "--mesh", "4", "--plan", str(plan), "-o", str(out)]) == 2
    assert "is for mesh 8, not 4" in capsys.readouterr().err


def test_weights_held_split_further_than_read(small_mlp):
    """FSDP by hand on 2x4 (x and y batch-split on axis 0, both weights held split 8 ways and
    gathered whole before use) holds 2 MiB at its peak, fc2: w2 gathered (1 MiB), the 512 KiB
    half of r, the 128 KiB halves of x (an input: held throughout) and y, and the two 128 KiB
    weight shards. Under that budget the search finds a plan no dearer; at the least memory
    any plan needs it holds w1 split over both axes while fc1 reads it split over one (an
    all_gather before fc1), and the ILP's peak is the program's."""
    graph = import_onnx(small_mlp)
    S = Sharding.parse
    io = [Annotation("x", S("[[0]]")), Annotation("y", S("[[0]]"))]
    fsdp = [*io, Annotation("w1", S("[[0, 1]]")), Annotation("w2", S("[[0, 1]]"))]
    cluster = make_cluster(mesh="2x4")
    # The ops' options fixed: propagation alone would read the weights split, moving fewer bytes.
    batch = {fc: ShardingOption.parse("[[0]]", 3) for fc in ("fc1", "fc2")}
    hand = lower(graph, propagate(graph, cluster.mesh, [*fsdp, Annotation("h", S("[[0]]"))], batch))
    assert memory(hand).peak == 2 * 2**20
    assert collectives(hand) == ["all_gather mesh_axes = [0, 1] gather_axis = 0"] * 2
    planned = auto_plan(graph, make_cluster(mesh="2x4", memory="2MiB"), io)
    assert planned.cost.memory_bytes_per_device <= 2 * 2**20
    assert planned.cost.objective <= price(hand, graph, cluster).objective
    search = build_search(graph, cluster, io)
    least = lowest_budget(search.problem)
    assert least.status == "OPTIMAL" and least.peak < 2 * 2**20
    tight = auto_plan(graph, make_cluster(mesh="2x4", memory=str(least.peak)), io)
    held, read = tight.plan.values["w1"], tight.plan.needs[("fc1", 1)]
    used = {a for axes in read.split_axes for a in axes}
    assert used < {a for axes in held.split_axes for a in axes}
    entry = describe(tight.plan, graph)["values"]["w1"]  # the plan document says both
    assert (entry["sharding"], entry["read_as"]) == (held.text(2), {"fc1": read.text(2)})
    assert memory(tight.program).peak == least.peak
    assert tight.search.problem.peak(tight.solution.choice) == least.peak


def test_a_dgx_h100_plan_prices_axis_0_on_the_network_and_axis_1_on_nvlink(mlp, tmp_path):
    """4x8 on the dgx-h100 preset, 8 MiB per device: the plan gathers over both axes and
    all_reduces over axis 1. Each collective's time is its ring steps times the latency plus its
    bytes over the bandwidth of its axis: 5 us and 50 GB/s across the 4 nodes (axis 0), 1 us
    and 450 GB/s in a node (axis 1)."""
    out = tmp_path / "plan.json"
    args = ["plan", str(mlp), "--mesh", "4x8", "--cluster", "dgx-h100", "--memory", "8MiB"]
    assert main([*args, "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    links = {0: (50e9, 5e-6, 4), 1: (450e9, 1e-6, 8)}  # bandwidth, latency, devices
    steps = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "all_reduce": 2}
    expected: dict[str, float] = {}
    for c in plan["collectives"]:
        if c["bytes_per_device"]:
            ((axis,),) = [c["mesh_axes"]]
            bandwidth, latency, n = links[axis]
            seconds = steps[c["kind"]] * (n - 1) * latency + c["bytes_per_device"] / bandwidth
            expected[f"[{axis}]"] = expected.get(f"[{axis}]", 0.0) + seconds
    assert set(expected) == {"[0]", "[1]"}
    for axes, seconds in expected.items():
        assert plan["cost"]["comm_by_mesh_axes"][axes]["time_s"] == pytest.approx(seconds)
    assert plan["cluster"]["bandwidth_bytes_per_s"] == [50e9, 450e9]

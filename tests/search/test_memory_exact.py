"""The ILP's memory is the program's memory: for every plan the search makes, the peak its
memory rows count is the lowered program's peak, byte for byte (`search.memory`)."""

import importlib.util
import itertools
import math
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from autoshard.cost.cluster import make_cluster
from autoshard.cost.liveness import memory
from autoshard.errors import ShardingError
from autoshard.ir.onnx_import import import_onnx
from autoshard.passes.materialize import materialize
from autoshard.pipeline import load_graph
from autoshard.search.budget import _chains, auto_plan
from autoshard.search.memory.build import _Liveness
from autoshard.search.problem import build_search
from autoshard.search.solver.lowest import lowest_budget
from autoshard.search.solver.outcome import InfeasibleError, SolverStatus
from autoshard.training import Attention, Training

MODELS = Path(__file__).resolve().parents[2] / "models"
DIMS = {
    "mlp": {"batch": 8},
    "cnn": {"batch": 8},
    "gpt2": {"batch": 8, "seq": 128},
    "gpt2_dynamo": {"batch": 8, "seq": 128},
    "bert": {"batch": 8, "seq": 128},
}


def _plans_under_budgets(graph, mesh: str, fractions=(1.0, 0.6, 0.3), lowest=True) -> list:
    """The plans unbounded, at `fractions` of the unbounded plan's peak and at the lowest
    feasible budget (a budget below the lowest answers infeasible)."""
    free = auto_plan(graph, make_cluster(mesh=mesh))
    top = memory(free.program).peak
    least = (
        lowest_budget(build_search(graph, make_cluster(mesh=mesh)).problem).peak if lowest else 0
    )
    plans = [free]
    for budget in [int(f * top) for f in fractions] + ([least] if lowest else []):
        try:
            plans.append(auto_plan(graph, make_cluster(mesh=mesh, memory=str(budget))))
        except InfeasibleError:
            assert budget < least
    return plans


def _assert_counted_is_held(plans) -> None:
    for planned in plans:
        counted = planned.search.problem.peak(planned.solution.choice)
        assert counted == memory(planned.program).peak <= planned.search.problem.budget


@pytest.mark.parametrize(
    ("model", "mesh"),
    [
        ("mlp", "2x4"),
        ("mlp", "4x8"),
        ("cnn", "2x4"),
        ("cnn", "4x8"),
        ("gpt2", "2x4"),
    ],
)
def test_the_ilp_peak_is_the_program_peak_under_every_budget(model, mesh):
    """Unbounded, at 100 %, 60 % and 30 % of the unbounded plan's peak and at the lowest
    feasible budget: each plan's counted peak is its program's."""
    graph = import_onnx(MODELS / f"{model}.onnx", DIMS[model])
    plans = _plans_under_budgets(graph, mesh)
    assert len(plans) >= 3
    _assert_counted_is_held(plans)


@pytest.mark.parametrize("model", ["gpt2_dynamo", "bert"])
def test_the_ilp_peak_is_the_program_peak_of_the_larger_models(model):
    """The larger exports on 2x4, unbounded and at 100 % of the unbounded plan's peak (the
    budgets that bind: `bench/plan_memory.py`)."""
    graph = import_onnx(MODELS / f"{model}.onnx", DIMS[model])
    _assert_counted_is_held(_plans_under_budgets(graph, "2x4", (1.0,), lowest=False))


def test_a_value_read_after_its_last_use_from_a_buffer_made_earlier_is_counted_exactly():
    """bert on 4x8 at 673,315 bytes: the embeddings' LayerNorm output is read by the query
    MatMul resharded, by key and value as held, and by the attention's residual Add from the
    query's buffer: its home is dead after the value MatMul, and the rows say so (rows
    counting it to the Add count more than the program holds). The plan the exact rows allow
    is cheaper than the one the conservative rows found (its program holds 554,449 bytes),
    whose choices priced by today's objective come to 437,442,362."""
    graph = import_onnx(MODELS / "bert.onnx", DIMS["bert"])
    planned = auto_plan(graph, make_cluster(mesh="4x8", memory="673315"))
    _assert_counted_is_held([planned])
    assert memory(planned.program).peak == 667_793
    assert planned.solution.status is SolverStatus.OPTIMAL
    assert planned.solution.objective < 437_442_362


@pytest.mark.parametrize(
    ("model", "budgets", "attention"),
    [("mlp", (1.0, 0.6), None), ("gpt2", (1.0,), None), ("gpt2", (1.0, 0.5), Attention.FUSED)],
)
def test_the_ilp_peak_is_the_program_peak_of_a_training_step(model, budgets, attention):
    """A training step on 2x4 (weights gathered for the forward and again for the backward,
    gradients, Adam's state written over by the update): unbounded and under budgets. With
    fused attention the values inside a core are held as the kernel holds them, in both."""
    path = MODELS / f"{model}.onnx"
    dims = {"batch": 8, "seq": 32} if model == "gpt2" else {"batch": 8}
    graph = load_graph(path, dims, Training(attention=attention))
    assert bool(graph.fused) == (attention is Attention.FUSED)
    free = auto_plan(graph, make_cluster(mesh="2x4"))
    top = memory(free.program).peak
    plans = [free] + [
        auto_plan(graph, make_cluster(mesh="2x4", memory=str(int(top * f)))) for f in budgets
    ]
    _assert_counted_is_held(plans)


@pytest.mark.parametrize(
    ("model", "mesh"),
    [("mlp", "2"), ("mlp", "2x2"), ("mlp", "2x2x2"), ("cnn", "2"), ("cnn", "2x2")],
)
def test_the_rows_of_any_plan_are_its_program(model, mesh):
    """Random plans (any choice per group), their reshards of several collectives counted:
    the rows' peak is the program's, byte for byte (a slot per reshard step, per operand)."""
    graph = import_onnx(MODELS / f"{model}.onnx", {"batch": 8})
    cluster = make_cluster(mesh=mesh)
    assert_random_plans_are_their_programs(graph, cluster, build_search(graph, cluster), 12)


def test_the_rows_of_any_plan_of_a_fused_training_step_are_its_program():
    """Random plans of GPT-2's training step with fused attention: the values inside a core
    (held as nothing, or as row statistics) count in the rows as in the program."""
    graph = load_graph(MODELS / "gpt2.onnx", {"batch": 4, "seq": 16}, Training(
        attention=Attention.FUSED))  # fmt: skip
    cluster = make_cluster(mesh="2x2")
    assert_random_plans_are_their_programs(graph, cluster, build_search(graph, cluster), 6)


def _decoder(layers: int, folder: Path, monkeypatch) -> Path:
    """A small shape-only decoder (grouped-query attention, as the large decoders') of
    `layers` layers, written to `folder`."""
    spec = importlib.util.spec_from_file_location("make_models", MODELS / "make_models.py")
    assert spec is not None and spec.loader is not None
    make_models = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "make_models", make_models)  # its dataclasses look it up
    spec.loader.exec_module(make_models)
    built = make_models.build_decoder_shape_only(
        layers, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256
    )
    path = folder / f"decoder_{layers}.onnx"
    onnx.save(built.proto, path)
    return path


def test_the_rows_of_any_plan_of_a_deep_decoder_are_its_program(tmp_path, monkeypatch):
    """A decoder of six layers: each layer's memory terms are made once and replayed at every
    copy's steps (the layers' values read at other steps each), so random plans' rows must be
    their programs', layer by layer."""
    graph = import_onnx(_decoder(6, tmp_path, monkeypatch), {"batch": 2, "seq": 16})
    cluster = make_cluster(mesh="2x2")
    search = build_search(graph, cluster)
    assert search.repeats.count == 6
    assert_random_plans_are_their_programs(graph, cluster, search, 4)


def test_a_deep_decoders_training_step_is_recorded_once_per_kind_of_layer(tmp_path, monkeypatch):
    """A training step returns each layer's updated weights and states at outputs of their
    own: named from their own output's slots, the copies' terms are recorded once, as the
    layers' activations are (the values recorded do not grow with the depth)."""
    recorded: list[str] = []
    record = _Liveness.record
    monkeypatch.setattr(
        _Liveness,
        "record",
        lambda self, r, name, *a: recorded.append(name) or record(self, r, name, *a),
    )
    cluster = make_cluster(mesh="2x2")
    counts = []
    for layers in (2, 3):
        path = _decoder(layers, tmp_path, monkeypatch)
        graph = load_graph(path, {"batch": 2, "seq": 16}, Training())
        recorded.clear()
        build_search(graph, cluster)
        counts.append(len(recorded))
    assert any(name.endswith("@next") for name in recorded)
    assert counts[0] == counts[1]


def test_a_deep_decoders_training_rows_are_its_programs(tmp_path, monkeypatch):
    """Random plans of the 3-layer decoder's training step (updated weights and states
    recorded once per kind of layer): their rows are their programs'."""
    graph = load_graph(_decoder(3, tmp_path, monkeypatch), {"batch": 2, "seq": 16}, Training())
    cluster = make_cluster(mesh="2x2")
    assert_random_plans_are_their_programs(graph, cluster, build_search(graph, cluster), 2)


def assert_random_plans_are_their_programs(graph, cluster, search, count):
    """Random plans (any choice per group), their reshards of several collectives counted:
    the rows' peak is the program's."""
    for choice, chains, program in random_plans(graph, cluster, search, count):
        counting = search.counting(search.chains | chains)
        assert counting.problem.peak(choice) == memory(program).peak


def random_plans(graph, cluster, search, count):
    """`count` random plans (any choice per group the problem allows, seeded): each choice,
    its reshards of several collectives and its program (`legal_choice`)."""
    rng, drawn = np.random.default_rng(0), []
    for _ in range(100 * count):
        choice = legal_choice(search.problem, rng)
        if choice is None:
            continue
        plan = search.plan(graph, cluster, choice)
        drawn.append((choice, _chains(graph, plan), materialize(graph, plan)))
        if len(drawn) == count:
            return drawn
    raise AssertionError(f"{len(drawn)} of {count} random plans drawn legal")


def legal_choice(problem, rng) -> list[int] | None:
    """A choice per group, drawn in group order among those the problem allows next to the
    groups drawn before (none priced at the forbidden cost: a read no reshard makes, such as
    a whole value read as partial sums, or a shared reshard's pair no plan takes); None at a
    dead end. Where nothing is forbidden, the uniform draw of `rng.integers(0, n)` per group."""
    forbid = _forbidden_cost(problem)
    before: dict[int, list[tuple[int, np.ndarray]]] = {}  # (earlier group, cells[its, ours])
    for a, b, m in problem.edges:
        cells = np.array(m) >= forbid
        before.setdefault(max(a, b), []).append((min(a, b), cells if a < b else cells.T))
    choice: list[int] = []
    for g in range(len(problem.sizes)):
        ok = np.array(problem.node_costs[g]) < forbid
        for h, cells in before.get(g, ()):
            ok &= ~cells[choice[h]]
        allowed = np.flatnonzero(ok)
        if not len(allowed):
            return None
        choice.append(int(allowed[rng.integers(0, len(allowed))]))
    return choice


def _forbidden_cost(problem) -> float:
    """The cost of a forbidden cell: one more than the most any plan costs otherwise (the
    largest cell where the other cells' largest add up to one less; infinite where none)."""
    rows = [list(r) for r in problem.node_costs] + [np.array(m).ravel().tolist()
                                                    for _, _, m in problem.edges]  # fmt: skip
    top = max((max(r, default=0) for r in rows), default=0)
    rest = sum(max((c for c in r if c < top), default=0) for r in rows)
    return top if top == 1 + rest else np.inf


def write_partial_reshape(path: Path) -> Path:
    """x [8, 16] @ w [16, 8] -> y; y flattened to r [64] (a Reshape, which may move partial
    sums); Relu(r) -> z."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")
    shape = numpy_helper.from_array(np.array([64], np.int64), "shape")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
        helper.make_node("Reshape", ["y", "shape"], ["r"], name="flat"),
        helper.make_node("Relu", ["r"], ["z"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "partial_reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [64])],
        [w, shape],
    )
    onnx.save(helper.make_model(graph), path)
    return path


def test_a_partial_sum_moved_through_a_reshape_is_counted_as_the_program_holds_it(tmp_path):
    """On 2 devices, every choice of the partial-reshape graph: the problem forbids exactly
    the plans `materialize` cannot lower (the Reshape reading as partial sums a y held whole
    or split: no reshard makes it), random legal draws never take one, and every other plan's
    rows are its program's. The one that splits the MatMul's contraction holds y partial, the
    Reshape moves the partial sums to r and the Relu reads r all-reduced: x 256 + w 256 (split
    on 0) + shape 8 + y 256 (partial) + r 256 at the Reshape = 1032 B, y freed after it;
    r~1 256 and z 256 replace r and r~1 later, never more."""
    graph = import_onnx(write_partial_reshape(tmp_path / "partial_reshape.onnx"))
    cluster = make_cluster(mesh="2")
    search = build_search(graph, cluster)
    problem, forbid = search.problem, _forbidden_cost(search.problem)
    decisions = {**search.grouping.ops, **search.grouping.values}
    assert [str(c) for c in decisions["flat"].picked][2] == "[[]] partial = sum[0]"
    lowered = {}
    for choice in itertools.product(*map(range, problem.sizes)):
        try:
            lowered[choice] = materialize(graph, search.plan(graph, cluster, list(choice)))
        except ShardingError:
            assert problem.objective(choice) >= forbid
            continue
        assert problem.objective(choice) < forbid
        assert problem.peak(choice) == memory(lowered[choice]).peak
    partial = [c for c in lowered if c[decisions["flat"].group] == 2]
    assert {c[decisions["mm"].group] for c in partial} == {3}  # the contraction split
    assert len(lowered) < math.prod(problem.sizes)
    rng = np.random.default_rng(0)
    assert all(tuple(legal_choice(problem, rng)) in lowered for _ in range(50))
    wanted = {"mm": 3, "flat": 2, "x": 2, "w": 2, "shape": 0}
    choice = [0] * len(problem.sizes)
    for name, k in wanted.items():
        choice[decisions[name].group] = k
    assert [str(decisions[n].picked[k]) for n, k in wanted.items()] == [
        "[[], [], [0]]", "[[]] partial = sum[0]", "[[], [0]]", "[[0]]", "[[]]"]  # fmt: skip
    assert problem.peak(choice) == memory(lowered[tuple(choice)]).peak == 1032


def write_fanout(path: Path) -> Path:
    """x [64, 64] -> Relu -> r; r read by three MatMuls (r @ w1, r @ w2, r @ w3) and an Add
    (r + the last MatMul's result): r's readers may share one reshard of it."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), f"w{i}")
        for i in (1, 2, 3)
    ]
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w1"], ["a"], name="mm1"),
        helper.make_node("MatMul", ["r", "w2"], ["b"], name="mm2"),
        helper.make_node("Add", ["a", "b"], ["c"], name="ab"),
        helper.make_node("MatMul", ["c", "w3"], ["d"], name="mm3"),
        helper.make_node("Add", ["d", "r"], ["y"], name="residual"),
    ]
    graph = helper.make_graph(
        nodes,
        "fanout",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])],
        weights,
    )
    onnx.save(helper.make_model(graph), path)
    return path


@pytest.mark.parametrize("mesh", ["2", "2x2"])
def test_a_value_read_by_several_ops_is_counted_as_the_program_holds_it(tmp_path, mesh):
    """The fan-out graph: the plans under budgets from unbounded down to the lowest count
    their program's peak exactly."""
    graph = import_onnx(write_fanout(tmp_path / "fanout.onnx"))
    cluster = make_cluster(mesh=mesh)
    top = memory(auto_plan(graph, cluster).program).peak
    least = lowest_budget(build_search(graph, cluster).problem).peak
    assert least < top
    for budget in (top, (top + least) // 2, least):
        planned = auto_plan(graph, make_cluster(mesh=mesh, memory=str(budget)))
        counted = planned.search.problem.peak(planned.solution.choice)
        assert counted == memory(planned.program).peak <= budget


def _under_counted(mesh: str, tmp_path: Path, tries: int) -> list[tuple[int, int]]:
    """(counted, held) of the random plans of the fan-out graph whose rows, counting the
    reshards of several collectives each makes, count less than its program holds."""
    graph = import_onnx(write_fanout(tmp_path / "fanout.onnx"))
    cluster = make_cluster(mesh=mesh)
    search = build_search(graph, cluster)
    found = []
    for choice, chains, program in random_plans(graph, cluster, search, tries):
        counted = search.counting(search.chains | chains).problem.peak(choice)
        held = memory(program).peak
        if counted < held:
            found.append((counted, held))
    return found


def test_a_reshard_counted_counts_every_way_to_its_target(tmp_path):
    """Counting the intermediates of one reshard of several collectives counts them for every
    held sharding resharded so to the same target: random plans of the fan-out graph on 2x2,
    the rows counting one reshard per target among theirs, count at least what each program
    holds (rows counting reshards a plan does not make may count more: conservative).
    Counted only as made (shape, dtype, held, target), a plan whose weight is held [[1], [0]]
    where the plan before held it [[0], [1]], both gathered to [[]], would go over the budget
    again and cost one more solve."""
    graph = import_onnx(write_fanout(tmp_path / "fanout.onnx"))
    cluster = make_cluster(mesh="2x2")
    search = build_search(graph, cluster)
    plans = random_plans(graph, cluster, search, 60)
    made = set().union(*(chains for _, chains, _ in plans))
    one_way = {(shape, dtype, target): (shape, dtype, held, target)
               for shape, dtype, held, target in sorted(made, key=str)}  # fmt: skip
    assert len(one_way) < len(made)
    counting = search.counting(frozenset(one_way.values()))
    for choice, _, program in plans:
        assert counting.problem.peak(choice) >= memory(program).peak


@pytest.mark.parametrize("mesh", ["2", "2x2"])
def test_no_plan_holds_more_than_its_rows_count(tmp_path, mesh):
    """Any plan, solved or not (random choices): its rows bound its program's peak. On 2x2
    some gather r in two steps for mm1 ([[1], [0]] -> [[], [0]] -> [[]]) and keep the middle
    tensor for a later reader: the residual Add reading [[], [0]], or mm2's reshard to
    [[0]] starting from it; it is live from mm1's reshard to that reader."""
    assert _under_counted(mesh, tmp_path, 200) == []


def write_reuse(path: Path) -> Path:
    """y = Relu(x) [64, 32] read by mm1 (y @ w1) and, after mm3 and mm4 (x @ w3 @ w4, a
    [64, 64] result between them), by mm2 (y @ w2)."""
    shapes = {"x": [64, 32], "w1": [32, 4], "w2": [32, 4], "w3": [32, 64], "w4": [64, 4]}
    nodes = [
        helper.make_node("Relu", ["x"], ["y"], name="relu"),
        helper.make_node("MatMul", ["y", "w1"], ["a"], name="mm1"),
        helper.make_node("MatMul", ["x", "w3"], ["c"], name="mm3"),
        helper.make_node("MatMul", ["c", "w4"], ["e"], name="mm4"),
        helper.make_node("MatMul", ["y", "w2"], ["b"], name="mm2"),
    ]
    graph = helper.make_graph(
        nodes,
        "reuse",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [64, 4]) for n in "abe"],
    )
    onnx.save(helper.make_model(graph), path)
    return path


def test_a_reshard_started_from_its_first_steps_buffer_reads_no_home(tmp_path):
    """On 2x2, y held [[], [0, 1]] is read by mm1 as [[1], [0]] (an all-to-all) and by mm2
    as [[1]], whose reshard passes [[1], [0]] first: `materialize` starts it from mm1's
    buffer, so y's home is dead after mm1's reshard, not live to mm2's (the 3-layer
    decoder's training step: each layer's k and v projection weights, read so by the
    backward and by the update, were counted 6144 B more). The peak, at mm3: x 2048 + w1
    256 (split on 0) + w2 512 + w3 8192 + w4 1024 + y~1 2048 + a 512 (partial, split on 1)
    + x gathered 8192 + c 16384 = 39168 B; counting y's home there too, 41216."""
    graph = import_onnx(write_reuse(tmp_path / "reuse.onnx"))
    cluster = make_cluster(mesh="2x2")
    search = build_search(graph, cluster)
    wanted = {"relu": "[[], [0, 1]]", "mm1": "[[1], [], [0]]", "mm2": "[[1]]", "mm3": "[[]]",
              "mm4": "[[]]", "x": "[[], [0, 1]]", "w1": "[[0]]", "w2": "[[]]", "w3": "[[]]",
              "w4": "[[]]"}  # fmt: skip
    choice = [0] * len(search.problem.sizes)  # the shared reshards' groups: no bytes of theirs
    for name, decision in [*search.grouping.ops.items(), *search.grouping.values.items()]:
        choice[decision.group] = [str(c) for c in decision.picked].index(wanted[name])
    plan = search.plan(graph, cluster, choice)
    program = materialize(graph, plan)
    y_reads = [s for s in program.steps if "y" in s.inputs]
    assert [s.target for s in y_reads] == ["y~1"]  # mm2's reshard starts from y~1
    counting = search.counting(search.chains | _chains(graph, plan))
    assert counting.problem.peak(choice) == memory(program).peak == 39168

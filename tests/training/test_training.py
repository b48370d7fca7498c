"""Training mode: the backward derived from the forward rules, gradient sync to the storage
sharding, the optimizer's state, and what a training step costs, against hand counts."""

import dataclasses
import itertools
import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from autoshard.annotations import Annotation
from autoshard.cli.main import main
from autoshard.collectives import CollectiveKind, ring_bytes
from autoshard.cost.cluster import make_cluster
from autoshard.cost.compute import op_flops
from autoshard.cost.liveness import memory
from autoshard.document.plan_document import read_document
from autoshard.explain.report import plan_markdown
from autoshard.ir.graph import Graph
from autoshard.ir.onnx_import import import_onnx
from autoshard.passes.lower import lower
from autoshard.pipeline import load_graph
from autoshard.rules import IteratorType, rule_for
from autoshard.rules.gradient import computed_with
from autoshard.search.budget import auto_plan
from autoshard.search.candidates import option_reads, option_writes
from autoshard.search.problem import Search, build_search
from autoshard.search.solver.solve import solve
from autoshard.sharding import Sharding, ShardingOption
from autoshard.training import Training, TrainingError, training_graph
from autoshard.training.buffers import buffers_text
from tests.golden.seed_models import write_seed_mlp
from tests.search.test_ilp import brute_force
from tests.search.test_plan import write_mlp
from tests.unit.onnx_factory import F32, model, rng_weight, tensor

MODELS = Path(__file__).resolve().parents[2] / "models"
T, H, F = 64, 32, 128  # tokens, hidden, FFN of the MLP x -> fc1 -> relu -> fc2 -> y
P = 2 * H * F  # parameters


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    return write_mlp(tmp_path_factory.mktemp("mlp") / "mlp.onnx", T, H, F)


@pytest.fixture(scope="module")
def step(mlp):
    return training_graph(import_onnx(mlp), Training())


def _op(graph, name):
    return graph.op_by_name[name]


# ---- the backward, derived from the forward rules ---------------------------------------------


def test_the_step_of_an_mlp(step):
    """Gradients of the weights and of the activations on their path (not of the input x);
    a gradient op reads only what it needs; each weight's gradient is synchronized as soon as
    complete; the updates come last and replace the weights and their state."""
    assert [str(op) for op in step.ops[3:]] == [
        "y@grad0 = autoshard.train.LossGrad(y)",
        "r@grad0 = autoshard.train.Grad(, w2, y@grad0)",
        "w2@grad0 = autoshard.train.Grad(r, , y@grad0)",
        "w2@grad = autoshard.train.GradSync(w2@grad0)",
        "h@grad0 = autoshard.train.Grad(h, r@grad0)",
        "w1@grad0 = autoshard.train.Grad(x, , h@grad0)",
        "w1@grad = autoshard.train.GradSync(w1@grad0)",
        "w1@next, w1@state_next = autoshard.train.Update(w1@grad, w1, w1@state)",
        "w2@next, w2@state_next = autoshard.train.Update(w2@grad, w2, w2@state)",
    ]
    assert step.updates == {
        "w1@next": "w1", "w1@state_next": "w1@state",
        "w2@next": "w2", "w2@state_next": "w2@state",
    }  # fmt: skip
    # bf16-mixed Adam: bf16 weights and activations, three fp32 planes of state.
    assert step.values["h"].dtype == step.values["w1"].dtype == "bfloat16"
    assert step.values["w1@state"].shape == (3, H, F)
    assert step.values["w1@state"].dtype == "float32"
    assert [step.phase(op.name) for op in step.ops[-3:]] == [
        "gradient_sync", "optimizer", "optimizer",
    ]  # fmt: skip


def test_gradient_rules_sum_over_the_loops_their_operand_lacks(step):
    """fc1 = x[T, H] · w1[H, F], loops (m, n, k): dW sums over m (partial over the batch's
    axes: the data-parallel sync), dX over n (Megatron's column-parallel all_reduce)."""
    forward = rule_for(_op(step, "fc1"), step)
    assert [loop.kind for loop in forward.loops] == ["parallel", "parallel", "reduction"]
    d_w = rule_for(_op(step, "fc1@grad1"), step)
    assert [loop.kind for loop in d_w.loops] == ["reduction", "parallel", "parallel"]
    d_r = rule_for(_op(step, "fc2@grad0"), step)
    assert [loop.kind for loop in d_r.loops] == ["parallel", "reduction", "parallel"]
    batch_split = ShardingOption(((0,), (), ()))
    assert d_w.result_sharding(batch_split, 0) == Sharding(((), ()), (0,))
    feature_split = ShardingOption(((), (0,), ()))
    assert d_r.result_sharding(feature_split, 0) == Sharding(((), ()), (0,))
    assert d_r.result_sharding(batch_split, 0) == Sharding(((0,), ()))
    relu = rule_for(_op(step, "relu@grad0"), step)
    assert all(loop.kind is IteratorType.PARALLEL for loop in relu.loops)


def test_backward_flops_come_from_the_gradient_ops_loops(step):
    """A contraction costs 2x its forward when both operands need a gradient (fc2), 1x when one
    is an input (fc1: no dx)."""
    mesh = make_cluster(mesh="8").mesh
    option = ShardingOption(((0,), (), ()))

    def flops(name):
        op = _op(step, name)
        return op_flops(op, rule_for(op, step), option, step, mesh)

    matmul = 2 * (T // 8) * H * F
    assert flops("fc1") == flops("fc2") == matmul
    backward = [op.name for op in step.ops if op.attr("op") in ("fc1", "fc2")]
    assert backward == ["fc2@grad0", "fc2@grad1", "fc1@grad1"]
    assert sum(flops(name) for name in backward) == 3 * matmul


# ---- plans against hand counts ----------------------------------------------------------------

# Data parallel pinned whole: priced as the program makes it (a reshard once for all its
# readers), gathering relu's output r and running the second layer replicated beats DDP on
# this small MLP.
_DP = [
    Annotation("x", Sharding(((0,), ()))),
    Annotation("x", Sharding(((0,), ())), for_users=True),
    Annotation("r", Sharding(((0,), ())), for_users=True),
    *(Annotation(name, Sharding()) for name in ("w1", "w2", "w1@grad", "w2@grad")),
    *(Annotation(name, Sharding()) for name in ("w1@next", "w2@next")),
]


def test_data_parallel_adam_by_hand(step):
    """Mesh 8, x split on its batch, every weight replicated (DDP): one all_reduce of each
    gradient, 2 (n-1)/n of its bf16 bytes; per device 16 bytes per parameter plus, at the peak
    (the first layer's gradient synchronized), the all_reduce's result beside its input, and
    x's shard."""
    cluster = make_cluster(mesh="8")
    planned = auto_plan(step, cluster, _DP)
    moved = [(c.source, c.collective.kind) for c in planned.program.communications]
    assert moved == [
        ("w2@grad0", CollectiveKind.ALL_REDUCE), ("w1@grad0", CollectiveKind.ALL_REDUCE),
    ]  # fmt: skip
    w = H * F * 2  # bf16 bytes of one weight
    sync = 2 * ring_bytes(CollectiveKind.ALL_REDUCE, 8, w)
    assert sync == 2 * (2 * 7 * w // 8)
    assert planned.cost.comm_bytes_per_device == sync
    assert planned.cost.phases["gradient_sync"].comm_bytes_per_device == sync
    x = (T // 8) * H * 2
    assert planned.cost.memory_bytes_per_device == 16 * P + w + x
    assert dict(planned.cost.memory_by_kind) == {
        "weights": 2 * P, "gradients": 2 * P, "optimizer_state": 12 * P, "activations": 0,
        "inputs": x, "buffers": w,
    }  # fmt: skip
    assert planned.search.problem.peak(planned.solution.choice) == memory(planned.program).peak


def test_fsdp_when_the_replicated_weights_do_not_fit(step):
    """Under a budget of 4 bytes per parameter the weights, gradients and optimizer state are
    held split over the mesh (ZeRO-3 / FSDP): each weight gathered before its forward use and
    again for the backward that reads it (fc2's dx), each gradient reduce-scattered."""
    cluster = make_cluster(mesh="8", memory=str(4 * P))
    planned = auto_plan(step, cluster, _DP[:2])
    plan, w = planned.plan, H * F * 2
    for name in ("w1", "w2", "w1@state", "w2@grad", "w1@grad"):
        assert plan.values[name].split_axes in (((0,),), ((), (0,))), name
    moved = [(c.source, c.collective.kind) for c in planned.program.communications]
    assert sorted(moved) == sorted(
        [
            ("w1", CollectiveKind.ALL_GATHER), ("w2", CollectiveKind.ALL_GATHER),
            ("w2", CollectiveKind.ALL_GATHER),
            ("w2@grad0", CollectiveKind.REDUCE_SCATTER),
            ("w1@grad0", CollectiveKind.REDUCE_SCATTER),
        ]
    )  # fmt: skip
    gather = ring_bytes(CollectiveKind.ALL_GATHER, 8, w // 8)
    scatter = ring_bytes(CollectiveKind.REDUCE_SCATTER, 8, w)
    assert gather == scatter == 7 * w // 8
    assert planned.cost.comm_bytes_per_device == 3 * gather + 2 * scatter
    assert planned.cost.memory_bytes_per_device <= 4 * P
    assert planned.search.problem.peak(planned.solution.choice) == memory(planned.program).peak


def test_micro_batches_run_forward_and_backward_each_time_and_sync_once(mlp):
    """Four micro-batches: four times the forward and backward compute, one gradient sync."""
    cluster = make_cluster(mesh="8")
    costs = {}
    for n in (1, 4):
        step = training_graph(import_onnx(mlp), Training(micro_batches=n))
        costs[n] = auto_plan(step, cluster, _DP).cost
    for phase in ("forward", "backward"):
        assert costs[4].phases[phase].compute_time_s == pytest.approx(
            4 * costs[1].phases[phase].compute_time_s
        )
    assert costs[4].phases["gradient_sync"] == costs[1].phases["gradient_sync"]
    # The gradients accumulate over the micro-batches, held from the step's start: w1's is
    # still held when w2's is all-reduced, so the peak moves there. Weights, state and both
    # bf16 gradients (16 bytes per parameter), the all_reduce's result, relu's kept input h,
    # r's gradient and x's shard.
    t, w = T // 8, H * F * 2
    assert costs[1].memory_bytes_per_device == 16 * P + w + t * H * 2
    assert costs[4].memory_bytes_per_device == 16 * P + w + 2 * (t * F * 2) + t * H * 2


@dataclasses.dataclass(frozen=True)
class _Enumerated:
    """The pinned MLP step's search and the peaks of its plans: top (the memory-aside
    optimum's) and least (the least of every combination's)."""

    graph: Graph
    search: Search
    top: int
    least: int


@pytest.fixture(scope="module")
def enumerated(tmp_path_factory) -> _Enumerated:
    """The design pages' MLP trained on mesh 2 (x, the state and the synchronized gradients
    pinned, to keep the enumeration small), every combination's peak read once for the three
    budgets."""
    folder = tmp_path_factory.mktemp("enumerated")
    graph = training_graph(import_onnx(write_seed_mlp(folder / "mlp.onnx")), Training())
    pins = [
        Annotation(name, Sharding()) for name in ("x", "w1@state", "w2@state", "w1@grad", "w2@grad")
    ]
    search = build_search(graph, make_cluster(mesh="2"), pins)
    free = search.problem
    assert 100 < np.prod(free.sizes) < 100_000
    least = min(free.peak(c) for c in itertools.product(*(range(n) for n in free.sizes)))
    return _Enumerated(graph, search, free.peak(solve(free).choice), least)


@pytest.mark.parametrize("budget", ["free", "middle", "least"])
def test_exhaustive_search_equals_the_ilp_on_a_training_step(enumerated, budget):
    """The ILP's optimum is the best of every combination, and its peak is the program's."""
    graph, search, top, least = (
        enumerated.graph, enumerated.search, enumerated.top, enumerated.least,
    )  # fmt: skip
    limit = {"free": top, "middle": (top + least) // 2, "least": least}[budget]
    problem = dataclasses.replace(search.problem, budget=limit)
    solution = solve(problem)
    assert solution.objective == brute_force(problem)
    program = lower(graph, search.plan(graph, make_cluster(mesh="2"), solution.choice))
    assert problem.peak(solution.choice) == memory(program).peak <= limit


# ---- every bundled model ----------------------------------------------------------------------

_DIMS = {"cnn": ["batch=8"], "mlp": ["batch=8"]}


@pytest.mark.parametrize(
    "model", sorted(p.stem for p in MODELS.glob("*.onnx") if "32l" not in p.stem)
)
def test_training_plans_are_deterministic_and_list_the_programs_collectives(
    model, tmp_path, capsys
):
    dims = _DIMS.get(model, ["batch=8", "seq=32"])
    flags = [f for d in dims for f in ("--dim", d)]
    documents = []
    for run in range(2):
        out = tmp_path / f"{run}.json"
        args = ["plan", str(MODELS / f"{model}.onnx"), "--mesh", "2x2", *flags]
        assert main([*args, "--mode", "training", "-o", str(out), "--json"]) == 0
        capsys.readouterr()
        documents.append(json.loads(out.read_text()))
    first, second = ({k: v for k, v in d.items() if k != "timing"} for d in documents)
    assert first == second
    assert first["mode"] == "training"
    assert first["training"] == {
        "optimizer": "adam", "precision": "bf16-mixed", "micro_batches": 1, "recompute": "none",
        "attention": "fused", "prefetch": 1, "bucket_mb": 25.0, "async_tp": False, "overlap": True,
    }  # fmt: skip
    listed = sum(c["bytes_per_device"] for c in first["collectives"])
    assert listed == first["cost"]["comm_bytes_per_device"]
    phases = first["cost"]["phases"]
    assert sum(p["comm_bytes_per_device"] for p in phases.values()) == listed
    assert sum(first["cost"]["memory_by_kind"].values()) == first["cost"]["memory_bytes_per_device"]
    # Each op says its phase: the ops' compute summed by phase is each phase's compute.
    by_phase: dict[str, float] = {}
    for entry in first["ops"].values():
        by_phase[entry["phase"]] = by_phase.get(entry["phase"], 0.0) + entry.get("compute_s", 0)
    assert set(by_phase) == set(phases)
    for phase, seconds in by_phase.items():
        assert seconds == pytest.approx(phases[phase]["compute_time_s"], rel=1e-12, abs=1e-15)


# ---- the faces --------------------------------------------------------------------------------


def test_plan_summary_shows_the_phases_and_the_memory_by_kind(mlp, capsys):
    args = ["plan", str(mlp), "--mesh", "8", "--mode", "training", "--optimizer", "sgd"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "training step by phase:" in out
    for phase in ("forward:", "backward:", "gradient_sync:", "optimizer:"):
        assert phase in out
    assert "memory at the peak: weights" in out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--optimizer", "sgd"], "--optimizer plans a training step: add --mode training"),
        (["--mode", "train"], "unknown mode 'train'; choose one of: inference, training"),
        (
            ["--mode", "training", "--precision", "fp8"],
            "unknown precision 'fp8'; choose one of: bf16-mixed, fp16-mixed, fp8-mixed, fp32",
        ),
        (
            ["--mode", "training", "--micro-batches", "0"],
            "micro-batches must be at least 1, got 0",
        ),
    ],
    ids=["flag-without-mode", "bad-mode", "bad-precision", "zero-micro-batches"],
)
def test_bad_training_flags_are_one_line(mlp, capsys, flags, message):
    assert main(["plan", str(mlp), "--mesh", "8", *flags]) == 2
    assert capsys.readouterr().err == f"autoshard: error: {message}\n"


def test_a_training_plan_partitions_as_planned_and_verifies_in_bf16(mlp, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    args = ["--mesh", "2x2", "--mode", "training", "--optimizer", "adamw"]
    assert main(["plan", str(mlp), *args, "-o", str(plan)]) == 0
    report = plan_markdown(read_document(plan))
    assert "## Training step: adamw, bf16-mixed, 1 micro-batch(es), recompute none" in report
    assert "| gradient_sync |" in report and "| optimizer_state |" in report
    # nothing is split: no gradient is synchronized, and the report does not say one is
    assert report.split("\n")[2] == (
        "Nothing is split: every device computes everything. Weights: 2 replicated."
    )
    assert "| `w1` | replicated | `[[], []]` | `[[], []]` | `[[], []]` |" in report
    out = tmp_path / "out"
    assert main(["partition", str(mlp), "--mesh", "2x2", "--plan", str(plan), "-o", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["training"]["optimizer"] == "adamw"
    assert '"onnx.Grad"' in (out / "spmd.mlir").read_text()
    assert manifest["steps"] == "steps.json" and (out / "steps.json").exists()
    capsys.readouterr()
    # bf16-mixed: run in bfloat16 against autograd in bfloat16, fp32 master weights
    assert main(["verify", str(out), "--model", str(mlp), "--steps", "1", "--json"]) == 0
    verified = json.loads(capsys.readouterr().out)
    assert verified["ok"] and verified["floats"] == "bfloat16"
    assert main(["run", str(out)]) == 2
    assert "is the partition of a training step: run trains it" in capsys.readouterr().err
    wrong = ["partition", str(mlp), "--mesh", "2x2", "--plan", str(plan), "-o", str(out)]
    assert main([*wrong, "--mode", "training", "--optimizer", "sgd"]) == 2
    assert "leave out --mode and the training flags" in capsys.readouterr().err


def test_a_float_constant_trains_in_the_steps_precision(tmp_path):
    """y = (x @ W) * 0.5 with the scale a Constant node (as exporters write attention's
    1/sqrt(d)): the bf16 step computes the scale in bf16 too, so its program prints (the
    partition refused it: 'constant c is bfloat16[] in the program but the value given is
    float32[]')."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("Constant", [], ["c"], name="const", value=onnx.numpy_helper.from_array(
            np.array(0.5, np.float32))),
        helper.make_node("Mul", ["m", "c"], ["y"], name="mul"),
    ]  # fmt: skip
    proto = model(nodes, [tensor("x", F32, [8, 16])], [tensor("y", F32, [8, 16])],
                  {"W": rng_weight((16, 16))})  # fmt: skip
    path = tmp_path / "scaled.onnx"
    onnx.save(proto, path)
    step = training_graph(import_onnx(path), Training.parse())
    assert step.values["c"].dtype == "bfloat16" and step.constants["c"].dtype.name == "bfloat16"
    assert float(step.constants["c"]) == 0.5
    plan, out = tmp_path / "plan.json", tmp_path / "out"
    args = ["--mesh", "2x2", "--mode", "training"]
    assert main(["plan", str(path), *args, "-o", str(plan), "-q"]) == 0
    assert main(["partition", str(path), "--mesh", "2x2", "--plan", str(plan), "-o", str(out)]) == 0
    program = (out / "spmd.mlir").read_text()
    assert '"onnx.Constant"() {value = dense<0.5> : tensor<bf16>}' in program


def test_training_options_name_the_valid_choices():
    with pytest.raises(TrainingError, match="choose one of: adam, adamw, sgd, none"):
        Training.parse(optimizer="lion")
    assert Training.parse("sgd", "fp32").state_planes == 1  # momentum only
    assert Training.parse("adam", "fp32").state_planes == 2
    assert Training.parse("none").state_planes == 0


def test_recomputed_layers_keep_only_their_inputs():
    """GPT-2's two layers recomputed in their backward: the recomputed ops compute with their
    originals' options, the activations at the peak shrink, and the ILP's peak is still the
    program's."""
    from autoshard.pipeline import load_graph
    from autoshard.rules.gradient import computed_with
    from autoshard.training import Recompute

    dims, cluster = {"batch": 8, "seq": 32}, make_cluster(mesh="2x2")
    peaks = {}
    for recompute in (Recompute.NONE, Recompute.LAYERS):
        graph = load_graph(MODELS / "gpt2.onnx", dims, Training(recompute=recompute))
        planned = auto_plan(graph, cluster)
        recomputed = [op for op in graph.ops if op.name.endswith("@recompute")]
        assert bool(recomputed) == (recompute is Recompute.LAYERS)
        for op in recomputed:
            assert planned.plan.options[op.name] == planned.plan.options[computed_with(op)]
            assert graph.phase(op.name) == "backward"
        assert planned.search.problem.peak(planned.solution.choice) == memory(planned.program).peak
        peaks[recompute] = planned.cost.memory_by_kind["activations"]
    assert peaks[Recompute.LAYERS] < peaks[Recompute.NONE]


# ---- which weights are parameters ---------------------------------------------------------------


def exported_with_a_buffer(path: Path, metadata: bool) -> Path:
    """y = (x @ W) * scale * folded, as dynamo exports a module with a float buffer: W a
    PARAMETER, `scale` a non-persistent BUFFER, `folded` a constant folded from the buffer
    (`folded_from`). Without `metadata`, the same model stripped of it."""
    n = helper.make_node
    nodes = [n("MatMul", ["x", "W"], ["h"], name="mm"), n("Mul", ["h", "scale"], ["s"], name="mul"),
             n("Mul", ["s", "folded"], ["y"], name="mul2")]  # fmt: skip
    inits = {"W": rng_weight((16, 16)), "scale": rng_weight(16, 1), "folded": rng_weight(16, 2)}
    kinds = {"W": {"pkg.torch.export.graph_signature.InputSpec.kind": "PARAMETER"},
             "scale": {"pkg.torch.export.graph_signature.InputSpec.kind": "BUFFER",
                       "pkg.torch.export.graph_signature.InputSpec.persistent": "False"},
             "folded": {"pkg.onnxscript.optimizer.folded_from": "['scale']"}}  # fmt: skip
    infos = []
    for name, props in kinds.items() if metadata else ():
        info = tensor(name, F32, list(inits[name].shape))
        helper.set_metadata_props(info, props)
        infos.append(info)
    proto = model(nodes, [tensor("x", F32, [8, 16])], [tensor("y", F32, [8, 16])], inits,
                  value_info=infos)  # fmt: skip
    onnx.save(proto, path)
    return path


@pytest.mark.parametrize(
    ("metadata", "trained"), [(True, ["W"]), (False, ["W", "scale", "folded"])],
    ids=["dynamo-metadata", "stripped"],
)  # fmt: skip
def test_buffers_the_exporter_marks_are_not_trained(tmp_path, capsys, metadata, trained):
    """A float buffer (Llama's rotary inv_freq) is read like a parameter; where the export says
    it is a buffer, the step neither trains it nor keeps optimizer state for it."""
    path = exported_with_a_buffer(tmp_path / "m.onnx", metadata)
    graph = import_onnx(path)
    assert graph.buffers == ({"scale", "folded"} if metadata else set())
    step = training_graph(graph, Training())
    assert sorted(step.updates.values()) == sorted(trained + [f"{w}@state" for w in trained])
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--mesh", "2", "--mode", "training", "-o", str(out)]) == 0
    capsys.readouterr()
    assert list(json.loads(out.read_text())["strategy"]["weights"]) == trained


def rotary_like(path: Path, positions: str) -> Path:
    """y = ((x @ W) * cos(pos @ inv_freq)) @ Vᵀ + Less(x, M) masked, exported with no metadata:
    `inv_freq` only computes a table from constant positions (a Constant, or a Range over the
    sequence length), `V` is read through a Transpose of its own, and `M` only by a comparison
    (no differentiable path)."""
    n = helper.make_node
    if positions == "constant":
        pos = np.arange(8, dtype=np.float32).reshape(8, 1)
        made = [n("Constant", [], ["pos"], value=numpy_helper.from_array(pos), name="pos")]
    else:
        made = [n("Shape", ["x"], ["shape"], start=0, end=1, name="shape"),
                n("Squeeze", ["shape"], ["seq"], name="seq"),
                n("Range", ["zero", "seq", "one"], ["range"], name="range"),
                n("Cast", ["range"], ["posf"], to=F32, name="cast"),
                n("Unsqueeze", ["posf", "axis1"], ["pos"], name="unsq")]  # fmt: skip
    nodes = [*made,
             n("MatMul", ["x", "W"], ["h"], name="mm"),
             n("MatMul", ["pos", "inv_freq"], ["freqs"], name="freqs"),
             n("Cos", ["freqs"], ["cos"], name="cos"),
             n("Mul", ["h", "cos"], ["r"], name="rot"),
             n("Transpose", ["V"], ["Vt"], name="vt"),
             n("MatMul", ["r", "Vt"], ["o"], name="mm2"),
             n("Less", ["x", "M"], ["keep"], name="less"),
             n("Where", ["keep", "o", "zero_f"], ["y"], name="where")]  # fmt: skip
    inits = {"W": rng_weight((16, 4)), "inv_freq": rng_weight((1, 4), 1),
             "V": rng_weight((16, 4), 2), "M": rng_weight((8, 16), 3),
             "zero": np.array(0, np.int64), "one": np.array(1, np.int64),
             "axis1": np.array([1], np.int64), "zero_f": np.array(0, np.float32)}  # fmt: skip
    proto = model(nodes, [tensor("x", F32, [8, 16])], [tensor("y", F32, [8, 16])], inits)
    onnx.save(proto, path)
    return path


@pytest.mark.parametrize("positions", ["constant", "range-over-seq"])
def test_weights_that_only_compute_tables_from_constants_are_not_trained(tmp_path, capsys,
                                                                        positions):  # fmt: skip
    """A weight whose every path to the loss goes through a table computed from constants
    (rotary frequencies times positions) is a buffer, and so is one on no differentiable path:
    neither gets a gradient, a gradient sync nor optimizer state; the real weights do, one
    read through a Transpose included."""
    path = rotary_like(tmp_path / "m.onnx", positions)
    graph = import_onnx(path)
    assert not graph.buffers  # nothing in the file says so
    step = training_graph(graph, Training())
    assert sorted(step.updates.values()) == ["V", "V@state", "W", "W@state"]
    assert step.buffers == {"inv_freq", "M"}
    made = {o for op in step.ops for o in op.outputs} | {op.name for op in step.ops}
    for buffer in ("inv_freq", "M"):
        assert not {m for m in made if m.startswith(f"{buffer}@")}, buffer
    assert "cos@grad0" not in made and "h@grad0" in made
    out, html = tmp_path / "plan.json", tmp_path / "plan.html"
    args = ["plan", str(path), "--mesh", "2", "--mode", "training", "-o", str(out)]
    assert main([*args, "--html", str(html)]) == 0
    told = "Not trained: 2 buffers (inv_freq, M)."
    summary = capsys.readouterr().out
    assert f" {told} " in " ".join(summary.split())  # the summary's story
    assert "\nweights: " not in summary  # the story's counts, not again by key (`2 ddp`)
    document = json.loads(out.read_text())
    assert list(document["strategy"]["weights"]) == ["W", "V"]
    assert document["strategy"]["buffers"] == {"count": 2, "names": ["inv_freq", "M"]}
    assert document["story"].endswith(f" {told}")
    assert "Not trained (no gradient, sync or optimizer state): 2 buffers (inv_freq, M)." in (
        html.read_text()
    )


def test_rope_tables_of_a_dynamo_llama_export_get_no_optimizer_state(tmp_path, capsys):
    """A tiny Hugging Face Llama exported by the dynamo exporter, with and without its metadata:
    the rotary `inv_freq` (a non-persistent buffer, whose cos/sin tables the model computes
    from positions) gets no optimizer state either way, and the plans keep the same weights
    and the same optimizer memory."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("onnxscript")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    shapes = ({0: torch.export.Dim("batch", max=64), 1: torch.export.Dim("seq", max=32)},)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(lm, (ids,), dynamo=True, dynamic_shapes=shapes,
                                    optimize=True, verbose=False)  # fmt: skip
    proto = program.model_proto
    inv_freq = next(t.name for t in proto.graph.initializer if t.name.endswith("inv_freq"))
    onnx.save(proto, tmp_path / "meta.onnx")
    for entry in (*proto.graph.value_info, *proto.graph.initializer, *proto.graph.node):
        del entry.metadata_props[:]
    onnx.save(proto, tmp_path / "stripped.onnx")
    plans = {}
    for kind in ("meta", "stripped"):
        out = tmp_path / f"{kind}.json"
        args = ["plan", str(tmp_path / f"{kind}.onnx"), "--mesh", "2", "--mode", "training",
                "--dim", "batch=2", "--dim", "seq=8", "-o", str(out)]  # fmt: skip
        assert main(args) == 0
        plans[kind] = json.loads(out.read_text())
    capsys.readouterr()
    stripped = import_onnx(tmp_path / "stripped.onnx", {"batch": 2, "seq": 8})
    assert not stripped.buffers  # nothing in the file says so: the graph shows it
    assert inv_freq in training_graph(stripped, Training()).buffers
    weights = {k: list(p["strategy"]["weights"]) for k, p in plans.items()}
    assert inv_freq not in weights["stripped"]
    for kind, plan in plans.items():  # the document names it, found or marked
        assert inv_freq in plan["strategy"]["buffers"]["names"], kind
    assert weights["stripped"] == weights["meta"]
    memory = {k: p["cost"]["memory_by_kind"]["optimizer_state"] for k, p in plans.items()}
    assert memory["stripped"] == memory["meta"]


@pytest.mark.parametrize(
    ("names", "told"),
    [
        (["inv_freq"], "1 buffer (inv_freq)"),
        ([f"layers.{i}.rotary.inv_freq" for i in range(80)],
         "80 buffers (layers.*.rotary.inv_freq (80))"),
        ([*(f"l.{i}.inv_freq" for i in range(80)), *(f"l.{i}.mask" for i in range(80)), "a",
          "b"], "162 buffers (l.*.inv_freq (80), l.*.mask (80), a, and 1 more)"),
    ],
    ids=["one", "one-per-layer", "bounded"],
)  # fmt: skip
def test_buffers_are_told_in_a_bounded_way(names, told):
    """A 70B decoder's rotary tables, one per layer, are one pattern with their count; at most
    three are told, then how many more."""
    assert buffers_text(names) == told


def test_a_weights_annotation_for_users_leaves_its_update_reading_it_as_held(step):
    """w1 held FSDP x TP on 2x2 (H over axis 0, F over axis 1) and read by its users as TP's
    column split alone: the forward and backward read it gathered over axis 0, while the
    optimizer's update, which reads the weight too, reads it as held, so the gradient and the
    fp32 state are never gathered over the FSDP axis (the update is not a user the
    annotation pins)."""
    cluster = make_cluster(mesh="2x2")
    held, read = Sharding(((0,), (1,))), Sharding(((), (1,)))
    pins = [Annotation("w1", held), Annotation("w1", read, for_users=True)]
    planned = auto_plan(step, cluster, pins)
    rule = rule_for(_op(step, "w1@update"), step)
    assert option_reads(rule, planned.plan.options["w1@update"], 1) == held
    for op in step.consumers("w1"):
        if op.name != "w1@update":
            reads = op.inputs.index("w1")
            assert option_reads(rule_for(op, step), planned.plan.options[op.name], reads) == read
    assert planned.cost.phases["optimizer"].comm_bytes_per_device == 0
    moved = {planned.program.tensors[c.source].value for c in planned.program.communications}
    assert not moved & {"w1@grad", "w1@state"}


def test_an_annotation_on_one_layer_pins_that_layer_and_its_gradients_alone():
    """GPT-2's attention probabilities in layer 0 pinned split over batch and heads on 2x2:
    layer 0's Softmax and the gradient computed with its option are decided on their own, not
    as copies of layer 1 (whose gradient comes first in the backward), and the plan holds the
    value as pinned."""
    graph = load_graph(MODELS / "gpt2.onnx", {"batch": 2, "seq": 16}, Training())
    value, pinned = "/lm/transformer/h.0/attn/Softmax_output_0", Sharding(((0,), (1,)))
    planned = auto_plan(graph, make_cluster(mesh="2x2"), [Annotation(value, pinned)])
    softmax = graph.producer(value)
    assert option_writes(rule_for(softmax, graph), planned.plan.options[softmax.name], 0) == (
        pinned
    )
    (gradient,) = [op for op in graph.ops if computed_with(op) == softmax.name]
    assert planned.plan.options[gradient.name] == planned.plan.options[softmax.name]


def test_gradients_are_copies_only_where_their_forward_ops_are():
    """GPT-2 at batch 1: the forward's run of layers pairs layer 0's residual Add with the
    embedding's Add, the backward's pairs the two layers' gradients of it; a gradient decides
    with its forward op, so it is no copy of a gradient whose forward op is decided apart
    (this plan failed to build before)."""
    graph = load_graph(MODELS / "gpt2.onnx", {"batch": 1, "seq": 16}, Training())
    planned = auto_plan(graph, make_cluster(mesh="2"))
    for op in graph.ops:
        if forward := computed_with(op):
            assert planned.plan.options[op.name] == planned.plan.options[forward]

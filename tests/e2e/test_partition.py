"""The partition pass: what each device runs. The design pages' MLP against its "after sharding
partition" listing (docs/design/lowering.md); shape operands rewritten to explicit local shapes; the
rule notes' local rewrites (masked lookup, bias once, local groups); uneven and empty shards; and
every op type of the bundled models (plus a small model of the ops they lack) split loop by loop,
each run on all devices and compared with onnxruntime."""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from autoshard.annotations import Annotation
from autoshard.execute.artifacts import write_partition
from autoshard.execute.verify import model_weights, random_inputs, reference_outputs, verify
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.passes.local_rewrites import NOTE_REWRITES
from autoshard.passes.lower import lower
from autoshard.passes.partition import LocalCollective, LocalCompute, PartitionError, partition
from autoshard.pipeline import Setup
from autoshard.propagate import propagate
from autoshard.rules import IteratorType, Note, rule_for
from autoshard.search.baselines import dp_tp
from autoshard.sharding import Sharding, ShardingOption
from tests.golden import seed_models

from .helpers import model_path

S = Sharding.parse


def run(graph, mesh, annotations=(), options=None):
    return partition(lower(graph, propagate(graph, mesh, annotations, options)), graph)


def check_numerics(graph, model, partitioned, reference=None):
    report = verify(partitioned, graph, model, model_weights(graph, partitioned), None, None, 0,
                    reference)  # fmt: skip
    assert report.ok, report.to_json()
    return report


def options(**loops):
    return {name.replace("__", "/"): ShardingOption(tuple(v)) for name, v in loops.items()}


# ---- the design pages' MLP --------------------------------------------------------------------


def write_seed_mlp(path):
    """The design pages' MLP (tests/golden/seed_models.py) with random weights instead of ones, so
    that numbers would show a wrong slice."""
    seed_models.write_seed_mlp(path)
    model = onnx.load(path)
    model.ir_version = 10  # what onnxruntime reads
    rng = np.random.default_rng(1)
    for weight in model.graph.initializer:
        values = rng.standard_normal(tuple(weight.dims)).astype(np.float32)
        weight.CopyFrom(numpy_helper.from_array(values, weight.name))
    onnx.save(model, path)
    return path


SEED_ANNOTATIONS = [  # tests/golden/test_seed_001.py, annotations on tensors
    Annotation("x", S("[[], [], [0]]")),
    Annotation("y", S("[[]] partial = sum[0]")),
    Annotation("y", S("[[], [], [0]]"), for_users=True),
]
# "After sharding partition" (docs/design/lowering.md): arguments 2x4x4, 8x16, 16x8; all_gather with
# replica_groups [[0, 1]]; the zero constant cut to 2x4x16; reduce_scatter to 2x4x4.
SEED_LOCAL_PROGRAM = """\
x~1: 2x4x8 = all_gather(x) mesh_axes = [0] gather_axis = 2 group [0, 1]
h: 2x4x16 = MatMul(x~1, w1)
zero~1: 2x4x16 = all_slice(zero) mesh_axes = [0] slice_axis = 2 group [0, 1]
r: 2x4x16 = Max(h, zero~1)
y: 2x4x8 = MatMul(r, w2)
y~1: 2x4x4 = reduce_scatter(y) mesh_axes = [0] reduction = sum scatter_axis = 2 group [0, 1]"""


def test_seed_001_mlp_after_partition(tmp_path):
    model = write_seed_mlp(tmp_path / "mlp.onnx")
    graph = import_onnx(model)
    partitioned = run(graph, Mesh((2,)), SEED_ANNOTATIONS)
    for device in partitioned.devices:
        assert device.text() == SEED_LOCAL_PROGRAM
        assert [device.shapes[n] for n in ("x", "w1", "w2")] == [(2, 4, 4), (8, 16), (16, 8)]
        ranks = [s.rank for s in device.steps if isinstance(s, LocalCollective)]
        assert ranks == [device.index] * 3
    assert partitioned.slices("w1", 1) == ((0, 8), (16, 32))
    check_numerics(graph, model, partitioned)


# ---- shape operands ---------------------------------------------------------------------------


def shape_operand(partitioned, device, op):
    name = op.inputs[1 if op.type in ("Reshape", "Expand") else 0]
    if name in device.constants:
        return device.constants[name]
    return partitioned.program.constants[name]


@pytest.mark.parametrize("name", ["gpt2", "gpt2_dynamo", "bert"])
def test_reshape_targets_are_each_devices_explicit_local_shape(name):
    graph = import_onnx(model_path(name), {"batch": 6, "seq": 4})
    mesh = Mesh((2, 2))
    # Every reshape carrying the batch (6) splits it over axis 0 (a fixed option): each
    # device's target is its explicit local shape (3 rows; no 0 or -1 left to resolve).
    fixed = {}
    for op in graph.ops:
        rule = rule_for(op, graph)
        if op.type == "Reshape" and rule is not None:
            sizes = [(i, loop.size) for i, loop in enumerate(rule.loops)]
            first = next((i for i, size in sizes if size == 6), None)
            if first is not None:
                loops = [()] * len(rule.loops)
                loops[first] = (0,)
                fixed[op.name] = ShardingOption(tuple(loops))
    assert fixed, "the model has batch-carrying reshapes"
    partitioned = run(graph, mesh, [], fixed)
    seen = 0
    for device in partitioned.devices:
        for step in device.steps:
            if isinstance(step, LocalCompute) and step.op.type == "Reshape":
                target = shape_operand(partitioned, device, step.op)
                assert tuple(target.tolist()) == device.shapes[step.op.outputs[0]]
                assert -1 not in target.tolist()
                seen += step.op.name in fixed
    assert seen == len(fixed) * mesh.size
    check_numerics(graph, model_path(name), partitioned)


# ---- rule notes -------------------------------------------------------------------------------


def test_every_rule_note_has_a_local_rewrite():
    assert sorted({note for note, _ in NOTE_REWRITES}) == sorted(set(Note) - {Note.NONE})


def test_vocabulary_split_embedding_is_a_masked_partial_lookup():
    graph = import_onnx(model_path("gpt2"), {"batch": 2, "seq": 8})
    table = "lm.transformer.wte.weight"
    partitioned = run(graph, Mesh((2, 4)), [Annotation(table, S("[[0, 1]]"))])
    lookup = "/lm/transformer/wte/Gather"
    for device in partitioned.devices:
        assert device.shapes[table] == (64, 64)
        assert int(device.constants[f"{lookup}.lo"]) == 64 * device.index
        ops = [s.op.type for s in device.steps if isinstance(s, LocalCompute)]
        assert ops[:12] == ["Reshape", "Less", "Add", "Where", "Sub", "GreaterOrEqual", "Less",
                            "And", "Where", "Gather", "Unsqueeze", "Where"]  # fmt: skip
    out = partitioned.program.tensors["/lm/transformer/wte/Gather_output_0"]
    assert str(out.sharding) == "[[]] partial = sum[0, 1]"
    check_numerics(graph, model_path("gpt2"), partitioned)


def test_uneven_vocabulary_split():
    # 512 rows over 3 devices: 171, 171, 170 (a fixed option: propagation splits evenly only).
    graph = import_onnx(model_path("gpt2"), {"batch": 2, "seq": 4})
    lookup = "/lm/transformer/wte/Gather"
    partitioned = run(graph, Mesh((3,)), [], options(**{lookup: [(), (), (), (0,)]}))
    bounds = [partitioned.slices("lm.transformer.wte.weight", k)[0] for k in range(3)]
    assert bounds == [(0, 171), (171, 342), (342, 512)]
    check_numerics(graph, model_path("gpt2"), partitioned)


def test_block_local_lookup_stays_local_and_uneven_ones_are_checked():
    # TorchScript BERT gathers its flattened [batch * seq, 1] mask by constant ids
    # [batch, 1, 1, seq]: ids of batch b index rows b * seq ..; split alike, each device's ids
    # fall in its own rows, so the lookup is a shifted Gather, unmasked and not partial.
    graph = import_onnx(model_path("bert"), {"batch": 4, "seq": 6})
    fixed = options(**{"/bert/Gather_4": [(0,), (), (), (), ()]})
    partitioned = run(graph, Mesh((2,)), [], fixed)
    local = [s.op for s in partitioned.devices[1].steps if isinstance(s, LocalCompute)]
    lookup = [op.type for op in local if op.name.startswith("/bert/Gather_4")]
    assert lookup == ["Less", "Add", "Where", "Sub", "Gather"]
    assert int(partitioned.devices[1].constants["/bert/Gather_4.lo"]) == 12
    assert not partitioned.program.tensors["/bert/Gather_4_output_0"].sharding.partial_axes
    check_numerics(graph, model_path("bert"), partitioned)
    # Batch 2 over 3 devices: ids rows 1, 1, 0 but table rows 4, 4, 4; device 0's ids
    # reach row 11.
    graph = import_onnx(model_path("bert"), {"batch": 2, "seq": 6})
    with pytest.raises(PartitionError, match="some device's ids fall outside its rows"):
        run(graph, Mesh((3,)), [], fixed)


def test_bias_is_added_by_the_first_device_of_each_reduction_group():
    graph = import_onnx(model_path("mlp"), {"batch": 4})
    partitioned = run(graph, Mesh((2, 2)), [Annotation("0.weight", S("[[1]]"))])
    second = [
        [s.op for s in d.steps if isinstance(s, LocalCompute) and s.op.name == "/2/Gemm"][0]
        for d in partitioned.devices
    ]
    # The second Gemm's k loop is split over axis 1: devices (i, 0) add the bias, (i, 1) not.
    assert [len(op.inputs) for op in second] == [3, 2, 3, 2]
    check_numerics(graph, model_path("mlp"), partitioned)


# ---- a small model of the ops the bundled ones lack -------------------------------------------


def write_small_ops(path):
    """Squeeze without axes, Expand, Slice over a split dim, grouped Convs, Resize by sizes:
    each carries a shape or group count that partition must make local. (GroupNormalization
    would need the group count too, but ONNX shape inference gives its result no shape, so
    the importer refuses it.)"""
    rng = np.random.default_rng(2)
    f32 = TensorProto.FLOAT
    inits = {
        "bias": rng.standard_normal((1, 6)).astype(np.float32),
        "expand_to": np.array([4, 6], np.int64),
        "starts": np.array([0, 1], np.int64),
        "ends": np.array([1 << 62, 5], np.int64),
        "axes": np.array([0, 1], np.int64),
        "kernel": rng.standard_normal((4, 1, 3, 3)).astype(np.float32),
        "pairs": rng.standard_normal((4, 2, 3, 3)).astype(np.float32),
        "sizes": np.array([4, 4, 6, 6], np.int64),
    }
    nodes = [
        helper.make_node("Squeeze", ["x"], ["squeezed"], name="squeeze"),
        helper.make_node("Expand", ["bias", "expand_to"], ["expanded"], name="expand"),
        helper.make_node("Add", ["squeezed", "expanded"], ["sum"], name="add"),
        helper.make_node("Slice", ["sum", "starts", "ends", "axes"], ["sliced"], name="slice"),
        helper.make_node("Conv", ["image", "kernel"], ["conv"], name="conv", group=4,
                         pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["conv", "pairs"], ["paired"], name="conv2", group=2,
                         pads=[1, 1, 1, 1]),
        helper.make_node("Resize", ["paired", "", "", "sizes"], ["resized"], name="resize"),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "small_ops",
        [
            helper.make_tensor_value_info("x", f32, [4, 1, 6]),
            helper.make_tensor_value_info("image", f32, [4, 4, 3, 3]),
        ],
        [
            helper.make_tensor_value_info("sliced", f32, [4, 4]),
            helper.make_tensor_value_info("resized", f32, [4, 4, 6, 6]),
        ],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(model, path)
    return path


def test_small_ops_rewrites(tmp_path):
    model = write_small_ops(tmp_path / "small.onnx")
    graph = import_onnx(model)
    mesh = Mesh((4,))
    fixed = options(
        squeeze=[(0,), ()],  # [4, 1, 6] -> local [1, 1, 6]: the implicit axes must stay [1]
        slice=[(0,), ()],  # dim 0 whole (0..big) and split: its end becomes the local 1
        conv=[(), (0,), (), (), (), (), ()],  # 4 groups over 4 devices: group 1 each
        resize=[(0,), (), (), ()],  # sizes [4, 4, 6, 6] -> [1, 4, 6, 6]
    )
    partitioned = run(graph, mesh, [], fixed)
    device = partitioned.devices[3]
    ops = {s.op.name: s.op for s in device.steps if isinstance(s, LocalCompute)}
    assert partitioned.program.constants["squeeze.axes"].tolist() == [1]
    assert ops["conv"].attrs["group"] == 1
    assert device.constants[ops["resize"].inputs[3]].tolist() == [1, 4, 6, 6]
    ends = device.constants[ops["slice"].inputs[2]].tolist()
    assert ends == [1, 5]
    check_numerics(graph, model, partitioned)


def test_group_counts_must_hold_whole_groups(tmp_path):
    graph = import_onnx(write_small_ops(tmp_path / "small.onnx"))
    # conv2's 2 groups of 2 channels over 3 devices: channels 2, 2, 0 -> groups 1, 1, 0.
    conv2 = [(), (0,), (), (), (), (), ()]
    partitioned = run(graph, Mesh((3,)), [], options(conv2=conv2))
    groups = [
        [
            (s.op.type, s.op.attrs.get("group"))
            for s in d.steps
            if isinstance(s, LocalCompute) and s.op.name.startswith("conv2")
        ]
        for d in partitioned.devices
    ]
    # Device 2 holds no channel: it computes nothing (an empty constant).
    assert groups == [[("Conv", 1)], [("Conv", 1)], [("ConstantOfShape", None)]]
    check_numerics(graph, tmp_path / "small.onnx", partitioned)
    # Over 4 devices each would hold one channel: half a group.
    with pytest.raises(PartitionError, match=r"'conv2' .*1 of 4 channels, not whole groups"):
        run(graph, Mesh((4,)), [], options(conv2=conv2))


# ---- uneven and empty shards ------------------------------------------------------------------


def test_empty_shards_compute_nothing_and_stay_exact():
    # Batch 3 over 2x2 = 4 devices: rows 1, 1, 1, 0. Device 3 holds nothing: its ops become
    # constants of empty shape rather than onnxruntime calls on empty tensors.
    graph = import_onnx(model_path("mlp"), {"batch": 3})
    both = [(0, 1), (), ()]
    fixed = options(**{"/0/Gemm": both, "/1/Relu": both[:2], "/2/Gemm": both})
    partitioned = run(graph, Mesh((2, 2)), [Annotation("x", S("[[0, 1]]"))], fixed)
    assert [d.shapes["x"] for d in partitioned.devices] == [(1, 64)] * 3 + [(0, 64)]
    last = [s.op.type for s in partitioned.devices[3].steps if isinstance(s, LocalCompute)]
    assert last == ["ConstantOfShape"] * 3
    assert [s.op.type for s in partitioned.devices[0].steps] == ["Gemm", "Relu", "Gemm"]
    check_numerics(graph, model_path("mlp"), partitioned)


def test_reduction_over_an_empty_shard_gives_the_identity():
    # The cnn's last Gemm contracts k = 16; over 7 devices its ceil-sized shards are
    # 3, 3, 3, 3, 3, 1, 0. Device 6's partial sum is the sum of nothing: zeros.
    graph = import_onnx(model_path("cnn"), {"batch": 2})
    partitioned = run(graph, Mesh((7,)), [], options(**{"/8/Gemm": [(), (), (0,)]}))
    assert [d.shapes["8.weight"] for d in partitioned.devices] == [(10, 3)] * 5 + [
        (10, 1),
        (10, 0),
    ]
    gemm = [s.op for s in partitioned.devices[6].steps if isinstance(s, LocalCompute)][-1]
    assert gemm.type == "ConstantOfShape" and gemm.attrs["value"].tolist() == [0.0]
    check_numerics(graph, model_path("cnn"), partitioned)


@pytest.mark.parametrize(
    "fixed, message",
    [
        (
            {"/lm/transformer/h.0/attn/Reshape": [(), (), (0,)]},
            r"'/lm/transformer/h.0/attn/Reshape' \(Reshape\): loop d2 of size 4 is split over "
            r"mesh axes \[0\] \(3 devices\)",
        ),
        (
            {"/lm/transformer/h.0/ln_1/LayerNormalization": [(), (0,), ()]},
            None,  # a parallel loop of a non-reshape: uneven is fine
        ),
    ],
)
def test_uneven_reshape_splits_are_refused(fixed, message):
    graph = import_onnx(model_path("gpt2"), {"batch": 2, "seq": 8})
    if message is None:
        check_numerics(graph, model_path("gpt2"), run(graph, Mesh((3,)), [], options(**fixed)))
    else:
        with pytest.raises(PartitionError, match=message):
            run(graph, Mesh((3,)), [], options(**fixed))


# ---- every op type ----------------------------------------------------------------------------


SWEEP = {
    "mlp": {"batch": 2},
    "cnn": {"batch": 2},
    "gpt2": {"batch": 2, "seq": 6},
    "gpt2_dynamo": {"batch": 2, "seq": 6},
    "bert": {"batch": 2, "seq": 6},
}


def sweep_cases():
    """One case per (model, op type, loop kind, even?): split that loop alone over mesh 3."""
    cases, seen = [], set()
    for name, dims in SWEEP.items():
        graph = import_onnx(model_path(name), dims)
        for op in graph.ops:
            rule = rule_for(op, graph)
            for i, loop in enumerate(rule.loops if rule else ()):
                key = (op.type, loop.kind, loop.size % 3 == 0)
                if loop.kind is IteratorType.INVALID or loop.size < 2 or key in seen:
                    continue
                seen.add(key)
                cases.append((name, op.name, op.type, i, len(rule.loops)))
    return cases


def test_every_op_type_partitions_loop_by_loop(tmp_path):
    """Each op type's splittable loops, split alone over 3 devices (even or not, with empty
    shards for loops of 2), partition and match onnxruntime; or are refused by name, which
    only reshapes splitting unevenly and uneven averages may be."""
    small = write_small_ops(tmp_path / "small.onnx")
    graphs = {name: import_onnx(model_path(name), dims) for name, dims in SWEEP.items()}
    graphs["small"] = import_onnx(small)
    models = {name: model_path(name) for name in SWEEP} | {"small": small}
    references = {
        name: reference_outputs(models[name], random_inputs(graph))
        for name, graph in graphs.items()
    }
    cases = sweep_cases()
    for op in graphs["small"].ops:
        rule = rule_for(op, graphs["small"])
        cases += [("small", op.name, op.type, i, len(rule.loops)) for i, loop in
                  enumerate(rule.loops) if loop.kind is not IteratorType.INVALID]  # fmt: skip
    types, refused = set(), []
    for name, op_name, op_type, loop, count in cases:
        loops = [()] * count
        loops[loop] = (0,)
        graph = graphs[name]
        try:
            partitioned = run(graph, Mesh((3,)), [], {op_name: ShardingOption(tuple(loops))})
        except PartitionError as error:
            assert op_type in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "ReduceMean",
                               "GlobalAveragePool"), str(error)  # fmt: skip
            refused.append(op_type)
            continue
        check_numerics(graph, models[name], partitioned, references[name])
        types.add(op_type)
    every = {op.type for g in graphs.values() for op in g.ops if rule_for(op, g) is not None}
    assert every - types <= {"Flatten"}, every - types  # cnn's Flatten [2, 16]: loops of 2, 16
    assert len(cases) > 50


# ---- a large shape-only model -----------------------------------------------------------------


def test_shape_only_32_layer_decoder_partitions_in_seconds(tmp_path):
    dims = {"batch": 8, "seq": 256}
    graph = import_onnx(model_path("decoder_32l_shape_only"), dims)
    mesh = Mesh((2, 4))
    setup = Setup(
        model=model_path("decoder_32l_shape_only"), mesh=mesh, dims=dims,
        annotations=tuple(dp_tp(graph, mesh)),
    )  # fmt: skip
    start = time.perf_counter()
    manifest = write_partition(setup, tmp_path / "out")
    seconds = time.perf_counter() - start
    assert seconds < 20, seconds  # import, propagate, lower, print: seconds, room for load
    assert manifest["shape_only"] and not (tmp_path / "out" / "weights").exists()
    assert all(d["file"] is None for d in manifest["devices"])
    # Megatron over axis 1: two all_reduces a layer, and one after the embedding (a reduce_scatter
    # and an all_gather below the next elementwise op would send the same bytes in two).
    kinds = [c["kind"] for c in manifest["collectives"]]
    assert kinds == ["all_reduce"] * (1 + 2 * 32), sorted(set(kinds))
    text = (tmp_path / "out" / "spmd.mlir").read_text()
    assert text.startswith("module {\n  mesh.mesh @mesh0(shape = 2x4)")

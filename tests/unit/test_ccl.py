"""The CCL passes (docs/design/lowering.md): each rewrite's exact collectives, its bytes, and its
meaning — the program is executed on every device before and after (collectives by
`execute.simulate`, the few ops involved with numpy) and must give the same outputs as the original
graph."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from autoshard.annotations import Annotation
from autoshard.collectives import CollectiveKind
from autoshard.cost.cluster import make_cluster
from autoshard.cost.price import collective_time
from autoshard.execute.simulate import run_collective, shard
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.passes.ccl import (
    _cheaper,
    _decompose,
    _move_down,
    _Rewrite,
    fuse_reshards,
    move_all_gathers_down,
    optimize_collectives,
    passes,
    reassociate,
)
from autoshard.passes.materialize import materialize
from autoshard.program import Communicate, Compute, Program
from autoshard.propagate import propagate
from autoshard.reshard import plan_reshard
from autoshard.sharding import Sharding, ShardingOption

S = Sharding.parse
NUMPY = {
    "MatMul": np.matmul,
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Max": np.maximum,
    "Relu": lambda x: np.maximum(x, 0),
}


def write_model(path, nodes, inputs, outputs, weights=()):
    """A float32 model; `inputs`/`outputs` are (name, shape) pairs, weights (name, array)."""
    graph = helper.make_graph(
        nodes,
        "m",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [numpy_helper.from_array(a.astype(np.float32), n) for n, a in weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return import_onnx(path)


def run(program: Program, graph, feeds):
    """Every device's local tensors through the program; the outputs reassembled."""
    mesh = program.mesh
    local = {}
    for name, array in {**feeds, **program.constants}.items():
        local[name] = shard(array, program.tensors[name].sharding, mesh)
    for step in program.steps:
        if isinstance(step, Communicate):
            local[step.target] = run_collective(step.collective, mesh, local[step.source])
        else:
            fn = NUMPY[step.op.type]
            local[step.outputs[0]] = {
                d: fn(*(local[x][d] for x in step.inputs)) for d in mesh.devices()
            }
    results = []
    for name in program.outputs:
        tensor = program.tensors[name]
        assert not tensor.sharding.partial_axes
        out = np.zeros(tensor.shape, np.float32)
        for device, array in local[name].items():
            out[
                tuple(slice(a, b) for a, b in tensor.sharding.slices(mesh, tensor.shape, device))
            ] = array
        results.append(out)
    return results


def reference(graph, feeds):
    values = {**graph.constants, **feeds}
    for op in graph.ops:
        values[op.outputs[0]] = NUMPY[op.type](*(values[x] for x in op.inputs))
    return [values[o] for o in graph.outputs]


def steps(program):
    return [str(s.collective) if isinstance(s, Communicate) else s.op.type for s in program.steps]


def check_same_meaning(graph, before, after, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {n: rng.standard_normal(graph.values[n].shape).astype(np.float32) for n in graph.inputs}
    feeds |= {n: w.load() for n, w in graph.weights.items()}
    want = reference(graph, feeds)
    for program in (before, after):
        for got, expected in zip(run(program, graph, feeds), want, strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert after.bytes_per_device <= before.bytes_per_device


# ---- all-reduce decompose & all-gather move down ----------------------------------------------


def test_seed_004_all_reduce_decomposed_and_all_gather_moved_below_the_max(tmp_path):
    """The "Mesh CCL Optimization" of docs/design/lowering.md: the all_reduce of dot1 becomes a
    reduce_scatter and an all_gather below the max. The scattered sharding is
    [[], [], [1, 2, 0]]: the reduce_scatter appends axis 0 innermost, and no reduce_scatter
    reaches [[], [], [0, 1, 2]] from [[], [], [1, 2]] partial = sum[0] (device (0, 0, 1) holds
    partial columns 8..16 but would need 4..8); its tensor axis is 2. Bytes are unchanged
    (256 = 128 + 128): the max computes a quarter less, but for two collectives instead of
    one, so `optimize_collectives` keeps the all_reduce (as upstream MLIR and XLA do); the
    split is taken when it saves bytes."""
    from tests.golden.seed_models import write_seed_mlp

    graph = import_onnx(write_seed_mlp(tmp_path / "mlp.onnx", "mlp_2d_weight_stationary"))
    annotations = [
        Annotation("x", S("[[], [], [0, 1, 2]]")),
        Annotation("h", S("[[], [], [1, 2]] partial = sum[0]")),
        Annotation("y", S("[[], [], [0]] partial = sum[1, 2]")),
        Annotation("y", S("[[], [], [0, 1, 2]]"), for_users=True),
    ]
    before = materialize(graph, propagate(graph, Mesh((2, 2, 2)), annotations))
    after = before
    for run in passes(split=True):
        after = run(after, graph)
    assert steps(after) == [
        "all_gather mesh_axes = [1, 2] gather_axis = 2",
        "MatMul",
        "reduce_scatter mesh_axes = [0] reduction = sum scatter_axis = 2",
        "all_slice mesh_axes = [1, 2, 0] slice_axis = 2",
        "Max",
        "all_gather mesh_axes = [0] gather_axis = 2",
        "MatMul",
        "reduce_scatter mesh_axes = [1, 2] reduction = sum scatter_axis = 2",
    ]
    tensors = after.tensors
    shardings = {
        s.op.name: (str(s.option), [str(tensors[x].sharding) for x in s.inputs])
        for s in after.steps
        if isinstance(s, Compute)
    }
    assert shardings["max"] == ("[[], [], [1, 2, 0]]", ["[[], [], [1, 2, 0]]"] * 2)
    assert [c.collective.bytes_per_device for c in after.communications] == [96, 128, 0, 128, 96]
    assert before.bytes_per_device == after.bytes_per_device == 448
    check_same_meaning(graph, before, after)
    # The same bytes in two collectives where upstream sends one: the passes keep the all_reduce.
    chosen = optimize_collectives(before, graph)
    assert steps(chosen) == [
        "all_gather mesh_axes = [1, 2] gather_axis = 2",
        "MatMul",
        "all_reduce mesh_axes = [0] reduction = sum",
        "all_slice mesh_axes = [1, 2] slice_axis = 2",
        "Max",
        "MatMul",
        "reduce_scatter mesh_axes = [1, 2] reduction = sum scatter_axis = 2",
    ]
    assert chosen.bytes_per_device == 448


# ---- fuse_reshards -------------------------------------------------------------------------------


@pytest.fixture
def dot(tmp_path):
    """h = x @ w (x 4x8, w 8x4), y = relu(h); contraction split over both axes of a 2x2 mesh."""
    rng = np.random.default_rng(1)
    return write_model(
        tmp_path / "dot.onnx",
        [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="dot"),
            helper.make_node("Relu", ["h"], ["y"], name="relu"),
        ],
        [("x", [4, 8])],
        [("y", [4, 4])],
        [("w", rng.standard_normal((8, 4)))],
    )


MESH = Mesh((2, 2))


def test_all_reduce_folding(dot):
    """The dot sums over both mesh axes, h is held partial over [1] (all_reduce [0]), then relu
    reads it whole (all_reduce [1]): one all_reduce over [0, 1] moves 1.5 T instead of 2 T."""
    annotations = [Annotation("h", S("[[]] partial = sum[1]")), Annotation("y", S("[[]]"))]
    option = {"dot": ShardingOption.parse("[[], [], [0, 1]]", 3)}
    before = materialize(dot, propagate(dot, MESH, annotations, option))
    assert steps(before) == [
        "MatMul",
        "all_reduce mesh_axes = [0] reduction = sum",
        "all_reduce mesh_axes = [1] reduction = sum",
        "Relu",
    ]
    after = fuse_reshards(before, dot)
    assert steps(after) == ["MatMul", "all_reduce mesh_axes = [0, 1] reduction = sum", "Relu"]
    # h is 4x4 float32 = 64 B: 2 * (1/2) * 64 twice, then 2 * (3/4) * 64.
    assert (before.bytes_per_device, after.bytes_per_device) == (128, 96)
    check_same_meaning(dot, before, after)


def test_all_reduce_then_all_slice_is_a_reduce_scatter(dot):
    """h held replicated (all_reduce), relu reads rows split (all_slice): one reduce_scatter."""
    annotations = [
        Annotation("x", S("[[], [0]]")),
        Annotation("h", S("[[]]")),
        Annotation("h", S("[[0]]"), for_users=True),
    ]
    before = materialize(dot, propagate(dot, MESH, annotations))
    assert steps(before) == [
        "MatMul",
        "all_reduce mesh_axes = [0] reduction = sum",
        "all_slice mesh_axes = [0] slice_axis = 0",
        "Relu",
    ]
    after = optimize_collectives(before, dot)
    assert steps(after)[:3] == [
        "MatMul",
        "reduce_scatter mesh_axes = [0] reduction = sum scatter_axis = 0",
        "Relu",
    ]
    check_same_meaning(dot, before, after)


def test_a_collective_read_twice_is_not_fused(dot):
    """The replicated h is also a graph output: its all_reduce must stay."""
    graph = dot
    annotations = [Annotation("x", S("[[], [0]]")), Annotation("h", S("[[]]"))]
    program = materialize(graph, propagate(graph, MESH, annotations))
    assert steps(fuse_reshards(program, graph)) == steps(program)


# ---- reassociate --------------------------------------------------------------------------------


@pytest.fixture(params=["Add", "Sub", "Mul"])
def two_dots(request, tmp_path):
    rng = np.random.default_rng(2)
    graph = write_model(
        tmp_path / "two.onnx",
        [
            helper.make_node("MatMul", ["x", "w1"], ["a"], name="dot1"),
            helper.make_node("MatMul", ["x", "w2"], ["b"], name="dot2"),
            helper.make_node(request.param, ["a", "b"], ["y"], name="combine"),
        ],
        [("x", [4, 8])],
        [("y", [4, 6])],
        [("w1", rng.standard_normal((8, 6))), ("w2", rng.standard_normal((8, 6)))],
    )
    return request.param, graph


@pytest.mark.parametrize("target", ["[[]]", "[[], [0]]"])
def test_reassociation(two_dots, target):
    """add(all_reduce(a), all_reduce(b)) -> all_reduce(add(a, b)); to a split target, the same
    with reduce_scatter. Mul does not commute with a sum: nothing changes."""
    kind, graph = two_dots
    annotations = [
        Annotation("a", S(target), for_users=True),
        Annotation("b", S(target), for_users=True),
    ]
    summed = ShardingOption.parse("[[], [], [0]]", 3)
    before = materialize(
        graph, propagate(graph, MESH, annotations, {"dot1": summed, "dot2": summed})
    )
    collective = "all_reduce mesh_axes = [0] reduction = sum"
    if target != "[[]]":
        collective = "reduce_scatter mesh_axes = [0] reduction = sum scatter_axis = 1"
    assert steps(before).count(collective) == 2
    after = reassociate(before, graph)
    if kind == "Mul":
        assert steps(after) == steps(before)
    else:
        assert steps(after).count(collective) == 1
        assert steps(after)[-1] == collective
        assert after.bytes_per_device * 2 == before.bytes_per_device
    check_same_meaning(graph, before, after)


# ---- move_all_gathers_down -----------------------------------------------------------------------


def test_all_gather_moves_below_elementwise_ops(tmp_path):
    """relu reads x whole, then an add with a replicated weight: the all_gather moves below
    both; the weight is cut locally (free)."""
    rng = np.random.default_rng(3)
    graph = write_model(
        tmp_path / "chain.onnx",
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Add", ["r", "b"], ["y"], name="add"),
        ],
        [("x", [8, 4])],
        [("y", [8, 4])],
        [("b", rng.standard_normal((8, 4)))],
    )
    annotations = [
        Annotation("x", S("[[0, 1]]")),
        Annotation("x", S("[[]]"), for_users=True),
        Annotation("b", S("[[]]")),
    ]
    before = materialize(graph, propagate(graph, MESH, annotations))
    assert steps(before) == ["all_gather mesh_axes = [0, 1] gather_axis = 0", "Relu", "Add"]
    after = move_all_gathers_down(before, graph)
    assert steps(after) == [
        "Relu",
        "all_slice mesh_axes = [0, 1] slice_axis = 0",
        "Add",
        "all_gather mesh_axes = [0, 1] gather_axis = 0",
    ]
    assert after.bytes_per_device == before.bytes_per_device
    check_same_meaning(graph, before, after)


def test_a_collective_above_a_moved_all_gather_moves_next(dot):
    """The dot sums over axis 1 with rows split over axis 0; relu reads h whole: all_reduce
    [1], then all_gather [0]. The all_reduce cannot split while the all_gather reads it; once
    the all_gather moves below relu, relu reads the all_reduce, which splits and its
    all_gather moves too: the walk steps back to it (the decompose-and-move pair, one step
    removed)."""
    options = {
        "dot": ShardingOption.parse("[[0], [], [1]]", 3),
        "relu": ShardingOption.parse("[[]]", 2),
    }
    before = materialize(dot, propagate(dot, MESH, [], options))
    assert steps(before) == [
        "MatMul",
        "all_reduce mesh_axes = [1] reduction = sum",
        "all_gather mesh_axes = [0] gather_axis = 0",
        "Relu",
    ]
    after = move_all_gathers_down(before, dot)
    assert steps(after) == [
        "MatMul",
        "reduce_scatter mesh_axes = [1] reduction = sum scatter_axis = 0",
        "Relu",
        "all_gather mesh_axes = [1] gather_axis = 0",
        "all_gather mesh_axes = [0] gather_axis = 0",
    ]
    assert after.bytes_per_device == before.bytes_per_device
    check_same_meaning(dot, before, after)


def restarting(program, graph, split):
    """`move_all_gathers_down` as first written, the oracle of its one walk: rewrite the first
    collective that can move (or split), then start again from the first step."""
    rw = _Rewrite(program, graph)
    while True:
        for at, step in rw.walk():
            if not isinstance(step, Communicate):
                continue
            kind = step.collective.kind
            if kind is CollectiveKind.ALL_GATHER and _move_down(at, rw) is not None:
                break
            if split and kind is CollectiveKind.ALL_REDUCE and _decompose(at, rw) is not None:
                break
        else:
            return rw.result()


@pytest.mark.parametrize("split", [False, True], ids=["moves", "splits and moves"])
def test_one_walk_rewrites_as_restarting_after_every_rewrite(tmp_path, split):
    """Three layers of y = relu(x @ w) + b, each dot summing over axis 1 with rows split over
    axis 0, relu and add reading whole: each layer's all_gather moves below relu and then
    below add; with `split`, each all_reduce splits once its all_gather has moved (the walk
    steps back to it), and that all_gather moves twice too. The one walk gives the program
    the restarting walk gives, step for step and tensor for tensor (fresh names follow the
    order of the rewrites)."""
    rng = np.random.default_rng(5)
    nodes, weights, options, x = [], [], {}, "x"
    for i in range(3):
        nodes += [
            helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"], name=f"dot{i}"),
            helper.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}"),
            helper.make_node("Add", [f"r{i}", f"b{i}"], [f"y{i}"], name=f"add{i}"),
        ]
        weights += [(f"w{i}", rng.standard_normal((8, 8))), (f"b{i}", rng.standard_normal((4, 8)))]
        options[f"dot{i}"] = ShardingOption.parse("[[0], [], [1]]", 3)
        options[f"relu{i}"] = options[f"add{i}"] = ShardingOption.parse("[[]]", 2)
        x = f"y{i}"
    graph = write_model(tmp_path / "layers.onnx", nodes, [("x", [4, 8])], [("y2", [4, 8])], weights)
    before = materialize(graph, propagate(graph, MESH, [], options))
    layer = ["MatMul", "all_reduce mesh_axes = [1] reduction = sum",
             "all_gather mesh_axes = [0] gather_axis = 0", "Relu", "Add"]  # fmt: skip
    assert steps(before)[:5] == layer
    after = move_all_gathers_down(before, graph, split)
    expected = restarting(before, graph, split)
    assert (after.steps, after.tensors) == (expected.steps, expected.tensors)
    gathers = ["all_gather mesh_axes = [1] gather_axis = 0"] * split + [
        "all_gather mesh_axes = [0] gather_axis = 0"
    ]
    assert steps(after)[-len(gathers) - 1 :] == ["Add", *gathers]
    assert steps(after).count("Relu") == 3 and steps(after).count(gathers[-1]) == 3
    first_add = steps(after).index("Add")
    assert not any("all_gather" in s for s in steps(after)[:first_add])
    check_same_meaning(graph, before, after)


def test_all_gather_stays_above_a_broadcast(tmp_path):
    """y = x + c with x [1, 4] broadcast to c's [8, 4]: moving the gather down would send 8x
    the bytes, so it stays."""
    rng = np.random.default_rng(4)
    graph = write_model(
        tmp_path / "bcast.onnx",
        [helper.make_node("Add", ["x", "c"], ["y"], name="add")],
        [("x", [1, 4])],
        [("y", [8, 4])],
        [("c", rng.standard_normal((8, 4)))],
    )
    annotations = [
        Annotation("x", S("[[], [0]]")),
        Annotation("x", S("[[]]"), for_users=True),
        Annotation("y", S("[[]]")),
    ]
    before = materialize(graph, propagate(graph, MESH, annotations))
    after = optimize_collectives(before, graph)
    assert steps(after) == steps(before)


def test_an_unread_collective_is_dropped(tmp_path):
    """r is produced rows-split and held whole (required), but its only reader reads it
    rows-split, from the produced tensor: the all_gather is dead and goes."""
    graph = write_model(
        tmp_path / "twice.onnx",
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu1"),
            helper.make_node("Relu", ["r"], ["y"], name="relu2"),
        ],
        [("x", [8, 4])],
        [("y", [8, 4])],
    )
    annotations = [Annotation("x", S("[[0]]")), Annotation("r", S("[[]]"))]
    rows = {n: ShardingOption.parse("[[0]]", 2) for n in ("relu1", "relu2")}
    before = materialize(graph, propagate(graph, MESH, annotations, rows))
    assert steps(before) == ["Relu", "all_gather mesh_axes = [0] gather_axis = 0", "Relu"]
    after = optimize_collectives(before, graph)
    assert steps(after) == ["Relu", "Relu"]
    check_same_meaning(graph, before, after)


def test_a_chain_back_to_its_start_vanishes():
    """BERT on 2x3 with annotations that make the CCL passes build a reshard chain returning
    to its start sharding: the chain goes and its reader reads the source (this once read an
    undefined tensor)."""
    from pathlib import Path

    models = Path(__file__).resolve().parents[2] / "models"
    graph = import_onnx(models / "bert.onnx", {"batch": 2, "seq": 6})
    layer = "/bert/encoder/layer.0"
    annotations = [
        Annotation(f"{layer}/attention/output/dense/Add_output_0", S("[[], [1], [0]]"),
                   for_users=True),
        Annotation("/bert/Constant_26_output_0", S("[[1]]"), required=False),
        Annotation(f"{layer}/output/dense/Add_output_0", S("[[0]]"), required=False,
                   for_users=True),
    ]  # fmt: skip
    program = optimize_collectives(
        materialize(graph, propagate(graph, Mesh((2, 3)), annotations)), graph
    )
    defined = set(program.inputs) | set(program.constants)
    for step in program.steps:
        assert all(not name or name in defined for name in step.inputs), step
        defined |= set(step.outputs)
    assert set(program.outputs) <= defined


def test_a_reshard_through_a_sharding_already_held_reuses_it(tmp_path):
    """h is produced [[1]] partial = sum[0]; relu1 reads it [[1]] (all_reduce [0]); relu2
    reads it whole, which the planner reaches through [[1]] again: the all_reduce is not
    repeated and every tensor is defined once."""
    rng = np.random.default_rng(5)
    graph = write_model(
        tmp_path / "fork.onnx",
        [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="dot"),
            helper.make_node("Relu", ["h"], ["y1"], name="relu1"),
            helper.make_node("Relu", ["h"], ["y2"], name="relu2"),
        ],
        [("x", [8, 8])],
        [("y1", [8, 8]), ("y2", [8, 8])],
        [("w", rng.standard_normal((8, 8)))],
    )
    options = {
        "dot": ShardingOption.parse("[[1], [], [0]]", 3),
        "relu1": ShardingOption.parse("[[1]]", 2),
        "relu2": ShardingOption.parse("[[]]", 2),
    }
    program = materialize(graph, propagate(graph, MESH, [], options))
    assert steps(program) == [
        "MatMul",
        "all_reduce mesh_axes = [0] reduction = sum",
        "Relu",
        "all_gather mesh_axes = [1] gather_axis = 0",
        "Relu",
    ]
    defined = [name for step in program.steps for name in step.outputs]
    assert len(defined) == len(set(defined))
    check_same_meaning(graph, program, optimize_collectives(program, graph))


def test_a_chain_is_not_fused_into_one_group_over_slower_axes():
    """A gather over [1] then one over [0] of a [64, 8] tensor split [[0, 1]] on 2x4: one
    all_gather over [0, 1] sends the same bytes in one collective, all over axis 0's link (a
    group runs at its slowest axis), which costs more where axis 0 is slower (across nodes);
    the materialized chain, the one the search priced, stays. Two all_reduces folded into one
    send fewer bytes and fuse."""
    mesh, shape = Mesh((2, 4)), (64, 8)
    chain = plan_reshard(S("[[0, 1]]"), S("[[0]]"), shape, mesh)
    chain += plan_reshard(S("[[0]]"), S("[[]]"), shape, mesh)
    fused = plan_reshard(S("[[0, 1]]"), S("[[]]"), shape, mesh)
    assert [c.mesh_axes for c in chain] == [(1,), (0,)]
    assert [c.mesh_axes for c in fused] == [(0, 1)]
    assert sum(c.bytes_per_device for c in chain) == fused[0].bytes_per_device
    assert not _cheaper(fused, chain)
    cluster = make_cluster(mesh="2x4", bandwidth=["25GB/s", "450GB/s"])
    assert collective_time(fused[0], cluster) > sum(collective_time(c, cluster) for c in chain)
    partial = S("[[]] partial = sum[0, 1]")
    folded = plan_reshard(partial, S("[[]]"), shape, mesh)
    steps = plan_reshard(partial, S("[[]] partial = sum[1]"), shape, mesh)
    steps += plan_reshard(S("[[]] partial = sum[1]"), S("[[]]"), shape, mesh)
    assert len(folded) == 1 and _cheaper(folded, steps)

"""The MLIR notation (autoshard.mlir): the design pages' MLP printed exactly, print -> parse -> the
same program in both spellings, local types of uneven shards, every attribute kind, the examples of
docs/design/collectives.md read verbatim, `autoshard propagate --emit mlir`. Upstream mlir-opt-22
checks are in tests/golden/test_upstream_mlir.py."""
# ruff: noqa: E501 (golden MLIR lines are as long as the printer makes them)

import subprocess
import sys

import numpy as np
import pytest

from autoshard.annotations import Annotation
from autoshard.errors import AutoshardError
from autoshard.ir import dtypes
from autoshard.ir.graph import Op
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.mlir import MlirError, parse_module, print_program
from autoshard.mlir.syntax import SymbolRef, TensorType
from autoshard.passes.materialize import materialize
from autoshard.program import Communicate, Compute, Program, Tensor
from autoshard.propagate import propagate
from autoshard.reshard import plan_reshard
from autoshard.sharding import ReductionKind, Sharding, ShardingOption
from tests.golden.seed_models import write_seed_mlp

S = Sharding.parse
DIALECTS = ["mesh", "shard"]


def assert_same_program(got: Program, want: Program) -> None:
    assert (got.name, got.mesh, got.inputs, got.outputs) == (
        want.name,
        want.mesh,
        want.inputs,
        want.outputs,
    )
    assert dict(got.tensors) == dict(want.tensors)
    assert got.steps == want.steps
    assert got.unruled == want.unruled
    assert list(got.constants) == list(want.constants)
    for name, array in want.constants.items():
        back = got.constants[name]
        assert back.dtype == array.dtype and back.shape == array.shape
        assert np.array_equal(back, array)


@pytest.fixture(scope="module")
def seed_001(tmp_path_factory):
    graph = import_onnx(write_seed_mlp(tmp_path_factory.mktemp("mlir") / "mlp.onnx"))
    annotations = [
        Annotation("x", S("[[], [], [0]]")),
        Annotation("y", S("[[]] partial = sum[0]")),
        Annotation("y", S("[[], [], [0]]"), for_users=True),
    ]
    return materialize(graph, propagate(graph, Mesh((2,)), annotations))


SEED_001_MESH = """\
module {
  mesh.mesh @mesh0(shape = 2)
  func.func @mlp(%arg0: tensor<2x4x4xf32>, %arg1: tensor<8x16xf32>, %arg2: tensor<16x8xf32>) -> tensor<2x4x4xf32> {
    %sharding = mesh.sharding @mesh0 split_axes = [[], [], [0]] : !mesh.sharding
    %sharding_1 = mesh.sharding @mesh0 split_axes = [[], [0]] : !mesh.sharding
    %sharding_2 = mesh.sharding @mesh0 split_axes = [[0]] : !mesh.sharding
    %sharding_3 = mesh.sharding @mesh0 split_axes = [[]] : !mesh.sharding
    %sharding_4 = mesh.sharding @mesh0 split_axes = [[]] partial = sum[0] : !mesh.sharding
    %x = mesh.shard %arg0 to %sharding : tensor<2x4x4xf32> loc("x")
    %w1 = mesh.shard %arg1 to %sharding_1 : tensor<8x16xf32> loc("w1")
    %w2 = mesh.shard %arg2 to %sharding_2 : tensor<16x8xf32> loc("w2")
    %1 = "onnx.Constant"() {value = dense<0.0> : tensor<2x4x32xf32>} : () -> tensor<2x4x32xf32>
    %zero = mesh.shard %1 to %sharding_3 : tensor<2x4x32xf32> loc("zero")
    %2 = mesh.all_gather %x on @mesh0 mesh_axes = [0] gather_axis = 2 : tensor<2x4x4xf32> -> tensor<2x4x8xf32>
    %x_1 = mesh.shard %2 to %sharding_3 : tensor<2x4x8xf32> loc("x~1"("x"))
    %3 = "onnx.MatMul"(%x_1, %w1) {sharding = "[[], [], [0], []]"} : (tensor<2x4x8xf32>, tensor<8x16xf32>) -> tensor<2x4x16xf32> loc("dot1")
    %h = mesh.shard %3 to %sharding : tensor<2x4x16xf32> loc("h")
    %4 = mesh.all_slice %zero on @mesh0 mesh_axes = [0] slice_axis = 2 : tensor<2x4x32xf32> -> tensor<2x4x16xf32>
    %zero_1 = mesh.shard %4 to %sharding : tensor<2x4x16xf32> loc("zero~1"("zero"))
    %5 = "onnx.Max"(%h, %zero_1) {sharding = "[[], [], [0]]"} : (tensor<2x4x16xf32>, tensor<2x4x16xf32>) -> tensor<2x4x16xf32> loc("max")
    %r = mesh.shard %5 to %sharding : tensor<2x4x16xf32> loc("r")
    %6 = "onnx.MatMul"(%r, %w2) {sharding = "[[], [], [], [0]]"} : (tensor<2x4x16xf32>, tensor<16x8xf32>) -> tensor<2x4x8xf32> loc("dot2")
    %y = mesh.shard %6 to %sharding_4 : tensor<2x4x8xf32> loc("y")
    %7 = mesh.reduce_scatter %y on @mesh0 mesh_axes = [0] reduction = <sum> scatter_axis = 2 : tensor<2x4x8xf32> -> tensor<2x4x4xf32>
    %y_1 = mesh.shard %7 to %sharding : tensor<2x4x4xf32> loc("y~1"("y"))
    return %y_1 : tensor<2x4x4xf32>
  }
}
"""


def test_seed_001_prints_exactly(seed_001):
    # Local types: x 2x4x8 split over 2 on dim 2 is 2x4x4 per device, W1 8x32 is 8x16.
    assert print_program(seed_001) == SEED_001_MESH


def test_shard_spelling_differs_only_where_upstream_renamed(seed_001):
    text = print_program(seed_001, "shard")
    assert "shard.grid @mesh0(shape = 2)" in text
    assert "shard.all_gather %x on @mesh0 grid_axes = [0] gather_axis = 2" in text
    assert "shard.reduce_scatter %y on @mesh0 grid_axes = [0] reduction = sum scatter_axis" in text
    # LLVM 22's shard.sharding has no partial axes: they ride in its attribute dict.
    assert 'split_axes = [[]] {partial = "sum[0]"} : !shard.sharding' in text
    assert "mesh." not in text


@pytest.mark.parametrize("dialect", DIALECTS)
def test_seed_001_round_trip(seed_001, dialect):
    text = print_program(seed_001, dialect)
    module = parse_module(text)
    assert module.mesh == Mesh((2,)) and module.func == "mlp"
    back = module.to_program()
    assert_same_program(back, seed_001)
    assert print_program(back, dialect) == text  # and byte-identical again
    # Op order and collectives as the seed materializes them.
    kinds = [op.kind for op in module.ops if op.kind not in ("sharding", "shard")]
    assert kinds == [
        "Constant",
        "all_gather",
        "MatMul",
        "all_slice",
        "Max",
        "MatMul",
        "reduce_scatter",
    ]


def chain(mesh, value, shape, start, targets, tensors, steps, dtype="float32"):
    """Reshard `value` from tensor `start` through each target with plan_reshard's collectives."""
    current = start
    for target in targets:
        itemsize = dtypes.nbytes(dtype, 1)
        for c in plan_reshard(tensors[current].sharding, S(target), shape, mesh, itemsize):
            name = f"{value}~{len([t for t in tensors.values() if t.value == value])}"
            tensors[name] = Tensor(name, value, shape, dtype, c.dst)
            steps.append(Communicate(current, name, c))
            current = name
    return current


@pytest.fixture(scope="module")
def rich_program():
    """Every collective kind, uneven shards, awkward names, every attribute kind, an absent
    operand and result, a non-default domain, a multi-result op, named mesh axes."""
    mesh = Mesh((2, 2), ("dp", "tp"))
    x, c0 = "in/put:0", "onnx::Const_7"
    tensors = {
        x: Tensor(x, x, (6, 4), "float32", S("[[0, 1]]")),
        c0: Tensor(c0, c0, (2,), "int64", S("[[]]")),
    }
    steps = []
    # permute ([[0, 1]] -> [[1, 0]]), gather, slice, all_to_all.
    a = chain(mesh, x, (6, 4), x, ["[[1, 0]]", "[[]]", "[[], [0]]", "[[0], []]"], tensors, steps)
    attrs = {
        "i": 3,
        "f": float(np.float32(1e-5)),  # ONNX float attributes are float32
        "inf": float("inf"),
        "s": 'a"b\\c/d\n',
        "ints": (1, -2),
        "floats": (0.5, float(np.float32(1e-3))),
        "strings": ("p", "q::r"),
        "t": np.arange(6, dtype=np.int64).reshape(2, 3),
        "big": np.arange(200, dtype=np.float32) / 7,
        "mask": np.array([True, False, True]),
        "half": np.array([1.5, -2.25], np.float16),
        "empty": (),
        "tensors": (np.array(1.5, np.float32), np.zeros((0, 2), np.int32)),
    }
    op = Op("9 fused/op.1", "Fused", "com.example", (a, "", c0), ("o::1", "", "o.2"), attrs)
    tensors["o::1"] = Tensor("o::1", "o::1", (6, 4), "float32", S("[[0]] partial = sum[1]"))
    tensors["o.2"] = Tensor("o.2", "o.2", (3,), "bool", S("[[]] partial = max[0, 1]"))
    steps.append(Compute(op, ShardingOption(((0,), (), (1,)))))
    out1 = chain(mesh, "o::1", (6, 4), "o::1", ["[[0, 1]]"], tensors, steps)
    out2 = chain(mesh, "o.2", (3,), "o.2", ["[[]]"], tensors, steps, "bool")
    unruled = Op("plain", "Identity", "", (out2,), ("p",))
    tensors["p"] = Tensor("p", "p", (3,), "bool", S("[[]]"))
    steps.append(Compute(unruled, None))
    constants = {c0: np.array([4, -1], np.int64)}
    return Program(
        "my model", mesh, tensors, (x,), (out1, "p"), tuple(steps), constants, ("plain",)
    )


def test_rich_program_has_every_collective(rich_program):
    kinds = [str(s.collective.kind) for s in rich_program.communications]
    assert kinds == [
        "permute",
        "all_gather",
        "all_slice",
        "all_to_all",
        # o::1 [[0]] partial = sum[1] -> [[0, 1]]: the uneven 6 rows cannot be reduce-scattered
        # from 3-row shards; moving axis 0 to the columns first makes it exact (66 bytes, where
        # all_reduce, all_gather, all_slice send 96).
        "all_to_all",
        "reduce_scatter",
        "all_to_all",
        "all_reduce",
    ]


@pytest.mark.parametrize("dialect", DIALECTS)
def test_rich_program_round_trip(rich_program, dialect):
    text = print_program(rich_program, dialect)
    back = parse_module(text).to_program()
    # Collectives come back equal, bytes per device included (recomputed by the parser).
    assert_same_program(back, rich_program)
    assert print_program(back, dialect) == text
    assert print_program(rich_program, dialect) == text  # deterministic


def test_rich_program_text(rich_program):
    text = print_program(rich_program, "shard")
    # Uneven shards: 6 rows over 4 devices are 2, 2, 2, 0 -> `?` and explicit offsets.
    assert (
        "shard.sharding @mesh0 split_axes = [[0, 1]] sharded_dims_offsets = [0, 2, 4, 6, 6]" in text
    )
    assert '= shard.shard %arg0 to %sharding : tensor<?x4xf32> loc("in/put:0")' in text
    # SSA names are sanitized (a leading digit, `/`, `:` replaced); locations keep the names.
    assert "%in_put_0 = shard.shard" in text and 'loc("9 fused/op.1")' in text
    assert 'shard.grid @mesh0(shape = 2x2) {axis_names = ["dp", "tp"]}' in text
    assert 'func.func @"my model"(' in text
    assert '"autoshard.permute"(%in_put_0) {grid = @mesh0, grid_axes = array<i16: 0, 1>, ' in text
    assert "source_target_pairs = dense<[[2, 1], [1, 2]]> : tensor<2x2xi64>}" in text
    fused = next(line for line in text.splitlines() if '"onnx.Fused"' in line)
    for piece in [
        "%7:3 = ",
        "i = 3 : i64",
        "f = 1.0e-05 : f32",
        "inf = 0x7F800000 : f32",
        r's = "a\22b\5Cc/d\0A"',
        "ints = [1, -2]",
        "floats = [0.5 : f32, 0.001 : f32]",
        'strings = ["p", "q::r"]',
        "t = dense<[[0, 1, 2], [3, 4, 5]]> : tensor<2x3xi64>",
        'big = dense<"0x00000000',
        "mask = dense<[true, false, true]> : tensor<3xi1>",
        "half = dense<[1.5, -2.25]> : tensor<2xf16>",
        "empty = []",
        "tensors = [dense<1.5> : tensor<f32>, dense<> : tensor<0x2xi32>]",
        'onnx_domain = "com.example"',
        'sharding = "[[0], [], [1]]"',
        "(tensor<3x4xf32>, none, tensor<2xi64>) -> (tensor<3x4xf32>, none, tensor<3xi1>)",
    ]:
        assert piece in fused
    # The unruled op has no sharding option.
    assert '"onnx.Identity"(' in text and 'loc("plain")' in text


def test_uneven_collectives_are_cast_to_dynamic_and_back():
    mesh = Mesh((4,))
    tensors = {"x": Tensor("x", "x", (6, 8), "float32", S("[[0]]"))}
    steps = []
    out = chain(mesh, "x", (6, 8), "x", ["[[]]"], tensors, steps)
    program = Program("g", mesh, tensors, ("x",), (out,), tuple(steps))
    text = print_program(program, "shard")
    assert (
        "shard.all_gather %x on @mesh0 grid_axes = [0] gather_axis = 0 : tensor<?x8xf32> -> tensor<?x8xf32>"
        in text
    )
    assert "tensor.cast %1 : tensor<?x8xf32> to tensor<6x8xf32>" in text
    assert_same_program(parse_module(text).to_program(), program)


def test_constants_override_values():
    mesh = Mesh((2,))
    tensors = {"c": Tensor("c", "c", (3,), "int64", S("[[]]"))}
    program = Program("g", mesh, tensors, (), ("c",), (), {"c": np.array([2, 4, 8])})
    text = print_program(program, constants={"c": np.array([1, 4, 8])})
    assert "dense<[1, 4, 8]> : tensor<3xi64>" in text
    assert parse_module(text).to_program().constants["c"].tolist() == [1, 4, 8]
    with pytest.raises(MlirError, match=r"constant 'c' is int64\[3\] in the program but the value"):
        print_program(program, constants={"c": np.array([1, 2], np.int64)})
    with pytest.raises(MlirError, match="'d' is not a constant of program 'g'"):
        print_program(program, constants={"d": np.array([1])})


SEED_003 = """
// The tensor is sharded on its first dimension along axis 0 of @mesh0 and
mesh.mesh @mesh0(shape = 2x2)  // a "comment" after an op
...
%1 = mesh.all_gather %0 on @mesh0 mesh_axes = [1] gather_axis = 1
  : tensor<2x2xi8> -> tensor<2x4xi8>
%2 = mesh.all_reduce %0 on @mesh0 mesh_axes = [1, 0] reduction = <max>
  : tensor<3x4xf32> -> tensor<3x4xf64>
%3 = mesh.all_slice %0 on @mesh0 mesh_axes = [1] slice_axis = 1
  : tensor<2x4xi8> -> tensor<2x2xi8>
%4 = mesh.all_to_all %0 on @mesh0 mesh_axes = [0]
  split_axis = 0 concat_axis = 0
  : tensor<3x2xi8> -> tensor<3x2xi8>
%5 = mesh.broadcast %0 on @mesh0
  mesh_axes = [0]
  root = [0]
  : (tensor<2xi8>) -> tensor<2xi8>
%6 = mesh.reduce_scatter %0 on @mesh0 mesh_axes = [1]
  reduction = <max> scatter_axis = 0
  : tensor<3x4xf32> -> tensor<1x4xf64>
%7 = mesh.reduce %0 on @mesh0 mesh_axes = [1, 0]
  reduction = <max> root = [2, 3]
  : (tensor<3x4xf32>) -> tensor<3x4xf64>
%8 = mesh.shift %0 on @mesh0 mesh_axes = [1]
  shift_axis = 1 offset = 2 rotate
  : tensor<2xi8> -> tensor<2xi8>
%sharding2 = mesh.sharding @mesh0 split_axes = [[0]] partial = max[1] : !mesh.sharding
%sharding4 = mesh.sharding @mesh1d_4 split_axes = [[], [0]] sharded_dims_offsets = [0, 2, 5, 9, 14]
%sharded2 = mesh.shard %arg0 to %sharding4 : tensor<4x14xf32>
%halo = mesh.sharding @mesh0 split_axes = [[0]] halo_sizes = [1, 2]
%9 = mesh.shard %arg1 to %sharding annotate_for_users : tensor<16x8xf32>
"""


def test_seed_003_examples_verbatim():
    module = parse_module(SEED_003)
    assert module.mesh == Mesh((2, 2))
    ops = {op.results[0]: op for op in module.ops}
    gather = ops["%1"]
    assert gather.name == "mesh.all_gather" and gather.operands == ("%0",)
    assert dict(gather.attrs) == {"mesh": "mesh0", "mesh_axes": (1,), "gather_axis": 1}
    assert gather.result_types == (TensorType((2, 4), "int8"),)
    assert ops["%2"].attrs["reduction"] == "max" and ops["%2"].attrs["mesh_axes"] == (1, 0)
    assert ops["%2"].result_types == (TensorType((3, 4), "float64"),)
    assert ops["%3"].attrs["slice_axis"] == 1
    assert (ops["%4"].attrs["split_axis"], ops["%4"].attrs["concat_axis"]) == (0, 0)
    assert ops["%5"].attrs["root"] == (0,) and ops["%5"].kind == "broadcast"
    assert ops["%6"].attrs["scatter_axis"] == 0
    assert ops["%6"].result_types == (TensorType((1, 4), "float64"),)
    assert ops["%7"].attrs["root"] == (2, 3)
    assert ops["%8"].attrs == {
        "mesh": "mesh0",
        "mesh_axes": (1,),
        "shift_axis": 1,
        "offset": 2,
        "rotate": True,
    }
    assert ops["%sharding2"].attrs["sharding"] == Sharding(((0,),), (1,), ReductionKind.MAX)
    assert ops["%sharding4"].attrs["mesh"] == "mesh1d_4"
    assert ops["%sharding4"].attrs["sharding"].sharded_dims_offsets == (0, 2, 5, 9, 14)
    assert ops["%sharded2"].operands == ("%arg0", "%sharding4")
    assert ops["%sharded2"].attrs["annotate_for_users"] is False
    assert ops["%halo"].attrs["sharding"].halo_sizes == (1, 2)
    assert module.ops[-1].attrs["annotate_for_users"] is True
    assert module.sharding("%sharded2") == ops["%sharding4"].attrs["sharding"]


def test_generic_attributes_read_back():
    text = (
        '%0 = "onnx.X"() {a = 1.5 : f32, b = [1, 2], g = @grid0, h = "x\\22y", u, '
        'd = dense<[[1, 2]]> : tensor<1x2xui8>, e = dense<"0x0103"> : tensor<12xi1>, '
        "n = 0x7FC00000 : f32, k = array<i16: 0, 1>} : () -> tensor<2x?xbf16>"
    )
    (op,) = parse_module(text).ops
    attrs = op.attrs
    assert attrs["a"] == 1.5 and attrs["b"] == (1, 2) and attrs["g"] == SymbolRef("grid0")
    assert attrs["h"] == 'x"y' and attrs["u"] is True and attrs["k"] == (0, 1)
    assert attrs["d"].dtype == np.uint8 and attrs["d"].tolist() == [[1, 2]]
    # i1 hex is bit-packed, low bit first, as mlir-opt prints it.
    assert attrs["e"].tolist() == [True] + [False] * 7 + [True, True, False, False]
    assert np.isnan(attrs["n"])
    assert op.result_types == (TensorType((2, None), "bfloat16"),)


@pytest.mark.parametrize(
    "text, message",
    [
        ("mesh.mesh @m(shape = 2x?)", "a dynamic mesh axis '?' cannot be planned"),
        ("%0 = mesh.sharding @m split_axes = [[0]] partial = avg[1]", "unknown reduction 'avg'"),
        ("%0 = mesh.all_gather %x on @m mesh_axes = [0] gather_axis = 1 : tensor<2xq9>", "q9"),
        ('%0 = "onnx.X"() {a = } : () -> ()', "cannot read MLIR"),
        ("%0 = mesh.shard %x to %s : tensor<2xf32> loc(#loc3)", "location aliases"),
    ],
)
def test_bad_text_is_a_one_line_error(text, message):
    with pytest.raises(AutoshardError) as error:
        parse_module(text)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_collective_missing_its_dim_is_an_mlir_error():
    text = SEED_001_MESH.replace(" gather_axis = 2", "")
    with pytest.raises(MlirError, match="^mesh.all_gather %x: collective all_gather needs `dim`$"):
        parse_module(text).to_program()


def test_a_fragment_is_not_a_program():
    with pytest.raises(MlirError, match="no mesh or no function"):
        parse_module(SEED_003).to_program()


def test_unknown_dialect():
    with pytest.raises(MlirError, match="unknown dialect 'xla'; choose one of mesh, shard"):
        print_program(Program("g", Mesh((2,)), {}, (), (), ()), "xla")


@pytest.mark.parametrize("dialect", DIALECTS)
def test_cli_emit_mlir(tmp_path, dialect):
    model = write_seed_mlp(tmp_path / "mlp.onnx")
    args = ["--annotate", "x=[[], [], [0]]", "--emit", "mlir", "--dialect", dialect]
    result = subprocess.run(
        [sys.executable, "-m", "autoshard", "propagate", str(model), "--mesh", "2", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    program = parse_module(result.stdout).to_program()
    assert program.name == "mlp" and program.inputs == ("x", "w1", "w2")
    assert program.tensors["x"].sharding == S("[[], [], [0]]")
    assert result.stdout.splitlines()[1].strip().startswith(f"{dialect}.")


def test_cli_dump_after_each_stage(tmp_path, capsys):
    """--dump-after prints, to stderr and in stage order whatever the flags' order, the program
    after materialize, after the CCL passes, and after partition (what `partition` writes to
    spmd.mlir)."""
    from autoshard.cli.main import main
    from autoshard.passes.lower import lower

    model = write_seed_mlp(tmp_path / "mlp.onnx")
    ann = ["--annotate", "x=[[], [], [0]]"]
    stages = ["--dump-after", "partition", "--dump-after", "materialize", "--dump-after", "ccl"]
    assert main(["propagate", str(model), "--mesh", "2", *ann, "--json", *stages]) == 0
    dumps = capsys.readouterr().err.split("// -----// IR Dump After ")[1:]
    assert [d.split(" ", 1)[0] for d in dumps] == ["materialize", "ccl", "partition"]
    texts = [d.split("\n", 1)[1] for d in dumps]
    graph = import_onnx(model)
    plan = propagate(graph, Mesh((2,)), [Annotation("x", S("[[], [], [0]]"))])
    assert texts[0] == print_program(materialize(graph, plan))
    assert texts[1] == print_program(lower(graph, plan))
    out = tmp_path / "out"
    assert main(["partition", str(model), "--mesh", "2", *ann, "-o", str(out)]) == 0
    capsys.readouterr()
    assert texts[2] == (out / "spmd.mlir").read_text()

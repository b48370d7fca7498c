"""The IR value types, Graph queries, the networkx view and verify()."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from autoshard.errors import GraphError, ModelError
from autoshard.ir.graph import Attrs, Graph, Op, Value, Weight, verify


def v(name, *shape, dtype="float32"):
    return Value(name, shape, dtype)


def square_graph(**overrides):
    """y = (x * x) @ W + c, with c a constant: x input, W weight, c constant."""
    fields = dict(
        name="sq",
        ops=(
            Op("mul", "Mul", "", ("x", "x"), ("xx",)),
            Op("mm", "MatMul", "", ("xx", "W"), ("m",)),
            Op("add", "Add", "", ("m", "c"), ("y",)),
        ),
        values={
            x.name: x
            for x in (
                v("x", 2, 3),
                v("W", 3, 4),
                v("c", 4),
                v("xx", 2, 3),
                v("m", 2, 4),
                v("y", 2, 4),
            )
        },  # fmt: skip
        inputs=("x",),
        outputs=("y",),
        weights={"W": Weight("W", (3, 4), "float32", has_data=False)},
        constants={"c": np.zeros(4, np.float32)},
        opset=17,
    )
    fields.update(overrides)
    return Graph(**fields)


@pytest.mark.parametrize(
    "dtype, shape, size, nbytes",
    [
        ("float32", (2, 3), 6, 24),
        ("bfloat16", (4,), 4, 8),
        ("int64", (), 1, 8),
        ("bool", (5, 0), 0, 0),
        ("int4", (3,), 3, 2),  # packed two per byte, rounded up
    ],
    ids=lambda p: str(p),
)
def test_value_size_and_nbytes(dtype, shape, size, nbytes):
    value = Value("t", shape, dtype)
    assert (value.size, value.nbytes) == (size, nbytes)


@pytest.mark.parametrize("shape", [(2, None), (-1,), (2.0,)], ids=str)
def test_value_rejects_non_static_shape(shape):
    with pytest.raises(GraphError, match="value 't' has a non-static shape"):
        Value("t", shape, "float32")


def test_value_is_frozen_and_prints_tersely():
    value = Value("t", [2, 3], "float16")
    assert value.shape == (2, 3) and str(value) == "t: float16[2, 3]"
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.name = "u"  # type: ignore[misc]


def test_attrs_are_immutable_hashable_and_compare_arrays_by_value():
    a = Attrs({"perm": [1, 0], "value": np.array([1.0, 2.0], np.float32), "mode": "constant"})
    b = Attrs({"mode": "constant", "value": np.array([1.0, 2.0], np.float32), "perm": (1, 0)})
    assert a == b and hash(a) == hash(b)
    assert list(a) == ["mode", "perm", "value"]  # sorted by name
    assert a["perm"] == (1, 0)
    assert not a["value"].flags.writeable
    assert a != Attrs({"mode": "constant", "value": np.array([1.0, 2.0]), "perm": (1, 0)})
    with pytest.raises(TypeError):
        a["perm"] = (0, 1)  # type: ignore[index]


def test_op_attr_accessor_and_hash():
    op = Op("t", "Transpose", "", ["x"], ["y"], {"perm": (1, 0)})
    assert isinstance(op.attrs, Attrs)
    assert op.attr("perm") == (1, 0) and op.attr("missing", 7) == 7
    assert op == Op("t", "Transpose", "", ("x",), ("y",), Attrs({"perm": (1, 0)}))
    assert len({op, Op("t", "Transpose", "", ("x",), ("y",), {"perm": (1, 0)})}) == 1
    assert str(op) == "y = Transpose(x)"


def test_op_fields_in_spec_order_and_misuse_is_caught():
    op = Op("f", "Fancy", "com.example", ("x", ""), ("y",))
    assert (op.domain, op.inputs, str(op)) == (
        "com.example",
        ("x", ""),
        "y = com.example.Fancy(x, )",
    )
    assert Op("r", "Relu", inputs=("x",), outputs=("y",)).domain == ""
    with pytest.raises(TypeError, match="op 'mm': domain must be a str"):
        Op("mm", "MatMul", ("x", "w"), ("y",))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="op 'r': inputs must be value names, got 'x'"):
        Op("r", "Relu", "", "x", ("y",))  # type: ignore[arg-type]


def test_graph_producer_consumers_and_roles():
    graph = square_graph()
    verify(graph)
    assert graph.producer("m").name == "mm" and graph.producer("x") is None
    assert [op.name for op in graph.consumers("x")] == ["mul"]  # read twice, listed once
    assert graph.consumers("y") == ()
    roles = {name: graph.role(name) for name in graph.values}
    assert roles == {"x": "input", "W": "weight", "c": "constant", "xx": "activation",
                     "m": "activation", "y": "output"}  # fmt: skip
    assert graph.op_by_name["add"].type == "Add"


def test_graph_mappings_are_read_only():
    graph = square_graph()
    with pytest.raises(TypeError):
        graph.values["z"] = v("z", 1)  # type: ignore[index]
    assert not graph.constants["c"].flags.writeable


def test_to_networkx_is_bipartite_with_operand_and_result_indices():
    g = square_graph().to_networkx()
    assert g.nodes["value", "W"] == {"kind": "value", "shape": (3, 4), "dtype": "float32",
                                     "role": "weight"}  # fmt: skip
    assert g.nodes["op", "mm"]["type"] == "MatMul" and g.nodes["op", "mm"]["kind"] == "op"
    # x * x: two edges into mul, operands 0 and 1.
    assert sorted(d["operand"] for _, _, d in g.edges(("value", "x"), data=True)) == [0, 1]
    assert g.get_edge_data(("value", "W"), ("op", "mm")) == {1: {"operand": 1}}
    assert g.get_edge_data(("op", "add"), ("value", "y")) == {0: {"result": 0}}
    assert g.number_of_nodes() == 9 and g.number_of_edges() == 9


def broken(case):
    base = square_graph()
    ops, values = list(base.ops), dict(base.values)
    if case == "unknown-operand":
        ops[1] = Op("mm", "MatMul", "", ("xx", "ghost"), ("m",))
    elif case == "duplicate-op-name":
        ops[2] = Op("mm", "Add", "", ("m", "c"), ("y",))
    elif case == "out-of-order":
        ops = [ops[1], ops[0], ops[2]]
    elif case == "two-producers":
        ops.append(Op("again", "Neg", "", ("x",), ("m",)))
    elif case == "orphan-value":
        values["z"] = v("z", 1)
    elif case == "missing-output":
        return square_graph(outputs=("y", "nope"))
    elif case == "result-without-value":
        del values["m"]
    elif case == "weight-is-input":
        return square_graph(inputs=("x", "W"))
    return square_graph(ops=tuple(ops), values=values)


VERIFY_ERRORS = {
    "unknown-operand": "op 'mm' (MatMul) reads unknown value 'ghost'",
    "duplicate-op-name": "op name 'mm' is used twice",
    "out-of-order": "op 'mm' (MatMul) reads 'xx' before it is produced",
    "two-producers": "value 'm' produced by op 'again' (Neg) is already defined as result of op",
    "orphan-value": "value 'z' has no producer and is not an input/weight/constant",
    "missing-output": "graph output 'nope' is not a value of the graph",
    "result-without-value": "op 'mm' (MatMul) result 'm' has no Value",
    "weight-is-input": "value 'W' is both input and weight",
}


@pytest.mark.parametrize("case, message", VERIFY_ERRORS.items(), ids=VERIFY_ERRORS.keys())
def test_verify_names_the_culprit(case, message):
    with pytest.raises(GraphError) as exc_info:
        verify(broken(case))
    assert str(exc_info.value).startswith(message)


def test_weight_load_external_bfloat16_memmaps(tmp_path):
    data = np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16)
    file = tmp_path / "w.bin"
    file.write_bytes(b"\0" * 8 + data.tobytes())
    weight = Weight("w", (2, 3), "bfloat16", True, file, offset=8, length=12)
    loaded = weight.load()
    assert loaded.dtype == ml_dtypes.bfloat16 and not loaded.flags.writeable
    np.testing.assert_array_equal(loaded, data)


def test_weight_load_external_int4_unpacks(tmp_path):
    file = tmp_path / "w.bin"
    file.write_bytes(bytes([0x21, 0x43, 0x05]))  # 1, 2, 3, 4, 5 packed low nibble first
    weight = Weight("w", (5,), "int4", True, file)
    np.testing.assert_array_equal(weight.load().astype(np.int8), [1, 2, 3, 4, 5])


def test_weight_without_data_raises_naming_the_file(tmp_path):
    weight = Weight("w", (2,), "float32", False, tmp_path / "gone.bin")
    with pytest.raises(ModelError) as exc_info:
        weight.load()
    assert str(exc_info.value) == (
        f"weight 'w' has no data: external data file '{tmp_path / 'gone.bin'}' is missing"
    )

"""Repeated layers found in both exporters' graphs (`repeats.find_repeats`).

Each case is a stack of three small layers written the way one exporter writes it: the
TorchScript exporter's deduplicated parameters behind Identity nodes, a first block computing
what the others reuse (T5's position bias), a weight's Transpose in every layer, a Reshape
target that is an initializer in one layer and a Constant node in the next, the dynamo
exporter's one initializer read by every layer. The layers found are asserted op by op.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from onnx import helper

from autoshard.analysis.repeats import find_repeats
from autoshard.cost.cluster import make_cluster
from autoshard.ir.onnx_import import import_onnx
from autoshard.search.coarsen import Key, Kind, Tie
from autoshard.search.problem import decision_groups
from autoshard.training import Training, training_graph
from tests.unit.onnx_factory import F32, I64, model, rng_weight, save, tensor

H, LAYERS = 8, 3


def _layer(j: int, scale: str, bias: str, weight: str, shape: str = "") -> list:
    """Layer j of the stack on h{j} [2, 4, H]: LayerNormalization, MatMul, Relu, the residual
    Add (h{j+1}); with `shape`, the MatMul's result goes through a Reshape to [8, H] and back."""
    p = f"/l{j}"
    nodes = [
        helper.make_node("LayerNormalization", [f"h{j}", scale, bias], [f"{p}/n"], name=f"{p}/ln"),
        helper.make_node("MatMul", [f"{p}/n", weight], [f"{p}/m"], name=f"{p}/mm"),
    ]
    last = f"{p}/m"
    if shape:
        nodes += [
            helper.make_node("Reshape", [last, shape], [f"{p}/flat"], name=f"{p}/flat"),
            helper.make_node("Reshape", [f"{p}/flat", "back"], [f"{p}/back"], name=f"{p}/back"),
        ]
        last = f"{p}/back"
    nodes += [
        helper.make_node("Relu", [last], [f"{p}/r"], name=f"{p}/relu"),
        helper.make_node("Add", [f"{p}/r", f"h{j}"], [f"h{j + 1}"], name=f"{p}/add"),
    ]
    return nodes


def _stack(tmp_path, nodes, inits):
    """The model of the layers `nodes` on h0, the stem's result (x's Relu)."""
    stem = helper.make_node("Relu", ["x"], ["h0"], name="/stem")
    io = dict(inputs=[tensor("x", F32, [2, 4, H])], outputs=[tensor(f"h{LAYERS}", F32, [2, 4, H])])
    return import_onnx(save(model([stem, *nodes], inits=inits, **io), tmp_path, "stack.onnx"))


def _layers(graph, run) -> list[list[str]]:
    return [[graph.ops[i].name for i in layer] for layer in run.layers]


def _names(j: int, *ops: str) -> list[str]:
    return [f"/l{j}/{op}" for op in ops]


def _weights() -> dict:
    return {f"W{j}": rng_weight((H, H), j) for j in range(LAYERS)}


def test_torchscript_identity_of_deduplicated_parameters(tmp_path):
    """TorchScript writes equal parameters once: layer 0 reads the initializers, layers 1 and 2
    Identity nodes of them, named as the parameters were. Imported as initializers of their
    own, the three layers are alike."""
    ones, zeros = np.ones(H, np.float32), np.zeros(H, np.float32)
    nodes = [
        helper.make_node("Identity", [f"{kind}0"], [f"{kind}{j}"], name=f"Identity_{kind}{j}")
        for j in (1, 2)
        for kind in ("g", "b")
    ]
    for j in range(LAYERS):
        nodes += _layer(j, f"g{j}", f"b{j}", f"W{j}")
    graph = _stack(tmp_path, nodes, {"g0": ones, "b0": zeros, **_weights()})
    assert [op.type for op in graph.ops].count("Identity") == 0
    assert np.array_equal(graph.weights["g2"].load(), ones)
    assert graph.weights["b1"].shape == (H,)
    (run,) = find_repeats(graph).runs
    assert _layers(graph, run) == [_names(j, "ln", "mm", "relu", "add") for j in range(LAYERS)]


def test_first_layer_computes_what_the_others_reuse(tmp_path):
    """T5's first block computes the position bias from a table alone (Gather by constant
    indices, Unsqueeze) and every block adds it: the Gather and Transpose are in no layer,
    inside the first layer's span, and the layers are found whole around them."""
    nodes = []
    for j in range(LAYERS):
        p = f"/l{j}"
        nodes += [
            helper.make_node("MatMul", [f"h{j}", f"W{j}"], [f"{p}/m"], name=f"{p}/mm"),
            helper.make_node("Add", [f"{p}/m", "bias"], [f"{p}/s"], name=f"{p}/bias"),
            helper.make_node("Relu", [f"{p}/s"], [f"{p}/r"], name=f"{p}/relu"),
            helper.make_node("Add", [f"{p}/r", f"h{j}"], [f"h{j + 1}"], name=f"{p}/add"),
        ]
        if j == 0:  # the bias, computed where the first block needs it
            nodes[1:1] = [
                helper.make_node("Gather", ["table", "ids"], ["rows"], name="/l0/gather", axis=0),
                helper.make_node("Unsqueeze", ["rows", "axes"], ["bias"], name="/l0/unsqueeze"),
            ]
    inits = {"table": rng_weight((6, H), 9), "ids": np.array([5, 3, 1, 0], np.int64),
             "axes": np.array([0], np.int64)}  # fmt: skip
    graph = _stack(tmp_path, nodes, inits | _weights())
    (run,) = find_repeats(graph).runs
    assert _layers(graph, run) == [_names(j, "mm", "bias", "relu", "add") for j in range(LAYERS)]
    names = [op.name for op in graph.ops]
    assert [names[i] for i in run.span(0)] == _names(0, "mm", "gather", "unsqueeze", "bias",
                                                     "relu", "add")  # fmt: skip
    assert run.layer(names.index("/l0/gather")) is None


def test_a_weight_view_in_every_layer_joins_it(tmp_path):
    """A torch Linear's weight Transposed in every layer, right before its MatMul: computed
    from a parameter alone, it is in every layer at the same place, so it joins the layer and
    the copies share its decision."""
    nodes = []
    for j in range(LAYERS):
        nodes.append(helper.make_node("Transpose", [f"W{j}"], [f"Wt{j}"], name=f"/l{j}/wt"))
        nodes += _layer(j, "g", "b", f"Wt{j}")
    inits = {"g": np.ones(H, np.float32), "b": np.zeros(H, np.float32)}
    graph = _stack(tmp_path, nodes, inits | _weights())
    (run,) = find_repeats(graph).runs
    assert _layers(graph, run) == [
        _names(j, "ln", "mm", "relu", "add", "wt") for j in range(LAYERS)
    ]
    assert [run.span(j) for j in range(LAYERS)] == [range(1, 6), range(6, 11), range(11, 16)]
    grouping = decision_groups(graph, make_cluster("2"))
    assert grouping.copies["/l2/wt"] == "/l0/wt"
    assert grouping.ties[Key(Kind.OP, "/l2/wt")] == (Key(Kind.OP, "/l0/wt"), Tie.COPY)


def test_reshape_target_initializer_or_constant_node(tmp_path):
    """One layer's Reshape target is an int64 initializer, the next ones' a Constant node of
    the same value (exporters and their constant folding differ): alike by value."""
    target = np.array([8, H], np.int64)
    nodes = [
        helper.make_node(
            "Constant", [], [f"shape{j}"], name=f"/l{j}/shape", value=helper.make_tensor(
                f"c{j}", I64, [2], target.tolist())
        )
        for j in (1, 2)
    ]  # fmt: skip
    for j in range(LAYERS):
        nodes += _layer(j, "g", "b", f"W{j}", shape=f"shape{j}")
    inits = {"g": np.ones(H, np.float32), "b": np.zeros(H, np.float32), "shape0": target,
             "back": np.array([2, 4, H], np.int64)}  # fmt: skip
    graph = _stack(tmp_path, nodes, inits | _weights())
    assert "shape0" in graph.weights and "shape1" in graph.constants
    (run,) = find_repeats(graph).runs
    ops = ("ln", "mm", "flat", "back", "relu", "add")
    assert _layers(graph, run) == [_names(j, *ops) for j in range(LAYERS)]


def test_one_initializer_read_by_every_layer(tmp_path):
    """The dynamo exporter merges equal initializers: every layer's norm reads one `ones`."""
    nodes = [node for j in range(LAYERS) for node in _layer(j, "ones", "zeros", f"W{j}")]
    inits = {"ones": np.ones(H, np.float32), "zeros": np.zeros(H, np.float32)}
    graph = _stack(tmp_path, nodes, inits | _weights())
    (run,) = find_repeats(graph).runs
    assert _layers(graph, run) == [_names(j, "ln", "mm", "relu", "add") for j in range(LAYERS)]


def test_training_ties_layer_weights_when_a_shared_weight_breaks_the_backward(tmp_path):
    """A training step of the stack whose norms read one `ones` (dynamo): its gradients are
    summed once, in the first layer's backward, whose ops then differ from the others'. The
    layers' weights are still held alike, and their gradient syncs and updates copy the first
    in graph order (syncs run last layer first)."""
    nodes = [node for j in range(LAYERS) for node in _layer(j, "ones", "zeros", f"W{j}")]
    inits = {"ones": np.ones(H, np.float32), "zeros": np.zeros(H, np.float32)}
    step = training_graph(_stack(tmp_path, nodes, inits | _weights()), Training(), [])
    backward = [run for run in find_repeats(step).runs if step.phase(step.ops[run.start].name)
                == "backward"]  # fmt: skip
    assert max(run.count for run in backward) < LAYERS
    grouping = decision_groups(step, make_cluster("2"))
    for j in (1, 2):
        assert grouping.ties[Key(Kind.VALUE, f"W{j}")] == (Key(Kind.VALUE, "W0"), Tie.COPY)
        assert grouping.copies[f"W{j}@update"] == "W0@update"
        assert grouping.values[f"W{j}@state"].group == grouping.values["W0@state"].group
    assert grouping.copies["W0@sync"] == grouping.copies["W1@sync"] == "W2@sync"
    assert grouping.ops["W0@update"].group == grouping.ops["W2@update"].group


def test_ties_of_an_op_and_a_value_of_one_name(tmp_path):
    """ONNX names ops and values apart: layer 2's MatMul is named like its weight, W2. The op
    copies layer 0's MatMul and the weight is held as W0 is, two ties under one name."""
    nodes = [node for j in range(LAYERS) for node in _layer(j, "g", "b", f"W{j}")]
    nodes[9].name = "W2"  # layer 2's MatMul
    inits = {"g": np.ones(H, np.float32), "b": np.zeros(H, np.float32)}
    graph = _stack(tmp_path, nodes, inits | _weights())
    assert graph.ops[10].name == "W2" and graph.ops[10].type == "MatMul"
    grouping = decision_groups(graph, make_cluster("2"))
    assert grouping.ties[Key(Kind.OP, "W2")] == (Key(Kind.OP, "/l0/mm"), Tie.COPY)
    assert grouping.ties[Key(Kind.VALUE, "W2")] == (Key(Kind.VALUE, "W0"), Tie.COPY)
    assert grouping.decision(Key(Kind.OP, "W2")).name == "W2"
    assert grouping.decision(Key(Kind.VALUE, "W2")).choices


def test_torchscript_export_of_a_layer_stack(tmp_path):
    """A torch stack of three pre-norm layers exported by TorchScript: its fresh norms' equal
    weights come out as one initializer and Identity nodes; the three layers are found whole."""
    torch = pytest.importorskip("torch")

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.up, self.down = (
                torch.nn.LayerNorm(H), torch.nn.Linear(H, 2 * H), torch.nn.Linear(2 * H, H)
            )  # fmt: skip

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    torch.manual_seed(0)
    stem = torch.nn.Linear(H, H)  # the first layer reads a result, as the others do
    stack = torch.nn.Sequential(stem, *(Layer() for _ in range(LAYERS))).eval()
    path = tmp_path / "stack.onnx"
    began = time.perf_counter()
    torch.onnx.export(stack, (torch.randn(2, 4, H),), str(path), dynamo=False,
                      input_names=["x"])  # fmt: skip
    assert time.perf_counter() - began < 5
    import onnx

    assert [n.op_type for n in onnx.load(str(path)).graph.node].count("Identity") >= 2
    graph = import_onnx(path)
    (run,) = find_repeats(graph).runs
    layers = _layers(graph, run)
    assert [len(layer) for layer in layers] == [len(layers[0])] * LAYERS
    for j, layer in enumerate(layers):
        assert all(name.startswith(f"/{j + 1}/") for name in layer), layer
    inside = {name for layer in layers for name in layer}
    assert {op.name for op in graph.ops} - inside == {"/0/MatMul", "/0/Add"}

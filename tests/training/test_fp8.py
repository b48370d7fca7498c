"""fp8-mixed precision: a linear layer's matmuls (forward, and both of its backward) priced at
the device's FP8 rate, attention's matmul of two activations and every other op as in
bf16-mixed, storage in bf16; a device without FP8 refused by name."""

import math

import numpy as np
import pytest
from onnx import helper, numpy_helper

from autoshard.cli.main import main
from autoshard.cost.cluster import make_cluster
from autoshard.cost.price import price
from autoshard.mesh import Mesh
from autoshard.pipeline import PlanRequest, plan_inputs, propagated
from autoshard.training import Training, TrainingError
from tests.unit.onnx_factory import F32, model, tensor

N = 2048  # x [N, N] @ w.T, then the result times its own transpose: both compute-bound


@pytest.fixture(scope="module")
def linear_then_attention(tmp_path_factory):
    """g = x @ Transpose(v) (a linear layer reading its weight through a view), h = g @ w (one
    reading it as is), y = h @ h.T (a matmul of two activations, as attention's scores)."""
    nodes = [
        helper.make_node("Transpose", ["v"], ["vt"], name="view", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "vt"], ["g"], name="first"),
        helper.make_node("MatMul", ["g", "w"], ["h"], name="linear"),
        helper.make_node("Transpose", ["h"], ["ht"], name="flip", perm=[1, 0]),
        helper.make_node("MatMul", ["h", "ht"], ["y"], name="scores"),
    ]
    weights = [numpy_helper.from_array(np.zeros((N, N), np.float32), name) for name in "vw"]
    proto = model(nodes, [tensor("x", F32, [N, N])], [tensor("y", F32, [N, N])], weights)
    path = tmp_path_factory.mktemp("fp8") / "linear.onnx"
    path.write_bytes(proto.SerializeToString())
    return path


def _seconds(path, precision, device="h100"):
    training = Training.parse(precision=precision)
    lowered = propagated(path, {}, Mesh((1,)), [], training=training)
    cluster = make_cluster("1", device)
    cost = price(lowered.program, lowered.graph, cluster)
    return lowered.graph, {name: op.seconds for name, op in cost.ops.items()}


def test_fp8_prices_the_linear_layers_matmuls_at_the_fp8_rate(linear_then_attention):
    """A 2048^3 matmul: 2 N^3 FLOPs at peak x 0.8 x s(N)^3, s(N) = N / (N + 64), plus the
    2 us launch; FP8's peak on an H100 is 1979 TFLOP/s, bf16's 989."""
    graph, fp8 = _seconds(linear_then_attention, "fp8-mixed")
    _, bf16 = _seconds(linear_then_attention, "bf16-mixed")
    efficiency = 0.8 * (N / (N + 64)) ** 3
    flops = 2 * N**3
    assert fp8["linear"] == pytest.approx(flops / (1979e12 * efficiency) + 2e-6)
    assert bf16["linear"] == pytest.approx(flops / (989e12 * efficiency) + 2e-6)
    assert fp8["scores"] == bf16["scores"] == pytest.approx(flops / (989e12 * efficiency) + 2e-6)
    assert fp8["first"] == fp8["linear"]
    # dX and dW of the linear layers in FP8 (the first's dX is not needed: x is an input);
    # the scores' two gradients in bf16
    assert set(graph.matmul_dtypes) == {
        "first", "first@grad1", "linear", "linear@grad0", "linear@grad1"
    }  # fmt: skip
    assert set(graph.matmul_dtypes.values()) == {"float8_e4m3fn"}
    for grad in ("linear@grad0", "linear@grad1"):
        assert fp8[grad] == pytest.approx(fp8["linear"])
    for grad in ("scores@grad0", "scores@grad1"):
        assert fp8[grad] == bf16[grad]
    # storage stays bf16: every float value of the step is bfloat16
    assert {graph.values[v].dtype for v in ("x", "w", "h", "y")} == {"bfloat16"}
    assert math.isclose(sum(fp8.values()) - sum(bf16.values()), sum(
        fp8[n] - bf16[n] for n in graph.matmul_dtypes
    ))  # fmt: skip


def test_no_fp8_without_training_precision_asking(linear_then_attention):
    graph, _ = _seconds(linear_then_attention, "bf16-mixed")
    assert graph.matmul_dtypes == {}


@pytest.mark.parametrize("device, name", [("a100", "NVIDIA A100 SXM4 80GB"),
                                          ("tpu-v5e", "Google TPU v5e")])  # fmt: skip
def test_a_device_without_fp8_is_refused(linear_then_attention, device, name):
    request = PlanRequest(
        model_path=linear_then_attention, cluster=make_cluster("1", device), dims={},
        training=Training.parse(precision="fp8-mixed"),
    )  # fmt: skip
    message = (
        f"precision fp8-mixed needs FP8 tensor cores, which device '{name}' lacks; its "
        "precisions: bf16-mixed, fp16-mixed, fp32"
    )
    with pytest.raises(TrainingError, match=message):
        plan_inputs(request)


def test_the_cli_says_so_in_one_line(linear_then_attention, capsys):
    code = main(["plan", str(linear_then_attention), "--mesh", "1", "--device", "a100",
                 "--mode", "training", "--precision", "fp8-mixed", "-q"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "A100" in err and "bf16-mixed" in err


def test_an_unknown_precision_names_fp8():
    with pytest.raises(TrainingError, match="choose one of: bf16-mixed, fp16-mixed, fp8-mixed"):
        Training.parse(precision="fp4")

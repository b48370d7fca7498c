"""Hostile and broken inputs, through the command line: each gives one line naming the culprit
(or the limit it hit) and exit 2, quickly, without allocating per element or per device.

Each case builds what it needs under tmp_path and returns the argv; its fragment must be in
the error line.
"""

import time
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_factory import F32, model, save, tensor

from autoshard.cli.main import main
from autoshard.limits import (
    MAX_DEVICES,
    MAX_ELEMENTS,
    MAX_LAYOUT_DEVICES,
    MAX_MESH_AXES,
    MAX_SEARCH_AXES,
)

MLP = str(Path(__file__).resolve().parents[2] / "models" / "mlp.onnx")
GPT2 = str(Path(__file__).resolve().parents[2] / "models" / "gpt2.onnx")
GPT2_DIMS = ("--dim", "batch=2", "--dim", "seq=16")
BIG = 1 << 40


def external(name, shape, location, **fields):
    """A float initializer whose data lives in `location` (which may be absent)."""
    t = TensorProto(name=name, data_type=F32, dims=shape, data_location=TensorProto.EXTERNAL)
    for key, value in {"location": location, **fields}.items():
        entry = t.external_data.add()
        entry.key, entry.value = key, str(value)
    return t


def matmul(tmp, weight, x_shape=(2, 8), nodes=None, inputs=None, inits=None):
    """x @ W -> y, with W the given initializer."""
    nodes = nodes or [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    inputs = inputs or [tensor("x", F32, list(x_shape))]
    inits = [weight] if inits is None else inits
    return str(save(model(nodes, inputs, [tensor("y", F32, None)], inits), tmp))


W8x4 = numpy_helper.from_array(np.ones((8, 4), np.float32), "W")


def short_external_data(tmp):
    (tmp / "w.bin").write_bytes(b"\0" * 10)
    return ["plan", matmul(tmp, external("W", [8, 4], "w.bin")), "--mesh", "2"]


def plan_then_partition(tmp, partition_args):
    plan = tmp / "plan.json"
    assert main(["plan", MLP, "--mesh", "2x2", "--dim", "batch=8", "-o", str(plan)]) == 0
    return ["partition", "--plan", str(plan), "-o", str(tmp / "out"), *partition_args]


def other_model(tmp):
    other = matmul(tmp, W8x4)
    return plan_then_partition(tmp, [other, "--mesh", "2x2"])


def run(argv):
    """main's exit code; argparse's own errors (a --shape over the limit) exit through
    SystemExit."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


CASES = {
    # ---- absurd sizes: explicit limits, named
    "mesh-of-10^16-devices": (
        lambda tmp: ["plan", MLP, "--mesh", "99999999x99999999", "--dim", "batch=8"],
        f"mesh 99999999x99999999 has 9999999800000001 devices; autoshard's limit is "
        f"MAX_DEVICES = {MAX_DEVICES} devices per mesh",
    ),
    "layout-mesh-of-10^16-devices": (
        lambda tmp: ["layout", "--mesh", "99999999x99999999", "--shape", "4", "--sharding", "[]"],
        f"MAX_DEVICES = {MAX_DEVICES}",
    ),
    "reshard-named-mesh-over-the-limit": (
        lambda tmp: ["reshard", "--mesh", "a=65537", "--shape", "4", "--from", "[]", "--to", "[]"],
        "mesh a=65537 has 65537 devices",
    ),
    "mesh-of-8-axes": (
        lambda tmp: [
            "reshard",
            "--mesh",
            "2x2x2x2x2x2x2x2",
            "--shape",
            "4",
            "--from",
            "[]",
            "--to",
            "[]",
        ],  # fmt: skip
        f"mesh 2x2x2x2x2x2x2x2 has 8 axes; autoshard's limit is MAX_MESH_AXES = {MAX_MESH_AXES}",
    ),
    "plan-search-on-5-axes": (
        lambda tmp: ["plan", MLP, "--mesh", "2x2x2x2x2", "--dim", "batch=8"],
        f"mesh 2x2x2x2x2 has 5 axes; autoshard plan searches at most MAX_SEARCH_AXES = "
        f"{MAX_SEARCH_AXES} (propagate annotations on a larger mesh)",
    ),
    "layout-drawing-too-many-devices": (
        lambda tmp: ["layout", "--mesh", "128x64", "--shape", "4x6", "--sharding", "[[0], [1]]"],
        f"mesh 128x64 has 8192 devices; a layout draws at most MAX_LAYOUT_DEVICES = "
        f"{MAX_LAYOUT_DEVICES}",
    ),
    "reshard-shape-of-2^80-elements": (
        lambda tmp: [
            "reshard",
            "--mesh",
            "2",
            "--shape",
            f"{BIG}x{BIG}",
            "--from",
            "[[0]]",
            "--to",
            "[[], [0]]",
        ],  # fmt: skip
        f"--shape {BIG}x{BIG} has {BIG * BIG} elements; autoshard's limit is MAX_ELEMENTS = "
        f"{MAX_ELEMENTS} elements per tensor",
    ),
    "layout-shape-of-2^80-elements": (
        lambda tmp: ["layout", "--mesh", "2", "--shape", f"{BIG}x{BIG}", "--sharding", "[[0]]"],
        "MAX_ELEMENTS",
    ),
    "model-input-of-2^80-elements": (
        lambda tmp: [
            "plan",
            matmul(tmp, external("W", [BIG, 4], "absent.bin"), (BIG, BIG)),
            "--mesh",
            "2",
        ],  # fmt: skip
        f"value 'x' of shape {BIG}x{BIG} has {BIG * BIG} elements",
    ),
    "shape-only-weight-of-2^80-elements": (
        lambda tmp: [
            "propagate",
            matmul(tmp, external("W", [BIG, BIG], "absent.bin"), (2, BIG)),
            "--mesh",
            "2",
        ],  # fmt: skip
        f"weight 'W' of shape {BIG}x{BIG} has {BIG * BIG} elements",
    ),
    "dim-bound-to-2^80": (
        lambda tmp: ["inspect", MLP, "--dim", f"batch={BIG * BIG}"],
        f"dim 'batch' = {BIG * BIG} is more than autoshard's limit of MAX_ELEMENTS",
    ),
    # ---- meaningless options
    "memory-beyond-floats": (
        lambda tmp: ["plan", MLP, "--mesh", "2", "--dim", "batch=8", "--memory", "1e400GB"],
        "memory '1e400GB' is not a finite size",
    ),
    "bandwidth-beyond-floats": (
        lambda tmp: ["plan", MLP, "--mesh", "2", "--dim", "batch=8", "--bandwidth=1e400GB/s"],
        "bandwidth '1e400GB/s' is not a finite rate",
    ),
    "time-limit-nan": (
        lambda tmp: ["plan", MLP, "--mesh", "2", "--dim", "batch=8", "--time-limit", "nan"],
        "time limit nan is not a positive number of seconds, like 60",
    ),
    "time-limit-negative": (
        lambda tmp: ["plan", MLP, "--mesh", "2", "--dim", "batch=8", "--time-limit=-1"],
        "time limit -1.0 is not a positive number of seconds",
    ),
    # ---- malformed notation: the position of the error
    "sharding-trailing-comma": (
        lambda tmp: ["layout", "--mesh", "2", "--shape", "4", "--sharding", "[[0],]"],
        "invalid sharding '[[0],]': expected a list item after ',' at column 6",
    ),
    "sharding-stray-bracket": (
        lambda tmp: ["reshard", "--mesh", "2", "--shape", "4", "--from", "[[0]]]", "--to", "[]"],
        "invalid sharding '[[0]]]': unexpected ']' at column 6",
    ),
    "sharding-trailing-text": (
        lambda tmp: [
            "propagate",
            MLP,
            "--mesh",
            "2",
            "--dim",
            "batch=8",
            "--annotate",
            "x=[[0]] please",
        ],  # fmt: skip
        "invalid sharding '[[0]] please': unexpected 'please' at column 7",
    ),
    "sharding-negative-axis": (
        lambda tmp: ["layout", "--mesh", "2", "--shape", "4", "--sharding", "[[-1]]"],
        "expected an integer >= 0 at column 3",
    ),
    # ---- mismatched inputs: a plan for another model, dims or mesh
    "plan-for-another-model": (
        other_model,
        "is for another model: 'mlp.onnx' with sha256 e73f214e",
    ),
    "plan-for-other-dims": (
        lambda tmp: plan_then_partition(tmp, [MLP, "--mesh", "2x2", "--dim", "batch=16"]),
        "is for dims batch=8, not batch=16; give the plan's --dim values or plan again",
    ),
    "plan-for-another-mesh": (
        lambda tmp: plan_then_partition(tmp, [MLP, "--mesh", "4", "--dim", "batch=8"]),
        "is for mesh 2x2, not 4",
    ),
    "plan-for-a-missing-model": (
        lambda tmp: plan_then_partition(tmp, [str(tmp / "gone.onnx"), "--mesh", "2x2"]),
        "gone.onnx': No such file or directory",
    ),
    # ---- broken files: the tensor named
    "external-data-shorter-than-the-tensor": (
        short_external_data,
        "weight 'W' needs bytes 0..128 of its external data file 'w.bin', which has 10 bytes",
    ),
    "external-data-length-not-the-shape": (
        lambda tmp: ["inspect", matmul(tmp, external("W", [8, 4], "w.bin", length=16))],
        "weight 'W': its external data length is 16 bytes, but its shape [8, 4] of float32 "
        "needs 128",
    ),
    "external-data-offset-not-a-number": (
        lambda tmp: ["inspect", matmul(tmp, external("W", [8, 4], "w.bin", offset="-8"))],
        "weight 'W': external data offset '-8' is not a byte count",
    ),
    "external-data-without-location": (
        lambda tmp: ["inspect", matmul(tmp, external("W", [8, 4], ""))],
        "weight 'W' has external data but no location",
    ),
    "two-initializers-named-alike": (
        lambda tmp: ["plan", matmul(tmp, W8x4, inits=[W8x4, W8x4]), "--mesh", "2"],
        "has two initializers named 'W'",
    ),
    "two-graph-inputs-named-alike": (
        lambda tmp: ["inspect", matmul(tmp, W8x4, inputs=[tensor("x", F32, [2, 8])] * 2)],
        "has two graph inputs named 'x'",
    ),
    "a-value-produced-twice": (
        lambda tmp: [
            "inspect",
            matmul(
                tmp,
                W8x4,
                nodes=[
                    helper.make_node("Relu", ["x"], ["h"], name="a"),
                    helper.make_node("Neg", ["x"], ["h"], name="b"),
                    helper.make_node("MatMul", ["h", "W"], ["y"], name="mm"),
                ],
            ),
        ],  # fmt: skip
        "value 'h' is the result of two ops, 'a' (Relu) and 'b' (Neg)",
    ),
    "an-initializer-also-produced": (
        lambda tmp: [
            "inspect",
            matmul(
                tmp,
                W8x4,
                nodes=[
                    helper.make_node("Relu", ["x"], ["W"], name="a"),
                    helper.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
                ],
            ),
        ],  # fmt: skip
        "value 'W' is both an initializer and the result of op 'a' (Relu)",
    ),
    # ---- pipelines: an axis, a schedule, micro-batches that cannot be
    "pipeline-axis-over-the-layers": (
        lambda tmp: ["plan", GPT2, "--mesh", "pp=4,dp=2", "--mode", "training", *GPT2_DIMS],
        "pipeline axis 0 has 4 stages but the model has 2 repeated layers; choose a pipeline "
        "axis of at most 2",
    ),
    "pipeline-of-a-model-without-layers": (
        lambda tmp: ["plan", MLP, "--mesh", "pp=2,dp=2", "--mode", "training", "--dim", "batch=8"],
        "a pipeline cuts repeated layers into stages, and the model has none",
    ),  # fmt: skip
    "unknown-schedule": (
        lambda tmp: [
            "plan",
            MLP,
            "--mesh",
            "pp=2,dp=2",
            "--mode",
            "training",
            "--schedule",
            "zb-v",
        ],
        "unknown schedule 'zb-v'; choose one of: gpipe, 1f1b, interleaved[:V], zb-h1",
    ),  # fmt: skip
    "pipeline-axis-off-the-mesh": (
        lambda tmp: ["plan", MLP, "--mesh", "2x2", "--mode", "training", "--pipeline-axis", "3"],
        "--pipeline-axis: unknown mesh axis 3; mesh 2x2 has axes 0..1",
    ),
    "schedule-without-a-pipeline": (
        lambda tmp: ["plan", MLP, "--mesh", "dp=2,tp=2", "--schedule", "gpipe"],
        "--schedule gpipe needs a pipeline: name a mesh axis pp, give --pipeline-axis or "
        "--pipeline auto (mesh dp=2,tp=2 has axes 0..1 (dp, tp))",
    ),
    "pipeline-without-training": (
        lambda tmp: ["plan", MLP, "--mesh", "pp=2,dp=2", "--dim", "batch=8"],
        "a pipeline plans a training step: add --mode training",
    ),
    "interleaved-chunks-over-the-layers": (
        lambda tmp: [
            "plan",
            GPT2,
            "--mesh",
            "pp=2,dp=2",
            "--mode",
            "training",
            *GPT2_DIMS,
            "--micro-batches",
            "2",
            "--schedule",
            "interleaved:2",
        ],
        "schedule interleaved:2 on 2 stages cuts the model into 4 chunks but it has 2 "
        "repeated layers; choose 1f1b or gpipe",
    ),  # fmt: skip
    "interleaved-micro-batches": (
        lambda tmp: [
            "plan",
            GPT2,
            "--mesh",
            "pp=2,dp=2",
            "--mode",
            "training",
            *GPT2_DIMS,
            "--micro-batches",
            "3",
            "--schedule",
            "interleaved:2",
        ],
        "interleaved schedule needs micro-batches divisible by the 2 stages, got 3",
    ),  # fmt: skip
}


@pytest.mark.parametrize("make, fragment", CASES.values(), ids=CASES.keys())
def test_hostile_input_is_one_clean_line(tmp_path, capsys, make, fragment):
    argv = make(tmp_path)
    capsys.readouterr()
    start = time.perf_counter()
    assert run(argv) == 2
    assert time.perf_counter() - start < 10
    err = capsys.readouterr().err
    assert err.startswith("autoshard") and err.count("\n") == 1, err
    assert fragment in err


def test_a_shape_only_model_at_the_element_limit_plans(tmp_path, capsys):
    """A weight of exactly MAX_ELEMENTS (a 2^40 dim, data absent) plans in seconds. The least
    budget on 2 devices splits the contraction: x's 4 TiB and W's 16 TiB halved, plus y's 16 B
    partial and 16 B summed: 10 TiB + 32 B."""
    path = matmul(tmp_path, external("W", [BIG, 4], "absent.bin"), (1, BIG))
    assert main(["plan", path, "--mesh", "2", "--memory", "1024TiB"]) == 0
    capsys.readouterr()
    assert main(["plan", path, "--mesh", "2", "--memory", "1GiB"]) == 2
    least = 10 * 2**40 + 32
    assert capsys.readouterr().err.startswith(
        "autoshard: error: infeasible budget: no plan fits 1073741824 bytes (1.00 GiB) per "
        f"device; the lowest feasible budget is {least} bytes (10.00 TiB, proven optimal;"
    )

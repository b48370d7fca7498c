"""Conformance with upstream MLIR (`shard-partition`) and XLA's GSPMD on annotated programs:
the collectives autoshard emits, with their bytes per device computed by hand (ring
algorithms: all_gather and reduce_scatter send (n-1)/n of the whole tensor, all_reduce twice
that, all_slice nothing), never more than what GSPMD sends for the same shardings.
"""

import pytest
from onnx import helper

from autoshard.annotations import Annotation
from autoshard.cli.main import main
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.passes.lower import lower
from autoshard.propagate import propagate
from autoshard.sharding import Sharding
from tests.golden.seed_models import write_seed_mlp
from tests.unit.onnx_factory import F32, model, rng_weight, save, tensor

n = helper.make_node


def matmul(path):
    """y[64, 1024] = x[64, 256] @ w[256, 1024]."""
    nodes = [n("MatMul", ["x", "w"], ["y"], name="mm")]
    inputs, outputs = [tensor("x", F32, [64, 256])], [tensor("y", F32, [64, 1024])]
    return save(model(nodes, inputs, outputs, {"w": rng_weight((256, 1024))}), path)


def mlp(path):
    """y[64, 256] = relu(x[64, 256] @ w1[256, 1024]) @ w2[1024, 256]: h is 256 KiB, y 64 KiB,
    each weight 1 MiB."""
    nodes = [
        n("MatMul", ["x", "w1"], ["h"], name="fc1"),
        n("Relu", ["h"], ["r"], name="relu"),
        n("MatMul", ["r", "w2"], ["y"], name="fc2"),
    ]
    inits = {"w1": rng_weight((256, 1024), 1), "w2": rng_weight((1024, 256), 2)}
    inputs, outputs = [tensor("x", F32, [64, 256])], [tensor("y", F32, [64, 256])]
    return save(model(nodes, inputs, outputs, inits), path)


def seed_mlp(path):
    return write_seed_mlp(path / "model.onnx")


def held(value, text):
    return Annotation(value, Sharding.parse(text))


def read(value, text):
    return Annotation(value, Sharding.parse(text), for_users=True)


KiB = 1024
CASES = {
    # Upstream partitions the K-split into a partial result and one reduce_scatter (y is
    # 64x1024 floats, 256 KiB; 1/2 of it sent); the result's for-users annotation does not
    # bind the matmul (it used to be "cannot follow both required annotations").
    "k-split-matmul-for-users-result": (
        matmul, "2", [read("x", "[[], [0]]"), read("y", "[[0]]")],
        [("reduce_scatter", [0], 128 * KiB)], None,
    ),
    # A partial result wanted split over the axis it is partial on: one reduce_scatter
    # (3/4 of 256 KiB), not an all_reduce and a slice, nor an all_gather and an all_to_all.
    "partial-result-wanted-split": (
        matmul, "2x4", [held("x", "[[], [1]]"), held("w", "[[1]]"), held("y", "[[], [1]]")],
        [("reduce_scatter", [1], 192 * KiB)], None,
    ),
    # The design pages' MLP (mesh 2) without its partial annotation: h (2x4x32 floats, 1 KiB) is
    # reduced before the max by one all_reduce (2 * 1/2 KiB), not a reduce_scatter below
    # and an all_gather above the max (the same bytes in two collectives).
    "seed-001-mlp-without-partial": (
        seed_mlp, "2", [held("x", "[[], [], [0]]"), read("y", "[[], [], [0]]")],
        [("all_reduce", [0], 1 * KiB)], None,
    ),
    # The 2x4 MLP: x and y replicated, w1 split on its rows and w2 on its columns over
    # axis 1. Gathering both weights sends 2 * 3/4 MiB = 1,572,864 B; GSPMD sends 835,584 B;
    # slicing x along the contraction (free) makes h partial, and one all_reduce of h
    # (2 * 3/4 * 256 KiB) and an all_gather of y (3/4 * 64 KiB) send 442,368 B.
    "mlp-2x4-split-weights": (
        mlp, "2x4",
        [held("x", "[[]]"), held("w1", "[[1]]"), held("w2", "[[], [1]]"), held("y", "[[]]")],
        [("all_slice", [1], 0), ("all_reduce", [1], 384 * KiB), ("all_gather", [1], 48 * KiB)],
        835_584,
    ),
    # A one-device mesh moves nothing, whatever the annotations split.
    "one-device-mesh": (
        seed_mlp, "1", [held("x", "[[], [], [0]]"), held("h", "[[]] partial = sum[0]")], [], None,
    ),
}  # fmt: skip


@pytest.mark.parametrize("build, mesh, annotations, expected, gspmd", CASES.values(), ids=CASES)
def test_collectives_and_bytes(tmp_path, build, mesh, annotations, expected, gspmd):
    graph = import_onnx(build(tmp_path))
    program = lower(graph, propagate(graph, Mesh.parse(mesh), annotations))
    emitted = [
        (c.collective.kind.value, list(c.collective.mesh_axes), c.collective.bytes_per_device)
        for c in program.communications
    ]
    assert emitted == expected
    assert program.bytes_per_device == sum(bytes_ for _, _, bytes_ in expected)
    if gspmd is not None:
        assert program.bytes_per_device <= gspmd


def test_a_one_device_plan_has_no_collectives(tmp_path, capsys):
    path = str(mlp(tmp_path))
    assert main(["plan", path, "--mesh", "1", "-o", str(tmp_path / "plan.json")]) == 0
    assert "collectives: 0;" in capsys.readouterr().out
    assert main(["partition", path, "--mesh", "1x1", "--annotate", "w1=[[1]]", "-o",
                 str(tmp_path / "out")]) == 0  # fmt: skip
    assert "mesh.all" not in (tmp_path / "out" / "spmd.mlir").read_text()

"""The DTensor export trains: the `apply_plan` that `autoshard export --to dtensor` writes for a
training plan of models/mlp.onnx, applied to the torch module the ONNX came from, runs 3 steps
on gloo (one process per device; FSDP2 for the parameters the plan stores split further than it
reads them, or whose optimizer state it splits: ZeRO-2; Megatron's styles on tp, or on dp and
tp, each module's over its own mesh dim; `sync_gradients` over the data dims) equal to the
single-process step with the same optimizer (loss, every gradient, every updated weight, rel
1e-5, after steps 1 and 3, each from the ranks' state after the step before). While it trains,
every collective torch issues is counted per phase and kind (`traffic.Traffic`, CommDebugMode
beside it) and must be, byte for byte, the export's estimate (`traffic` of the export document).
The 2x2 plans share one start of 4 ranks, the 2x2x2 ones (data parallel, ZeRO-2, FSDP and
Megatron over 8 devices) a start of 8 (`train_cases`)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from tests.export.gloo import run_on_ranks
from tests.export.traffic import mismatches
from tests.export.train_cases import STEPS, plan_mlp, train_worker

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.tensor")
pytest.importorskip("torch.distributed.fsdp")

MODELS = Path(__file__).resolve().parents[2] / "models"
_WHOLE = ["0.weight=[[], []]@users", "2.weight=[[], []]@users", "0.bias=[[]]@users",
          "2.bias=[[]]@users"]  # fmt: skip
_BATCH = ["x=[[0, 1], []]", "x=[[0, 1], []]@users"]
_CUBE = "dp=2,dq=2,tp=2"
_BATCH3 = ["x=[[0, 1, 2], []]", "x=[[0, 1, 2], []]@users"]
_HELD = ["0.weight=[[], []]", "0.bias=[[]]", "2.weight=[[], []]", "2.bias=[[]]"]
_MEGATRON = ["x=[[0], []]", "x=[[0], []]@users", "0.weight=[[1], []]", "0.bias=[[1]]",
             "2.weight=[[], [1]]", "2.bias=[[]]", "/0/Gemm_output_0=[[0], [1]]",
             "/1/Relu_output_0=[[0], [1]]@users"]  # fmt: skip
_TWO_DIMS = ["x=[[], []]", "x=[[], []]@users", "0.weight=[[1], []]", "0.bias=[[1]]",
             "2.weight=[[], [0]]", "2.bias=[[]]", "/0/Gemm_output_0=[[], [1]]",
             "/1/Relu_output_0=[[], [0]]@users", "0.weight@state=[[], [1], []]",
             "0.bias@state=[[], [1]]", "2.weight@state=[[], [], [0]]",
             "2.bias@state=[[], []]"]  # fmt: skip
# name -> (mesh, optimizer, planning flags, annotations: `value=sharding`, `@users` for reads)
CASES = {
    "dp": ("dp=2,tp=2", "sgd", [], [*_BATCH, *_HELD, *_WHOLE]),
    # ZeRO-2: weights whole, their optimizer state split over dp (FSDP2 keeps them gathered
    # from forward to backward); the batch over both axes (the gradients summed over tp).
    "zero2": ("dp=2,tp=2", "adam", [], [*_BATCH, "0.weight=[[], []]", "0.bias=[[]]",
                                         "2.weight=[[], []]", "2.bias=[[]]", *_WHOLE,
                                         "0.weight@state=[[], [0], []]", "0.bias@state=[[], [0]]",
                                         "2.weight@state=[[], [0], []]",
                                         "2.bias@state=[[], [0]]"]),
    # FSDP (ZeRO-3) over dp, replicated over tp: HSDP.
    "fsdp": ("dp=2,tp=2", "sgd", [], [*_BATCH, "0.weight=[[0], []]", "0.bias=[[0]]",
                                       "2.weight=[[0], []]", "2.bias=[[0]]", *_WHOLE]),
    # AdamW's moments pinned as the weights are held (the search would split some over dp).
    "megatron": ("dp=2,tp=2", "adamw", [], [*_MEGATRON, "0.weight@state=[[], [1], []]",
                                             "0.bias@state=[[], [1]]",
                                             "2.weight@state=[[], [], [1]]",
                                             "2.bias@state=[[], []]"]),
    "tp-fsdp": ("dp=2,tp=2", "sgd", [], [*_MEGATRON[:2], "0.weight=[[1], [0]]",
                                          "0.bias=[[1, 0]]", *_MEGATRON[4:]]),
    # The search's own plan under a budget: both Linears column-split on tp.
    "searched": ("dp=2,tp=2", "sgd", ["--memory", "300KB"], []),
    # 2x2x2: the batch over all 8 devices (Megatron's over dp and dq), as on 2x2 otherwise
    "dp-2x2x2": (_CUBE, "sgd", [], [*_BATCH3, *_HELD, *_WHOLE]),
    "zero2-2x2x2": (_CUBE, "adam", [], [*_BATCH3, *_HELD, *_WHOLE,
                                       "0.weight@state=[[], [0, 1, 2], []]",
                                       "0.bias@state=[[], [0, 1, 2]]",
                                       "2.weight@state=[[], [0, 1, 2], []]",
                                       "2.bias@state=[[], [0, 1, 2]]"]),
    "fsdp-2x2x2": (_CUBE, "sgd", [], [
        *_BATCH3, "0.weight=[[0], []]", "0.bias=[[0]]", "2.weight=[[0], []]", "2.bias=[[0]]",
        *_WHOLE]),
    "megatron-2x2x2": (_CUBE, "adamw", [], [
        "x=[[0, 1], []]", "x=[[0, 1], []]@users", "0.weight=[[2], []]", "0.bias=[[2]]",
        "2.weight=[[], [2]]", "2.bias=[[]]", "/0/Gemm_output_0=[[0, 1], [2]]",
        "/1/Relu_output_0=[[0, 1], [2]]@users", "0.weight@state=[[], [2], []]",
        "0.bias@state=[[], [2]]", "2.weight@state=[[], [], [2]]", "2.bias@state=[[], []]"]),
    # 2-D tensor parallel, the batch whole: the first Linear column-split over tp, the second
    # row-split over dp (its input gathered over tp, then sliced over dp).
    "tp-2d": ("dp=2,tp=2", "sgd", [], _TWO_DIMS),
}  # fmt: skip
STYLES = {
    # the search splits the first Linear's momentum over both axes (held by `_hold_as`)
    "dp": {"0.weight": "replicate+zero", "0.bias": "replicate+zero", "2.weight": "replicate"},
    "zero2": "replicate+zero",
    "fsdp": "replicate+fsdp",
    "megatron": {"0.weight": "colwise", "2.weight": "rowwise"},
    "tp-fsdp": {"0.weight": "colwise+fsdp", "2.weight": "rowwise+zero"},
    "searched": {"0.weight": "colwise", "2.weight": "colwise"},
    "dp-2x2x2": {"0.weight": "replicate+zero", "0.bias": "replicate+zero", "2.weight": "replicate"},
    "zero2-2x2x2": "replicate+zero",
    "fsdp-2x2x2": "replicate+fsdp",
    "megatron-2x2x2": {"0.weight": "colwise", "2.weight": "rowwise"},
    "tp-2d": {"0.weight": "colwise", "2.weight": "rowwise"},
}
BATCH = 8  # train_cases.batches("mlp")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Plan and export every case, then train them: the 2x2 ones on one start of 4 ranks."""
    folder = tmp_path_factory.mktemp("train")
    for case, (mesh, optimizer, flags, written) in CASES.items():
        path = folder / case
        path.mkdir()
        shutil.copy(MODELS / "mlp.onnx", path)
        plan_mlp(path, path / "mlp.onnx", mesh, BATCH, optimizer, flags, written)
    for ranks in (4, 8):
        cases = {c: ("mlp", v[1], 1.0) for c, v in CASES.items() if _ranks(c) == ranks}
        run_on_ranks(train_worker, ranks, str(folder), cases)
    return folder


def _ranks(case: str) -> int:
    return 8 if CASES[case][0].count("=") == 3 else 4


@pytest.mark.parametrize("case", list(CASES))
def test_the_export_trains_as_one_process(trained, case):
    export = json.loads((trained / case / "export.json").read_text())
    assert export["parallelize"]["fallback"] is None
    want = STYLES[case]
    styles = {n: e["style"] for n, e in export["parameters"].items()}
    if isinstance(want, str):
        assert set(styles.values()) == {want}, styles
    else:
        assert {n: styles[n] for n in want} == want
    for rank in range(_ranks(case)):
        errors = torch.load(trained / case / f"rank{rank}.pt")["errors"]
        # the loss, 4 gradients and 4 weights after steps 1 and 3
        assert len(errors) == 2 * (1 + 4 + 4)
        bad = {k: e for k, e in errors.items() if e > 1e-5}
        assert not bad, (case, rank, bad)


@pytest.mark.parametrize("case", list(CASES))
def test_counted_bytes_are_the_exports_estimate(trained, case):
    """Every phase's bytes per collective kind, counted on every rank over 3 steps, are 3
    times the export's estimate; CommDebugMode saw the same collective calls."""
    export = json.loads((trained / case / "export.json").read_text())
    estimate = export["traffic"]
    assert not estimate["unmodeled"]
    assert estimate["bytes_per_device"], "a plan on 4 devices that moves nothing"
    for rank in range(_ranks(case)):
        result = torch.load(trained / case / f"rank{rank}.pt")
        assert result["calls"] == result["debug"], (case, rank)
        assert not mismatches(estimate["bytes_per_device"], result["bytes"], STEPS), (case, rank)


def test_the_estimates_by_hand(trained):
    """The estimates of three plans, by hand (float32, ring bytes): Megatron's row-parallel
    output [4, 64] all-reduced over tp (2(n-1)/n of 1 KiB) and its gradients over dp;
    ZeRO-2's flat shards (256x64/2 + 256/2 + 64x256/2 + 64/2 floats) gathered once and
    reduce-scattered, then summed over tp; FSDP's gathered twice."""
    get = lambda case: json.loads((trained / case / "export.json").read_text())["traffic"]  # noqa: E731
    local = 4 * (128 * 64 + 128 + 32 * 256 + 32)  # each rank's flat FSDP shard, bytes
    assert get("megatron")["bytes_per_device"] == {
        "forward": {"all_reduce": 1024},
        # 0.weight [128, 64], 0.bias [128] on tp; 2.weight [64, 128], 2.bias [64] whole
        "gradient_sync": {"all_reduce": 4 * (128 * 64 + 128 + 64 * 128 + 64)},
    }
    assert get("zero2")["bytes_per_device"] == {
        "forward": {"all_gather": local},
        "backward": {"reduce_scatter": local},
        "gradient_sync": {"all_reduce": local},
    }
    assert get("fsdp")["bytes_per_device"]["backward"] == {
        "all_gather": local, "reduce_scatter": local,
    }  # fmt: skip


def test_a_wrong_estimate_is_named(trained):
    """The comparison fails on a mismatch, naming the phase, kind and both figures: FSDP's
    counted step against ZeRO-2's estimate (no second all_gather)."""
    estimate = json.loads((trained / "zero2" / "export.json").read_text())["traffic"]
    counted = torch.load(trained / "fsdp" / "rank0.pt")["bytes"]
    found = mismatches(estimate["bytes_per_device"], counted, STEPS)
    assert found == [f"backward all_gather: estimated 0 B, counted {3 * 66176} B"]


def test_two_styled_mesh_dims(trained, tmp_path):
    """2-D tensor parallel by hand: module 2 rowwise over dp; its input, [8, 256] float32 split
    over tp by module 0, all-gathered over tp in forward (half of 8 KiB), its output [8, 64]
    all-reduced over dp, its input gradient all-gathered over dp in backward. With the batch
    split over dp as well, no style reads it: the export falls back, saying why."""
    export = json.loads((trained / "tp-2d" / "export.json").read_text())
    assert export["parallelize"]["modules"]["2"] == {"style": "rowwise", "axis": "dp"}
    assert export["traffic"]["bytes_per_device"] == {
        "forward": {"all_gather": 4096, "all_reduce": 2048}, "backward": {"all_gather": 4096},
    }  # fmt: skip
    shutil.copy(MODELS / "mlp.onnx", tmp_path)
    batch = ["x=[[0], []]", "x=[[0], []]@users", *_TWO_DIMS[2:6], "/0/Gemm_output_0=[[0], [1]]",
             *_TWO_DIMS[7:]]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        plan_mlp(tmp_path, tmp_path / "mlp.onnx", "dp=2,tp=2", BATCH, "sgd", [], batch)
    fallback = json.loads((tmp_path / "export.json").read_text())["parallelize"]["fallback"]
    assert fallback == (
        "mesh dim dp splits both the batch and parameters' reads; DTensor's parallel styles "
        "read their input whole over it"
    )

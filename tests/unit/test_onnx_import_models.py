"""The committed models/*.onnx (real exporter output) import to fully static graphs.

Oracles: onnx's own parameter count, `verify`, and onnxruntime running the original model with
every intermediate exposed: each imported value's shape, and each folded constant's data, must
equal what onnxruntime computes.
"""

import time
from pathlib import Path

import numpy as np
import pytest
from onnx_factory import onnx_param_count, run_all_values

from autoshard.errors import ModelError
from autoshard.ir.graph import verify
from autoshard.ir.onnx_import import import_onnx, unbound_dims
from autoshard.ir.summary import summarize

MODELS = Path(__file__).resolve().parents[2] / "models"
NAMES = ["mlp", "cnn", "bert", "gpt2", "gpt2_dynamo", "decoder_32l_shape_only"]
SHAPE_ONLY = {"decoder_32l_shape_only"}
SIZES = {"batch": 2, "seq": 16}


def model_path(name):
    path = MODELS / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} is absent (regenerate with models/make_models.py)")
    return path


def bind(path, sizes=SIZES):
    """Binds every dim of the model; the test models name theirs batch and seq only."""
    dims = unbound_dims(path)
    assert set(dims) <= set(sizes), dims
    return {name: sizes[name] for name in dims}


@pytest.fixture(scope="module")
def imported():
    cache = {}

    def get(name, sizes=SIZES):
        key = (name, tuple(sorted(sizes.items())))
        if key not in cache:
            path = model_path(name)
            cache[key] = (path, import_onnx(path, bind(path, sizes)))
        return cache[key]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_model_imports_static_and_verified(imported, name):
    path, graph = imported(name)
    verify(graph)
    assert all(isinstance(d, int) for v in graph.values.values() for d in v.shape)
    assert sum(w.size for w in graph.weights.values()) == onnx_param_count(path)
    summary = summarize(graph)
    assert summary["parameters"] == onnx_param_count(path)
    assert summary["weights_available"] is (name not in SHAPE_ONLY)
    assert summary["nodes"] <= summary["nodes_in_file"]
    for entry in summary["inputs"]:
        assert entry["shape"][0] == 2  # every test model has a leading batch dim


@pytest.mark.parametrize("name", sorted(set(NAMES) - SHAPE_ONLY))
@pytest.mark.parametrize("sizes", [SIZES, {"batch": 3, "seq": 7}], ids=["b2s16", "b3s7"])
def test_model_values_match_onnxruntime(imported, name, sizes):
    path, graph = imported(name, sizes)
    ran = run_all_values(path, graph)
    for value_name in graph.outputs:
        assert value_name in ran
    for value_name, array in ran.items():
        assert graph.values[value_name].shape == array.shape, value_name
        if value_name in graph.constants:
            np.testing.assert_array_equal(graph.constants[value_name], array, err_msg=value_name)


def test_torchscript_gpt2_shape_subgraphs_fold_away(imported):
    """TorchScript's Shape/Gather/Unsqueeze/Concat chains all become constants."""
    _, graph = imported("gpt2")
    kinds = {op.type for op in graph.ops}
    assert not kinds & {"Shape", "Size", "Unsqueeze", "Concat", "ConstantOfShape", "Range"}
    assert all(op.inputs[1] in graph.constants for op in graph.ops if op.type == "Reshape")


def test_shape_only_decoder_imports_fast_without_weight_data():
    path = model_path("decoder_32l_shape_only")
    start = time.perf_counter()
    graph = import_onnx(path, bind(path))
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"import took {elapsed:.1f}s"
    big = max(graph.weights.values(), key=lambda w: w.size)
    assert not big.has_data
    with pytest.raises(ModelError, match=f"weight '{big.name}' has no data"):
        big.load()

"""Shared by the end-to-end tests: the bundled models, how to bind their dims, and how to read
a partition folder's weights back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from autoshard.ir.onnx_import import import_onnx
from autoshard.weights import read_safetensors, weight_array

MODELS = Path(__file__).resolve().parents[2] / "models"


def model_path(name: str) -> Path:
    return MODELS / f"{name}.onnx"


def reassemble(out: Path, model: Path, dims: dict[str, int]) -> dict[str, np.ndarray]:
    """Every weight put back together from the per-device files, each region checked to be
    held identically by every device that holds it."""
    manifest = json.loads((out / "manifest.json").read_text())
    graph = import_onnx(model, dims)
    whole: dict[str, np.ndarray] = {}
    for device in manifest["devices"]:
        arrays = read_safetensors(out / device["file"])
        assert sorted(arrays) == sorted(graph.weights), "a device file holds other tensors"
        for name, region in device["slices"].items():
            weight = graph.weights[name]
            if name not in whole:
                whole[name] = np.zeros(weight.shape, weight_array(weight).dtype)
            index = tuple(slice(a, b) for a, b in region)
            assert arrays[name].shape == tuple(b - a for a, b in region)
            whole[name][index] = arrays[name]
    return whole


def assert_weights_round_trip(out: Path, model: Path, dims: dict[str, int]) -> None:
    graph = import_onnx(model, dims)
    whole = reassemble(out, model, dims)
    assert sorted(whole) == sorted(graph.weights)
    for name, weight in graph.weights.items():
        original = np.asarray(weight_array(weight))
        assert whole[name].dtype == original.dtype, name
        assert whole[name].tobytes() == original.tobytes(), name

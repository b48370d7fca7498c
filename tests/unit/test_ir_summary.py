"""summarize / format_summary on a hand-built model with known counts."""

import pytest
from onnx_factory import external_weight, matmul_chain, save

from autoshard.ir.onnx_import import import_onnx
from autoshard.ir.summary import SUMMARY_KEYS, format_summary, human_bytes, human_count, summarize


def test_summary_of_matmul_chain(tmp_path):
    graph = import_onnx(save(matmul_chain(), tmp_path), {"batch": 2})
    summary = summarize(graph)
    assert tuple(summary) == SUMMARY_KEYS
    assert summary == {
        "model": "g",
        "nodes": 4,
        "nodes_in_file": 4,
        "op_types": {"Add": 1, "MatMul": 2, "Relu": 1},
        "parameters": 8 * 16 + 16 * 4 + 4,
        "parameter_bytes": 4 * 196,
        "inputs": [{"name": "x", "shape": [2, 8], "dtype": "float32"}],
        "outputs": [{"name": "y", "shape": [2, 4], "dtype": "float32"}],
        "weights_available": True,
        "missing_data_files": [],
        "opset": 17,
        "unbound_dims": {},
    }
    assert format_summary(summary) == "\n".join(
        [
            "model g: 4 ops (4 nodes in file), opset 17",
            "parameters: 196 (784 B)",
            "op types:",
            "  Add     1",
            "  MatMul  2",
            "  Relu    1",
            "inputs:",
            "  x  float32[2, 8]",
            "outputs:",
            "  y  float32[2, 4]",
        ]
    )


def test_summary_of_shape_only_model_says_so(tmp_path):
    graph = import_onnx(external_weight(tmp_path, write_data=False))
    summary = summarize(graph)
    assert summary["weights_available"] is False and summary["parameters"] == 16
    assert summary["missing_data_files"] == ["weights.bin"]
    assert (
        "parameters: 16 (64 B) (shape-only: weight data absent; not found beside the model: "
        "weights.bin)"
    ) in format_summary(summary)


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0"),
        (999, "999"),
        (1000, "1.00 K"),
        (1_234_567, "1.23 M"),
        (6_738_149_376, "6.74 G"),
    ],  # fmt: skip
)
def test_human_count(n, text):
    assert human_count(n) == text


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (4_928_307, "4.7 MiB"),
        (13_476_298_752, "12.6 GiB"),
    ],  # fmt: skip
)
def test_human_bytes(n, text):
    assert human_bytes(n) == text

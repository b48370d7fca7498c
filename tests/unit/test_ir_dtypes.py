"""dtype names ↔ ONNX element types, numpy dtypes and packed sizes."""

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto

from autoshard.errors import ModelError
from autoshard.ir import dtypes

CASES = [
    (TensorProto.FLOAT, "float32", np.float32, 32),
    (TensorProto.DOUBLE, "float64", np.float64, 64),
    (TensorProto.FLOAT16, "float16", np.float16, 16),
    (TensorProto.BFLOAT16, "bfloat16", ml_dtypes.bfloat16, 16),
    (TensorProto.FLOAT8E4M3FN, "float8_e4m3fn", ml_dtypes.float8_e4m3fn, 8),
    (TensorProto.INT64, "int64", np.int64, 64),
    (TensorProto.BOOL, "bool", np.bool_, 8),
    (TensorProto.INT4, "int4", ml_dtypes.int4, 4),
]


@pytest.mark.parametrize("enum, name, np_type, bits", CASES, ids=[c[1] for c in CASES])
def test_round_trip(enum, name, np_type, bits):
    assert dtypes.dtype_name(enum) == name
    assert dtypes.onnx_type(name) == enum
    assert dtypes.numpy_dtype(name) == np.dtype(np_type)
    assert dtypes.bits(name) == bits


def test_float_family():
    assert {"float32", "bfloat16", "float8_e5m2", "complex64"} <= dtypes.FLOAT_DTYPES
    assert not {"int64", "bool", "uint8"} & dtypes.FLOAT_DTYPES


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ModelError, match=r"unknown dtype 'float33'; known: bfloat16, bool, "):
        dtypes.onnx_type("float33")
    with pytest.raises(ModelError, match="unsupported ONNX element type UNDEFINED \\(0\\)"):
        dtypes.dtype_name(TensorProto.UNDEFINED)

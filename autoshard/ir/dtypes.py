"""Element types of tensors: ONNX's numeric enum ↔ the short names the IR uses.

The IR names dtypes the way numpy / ml_dtypes spell them (`"float32"`, `"bfloat16"`,
`"float8_e4m3fn"`), so a plan or a summary reads the same whatever produced the model. Sizes are
kept in *bits* because ONNX has sub-byte types (int4, float4) whose tensors pack several elements
per byte; `nbytes` rounds the packed size up to whole bytes.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper

from autoshard.errors import ModelError

# ONNX enum → (IR name, bits per element). Order follows TensorProto.DataType.
_TABLE: dict[int, tuple[str, int]] = {
    TensorProto.FLOAT: ("float32", 32),
    TensorProto.UINT8: ("uint8", 8),
    TensorProto.INT8: ("int8", 8),
    TensorProto.UINT16: ("uint16", 16),
    TensorProto.INT16: ("int16", 16),
    TensorProto.INT32: ("int32", 32),
    TensorProto.INT64: ("int64", 64),
    TensorProto.STRING: ("string", 0),
    TensorProto.BOOL: ("bool", 8),
    TensorProto.FLOAT16: ("float16", 16),
    TensorProto.DOUBLE: ("float64", 64),
    TensorProto.UINT32: ("uint32", 32),
    TensorProto.UINT64: ("uint64", 64),
    TensorProto.COMPLEX64: ("complex64", 64),
    TensorProto.COMPLEX128: ("complex128", 128),
    TensorProto.BFLOAT16: ("bfloat16", 16),
    TensorProto.FLOAT8E4M3FN: ("float8_e4m3fn", 8),
    TensorProto.FLOAT8E4M3FNUZ: ("float8_e4m3fnuz", 8),
    TensorProto.FLOAT8E5M2: ("float8_e5m2", 8),
    TensorProto.FLOAT8E5M2FNUZ: ("float8_e5m2fnuz", 8),
    TensorProto.UINT4: ("uint4", 4),
    TensorProto.INT4: ("int4", 4),
}
# Newer enums exist only in newer onnx releases; add them when this onnx knows them.
for _enum_name, _ir_name, _bits in (
    ("FLOAT4E2M1", "float4_e2m1fn", 4),
    ("FLOAT8E8M0", "float8_e8m0fnu", 8),
    ("UINT2", "uint2", 2),
    ("INT2", "int2", 2),
    ("FLOAT6E2M3", "float6_e2m3fn", 6),
    ("FLOAT6E3M2", "float6_e3m2fn", 6),
):
    if hasattr(TensorProto, _enum_name):
        _TABLE[getattr(TensorProto, _enum_name)] = (_ir_name, _bits)

_BY_NAME: dict[str, int] = {name: enum for enum, (name, _) in _TABLE.items()}
_BITS: dict[str, int] = {name: bits for name, bits in _TABLE.values()}

FLOAT_DTYPES = frozenset(
    name for name in _BY_NAME if name.startswith(("float", "bfloat")) or name.startswith("complex")
)
"""Floating (and complex) dtypes: tensors of these are numbers a model learns or computes."""


def dtype_name(onnx_type: int) -> str:
    """The IR name of an ONNX element type (`TensorProto.FLOAT` → `"float32"`)."""
    try:
        return _TABLE[onnx_type][0]
    except KeyError:
        known = TensorProto.DataType.Name(onnx_type) if onnx_type in _valid_enums() else None
        what = f"{known} ({onnx_type})" if known else str(onnx_type)
        raise ModelError(f"unsupported ONNX element type {what}") from None


def onnx_type(name: str) -> int:
    """The ONNX element type of an IR dtype name (`"float32"` → `TensorProto.FLOAT`)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ModelError(f"unknown dtype {name!r}; known: {', '.join(sorted(_BY_NAME))}") from None


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype holding elements of `name` (ml_dtypes types for bfloat16/float8/int4)."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(onnx_type(name)))


def bits(name: str) -> int:
    """Bits per element of `name` in ONNX's packed storage (0 for strings: size unknown)."""
    try:
        return _BITS[name]
    except KeyError:
        raise ModelError(f"unknown dtype {name!r}; known: {', '.join(sorted(_BY_NAME))}") from None


def nbytes(name: str, size: int) -> int:
    """Bytes of `size` packed elements of `name` (sub-byte types round up to whole bytes)."""
    return math.ceil(size * bits(name) / 8)


def _valid_enums() -> set[int]:
    return set(TensorProto.DataType.values())

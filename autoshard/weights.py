"""Per-device weight files in the safetensors format, written with numpy alone.

safetensors (https://github.com/huggingface/safetensors) is: an 8-byte little-endian length N,
N bytes of JSON header, then the raw little-endian bytes of every tensor back to back. The
header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end)} (offsets into
the data part) and may hold "__metadata__" (string to string). Here tensors are laid out in
sorted name order and the header is space-padded to a multiple of 8 bytes (the reference
writer's alignment), so the same tensors always give the same bytes.

Writing streams: the device files are written together, weight by weight, so each weight is
read once (external data through a memory map, never copied whole; an embedded initializer
copied once out of the model's protobuf, which hands out no view of its bytes), and each
device's slice goes to its file in chunks of at most `CHUNK_BYTES`. The sha256 of each file is
computed on the way. Bytes are the host's,
which is little-endian on every platform onnxruntime supports (checked at import).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from onnx import numpy_helper

from autoshard.errors import AutoshardError
from autoshard.files import public_mode
from autoshard.ir import dtypes
from autoshard.ir.graph import Weight
from autoshard.sharding import Slice

CHUNK_BYTES = 64 << 20
assert sys.byteorder == "little", "safetensors and ONNX raw data are little-endian"

SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}
"""IR dtype name -> safetensors dtype (the formats' common element types)."""
_FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}


class WeightFileError(AutoshardError):
    """A weight that safetensors cannot hold, or a weight file that is not what it should be."""


@dataclass(frozen=True)
class Entry:
    """One tensor to write: `region` ([start, stop) per dim) of the global `weight`."""

    name: str
    weight: Weight
    region: tuple[Slice, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.region)


def weight_array(weight: Weight) -> np.ndarray:
    """The weight's data: the memory map `Weight.load` gives for external data, or a view of
    the bytes protobuf hands out for an embedded initializer (one copy of them)."""
    tensor = weight.tensor
    if weight.external is None and tensor is not None and tensor.raw_data:
        numpy_type = dtypes.numpy_dtype(weight.dtype)
        if dtypes.bits(weight.dtype) == numpy_type.itemsize * 8:
            return np.frombuffer(tensor.raw_data, numpy_type).reshape(weight.shape)
        return numpy_helper.to_array(tensor)
    return weight.load()


def _safetensors_dtype(entry: Entry) -> str:
    dtype = entry.weight.dtype
    if dtype not in SAFETENSORS_DTYPES:
        raise WeightFileError(
            f"weight {entry.name!r} has dtype {dtype}, which safetensors cannot hold "
            f"(valid: {', '.join(SAFETENSORS_DTYPES)})"
        )
    return SAFETENSORS_DTYPES[dtype]


def header_bytes(entries: Sequence[Entry], metadata: Mapping[str, str]) -> bytes:
    """The length prefix and padded JSON header for `entries` in sorted name order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    for entry in sorted(entries, key=lambda e: e.name):
        size = dtypes.nbytes(entry.weight.dtype, int(np.prod(entry.shape, dtype=np.int64)))
        header[entry.name] = {
            "dtype": _safetensors_dtype(entry),
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":"), sort_keys=False).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return len(text).to_bytes(8, "little") + text


def _chunks(array: np.ndarray, region: tuple[Slice, ...]) -> Iterator[bytes]:
    """The bytes of `region` of `array`, at most about CHUNK_BYTES at a time."""
    view = array[tuple(slice(a, b) for a, b in region)]
    if view.size == 0:
        return
    if view.ndim == 0:
        yield view.tobytes()
        return
    row = max(1, view[0].nbytes)
    step = max(1, CHUNK_BYTES // row)
    for start in range(0, view.shape[0], step):
        yield view[start : start + step].tobytes()


@dataclass(frozen=True)
class File:
    """One safetensors file to write: its path, tensors and metadata."""

    path: Path
    entries: tuple[Entry, ...]
    metadata: Mapping[str, str]


OPEN_FILES = 256
"""Files written at once by `write_safetensors`; more are written in rounds."""


def write_safetensors(files: Sequence[File]) -> list[tuple[str, int]]:
    """Write `files`, each atomically (temp file + rename); return each one's (sha256 hex,
    bytes).

    The files are written together, weight by weight: each weight is read once for all the
    files holding a slice of it (reading an embedded initializer copies it out of the model's
    protobuf; an external one is memory-mapped), and its slices go out in chunks.
    """
    out: list[tuple[str, int]] = []
    for start in range(0, len(files), OPEN_FILES):
        out += _write_round(files[start : start + OPEN_FILES])
    return out


def _write_round(files: Sequence[File]) -> list[tuple[str, int]]:
    temps: list[str] = []
    handles: list[BinaryIO] = []
    digests = [hashlib.sha256() for _ in files]
    sizes = [0] * len(files)
    try:
        for file in files:
            descriptor, temp = tempfile.mkstemp(prefix=f".{file.path.name}.", dir=file.path.parent)
            temps.append(temp)
            handles.append(os.fdopen(descriptor, "wb"))

        def write(k: int, data: bytes) -> None:
            handles[k].write(data)
            digests[k].update(data)
            sizes[k] += len(data)

        for k, file in enumerate(files):
            write(k, header_bytes(file.entries, file.metadata))
        holders: dict[str, list[tuple[int, Entry]]] = {}
        for k, file in enumerate(files):
            for entry in file.entries:
                holders.setdefault(entry.name, []).append((k, entry))
        for name in sorted(holders):
            array = weight_array(holders[name][0][1].weight)
            for k, entry in holders[name]:
                for chunk in _chunks(array, entry.region):
                    write(k, chunk)
            del array
        for handle, temp, file in zip(handles, temps, files, strict=True):
            handle.close()
            os.chmod(temp, public_mode())
            os.replace(temp, file.path)
    except BaseException:
        for handle in handles:
            handle.close()
        for temp in temps:
            Path(temp).unlink(missing_ok=True)
        raise
    return [(d.hexdigest(), n) for d, n in zip(digests, sizes, strict=True)]


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, memory-mapped read-only."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
    except (OSError, ValueError) as error:
        raise WeightFileError(f"cannot read weight file '{path}': {error}") from None
    start = 8 + length
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _FROM_SAFETENSORS:
            raise WeightFileError(f"weight file '{path}': {name!r} has dtype {info['dtype']}")
        numpy_type = dtypes.numpy_dtype(_FROM_SAFETENSORS[info["dtype"]])
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == begin:
            out[name] = np.zeros(shape, numpy_type)
        else:
            out[name] = np.memmap(path, numpy_type, "r", start + begin, shape)
    return out

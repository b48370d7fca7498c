"""The executable form of a partition: ONNX segments and the step manifest `autoshard run` follows.

    OUT/steps.json            format autoshard-steps/1: the mesh, the graph inputs (dtype, global
                              shape, sharding, the bound of random ids) and outputs (sharding, to
                              reassemble them), the collectives (kind, mesh axes, dims, reduction,
                              pairs, device groups in `Mesh.device_groups` order, every device's
                              local shape of source and target), and for every device its weight
                              file, its regions of the graph inputs and its steps in order:
                              `{"run": SEGMENT, "inputs", "outputs"}` or `{"collective": J}`
    OUT/segments/<sha>.onnx   one ONNX model per distinct segment (autoshard/segments.py): the
                              local ops between two collectives with local shapes and the
                              device's constants; weights are inputs, read by name from the
                              device's own safetensors file. Named by their content, so the
                              devices of an even split share one file.

The MLIR text (spmd.mlir) is the readable form of the same partitioned program; this is the
executable one. Nothing here depends on time or dict filling order: the same partition gives
the same bytes. `read_steps` checks the manifest enough for a runner to trust its indices.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.execute import segments
from autoshard.execute.verify import id_bound
from autoshard.files import json_text, write_atomic
from autoshard.ir.graph import Graph
from autoshard.passes.partition import DeviceProgram, LocalCollective, Partitioned

FORMAT = "autoshard-steps/1"
STEPS = "steps.json"
SEGMENTS = "segments"


class StepsError(AutoshardError):
    """A step manifest or segment that is missing or malformed."""


def steps_manifest(
    partitioned: Partitioned, graph: Graph, weight_files: Mapping[int, str | None]
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The step manifest and the segment files it names (relative path -> bytes)."""
    program, mesh = partitioned.program, partitioned.mesh
    tensors = program.tensors
    files: dict[str, bytes] = {}
    graph_inputs = [n for n in program.inputs if n in graph.inputs]

    def add(blob: bytes) -> str:
        path = f"{SEGMENTS}/{hashlib.sha256(blob).hexdigest()[:20]}.onnx"
        files[path] = blob
        return path

    devices = [
        {
            "index": device.index,
            "coordinates": list(device.device),
            "weights": weight_files.get(device.index),
            "inputs": {
                n: [[a, b] for a, b in partitioned.slices(n, device.index)] for n in graph_inputs
            },
            "steps": _device_steps(partitioned, device, graph, add),
        }
        for device in partitioned.devices
    ]
    manifest = {
        "format": FORMAT,
        "mesh": {"shape": list(mesh.shape), "axis_names": list(mesh.axis_names)},
        "inputs": [
            {
                "name": n,
                "dtype": tensors[n].dtype,
                "shape": list(tensors[n].shape),
                "sharding": tensors[n].sharding.text(len(tensors[n].shape)),
                "high": id_bound(graph, n),
            }
            for n in graph_inputs
        ],
        "weights": sorted(n for n in program.inputs if n not in graph.inputs),
        "outputs": [
            {
                "name": value,
                "tensor": name,
                "dtype": tensors[name].dtype,
                "shape": list(tensors[name].shape),
                "sharding": tensors[name].sharding.text(len(tensors[name].shape)),
            }
            for value, name in zip(graph.outputs, program.outputs, strict=True)
        ],
        "collectives": _collectives(partitioned),
        "devices": devices,
    }
    return manifest, files


def _collectives(partitioned: Partitioned) -> list[dict[str, Any]]:
    """Each collective of the program with its tensors' dtype and per-device shapes."""
    tensors = partitioned.program.tensors
    communications = partitioned.program.communications
    return [
        {
            "source": step.source,
            "target": step.target,
            "dtype": tensors[step.source].dtype,
            **entry,
            "source_shapes": [list(d.shapes[step.source]) for d in partitioned.devices],
            "target_shapes": [list(d.shapes[step.target]) for d in partitioned.devices],
        }
        for step, entry in zip(communications, partitioned.collectives_json(), strict=True)
    ]


def _device_steps(
    partitioned: Partitioned, device: DeviceProgram, graph: Graph, add: Callable[[bytes], str]
) -> list[dict[str, Any]]:
    """One device's steps: its loose constants first, then segments and collectives in order;
    `add` stores a segment's bytes and returns its path."""
    program = partitioned.program
    # Constants a collective or the outputs read (not a segment): the device makes them first.
    loose = {step.source for step in program.communications} | set(program.outputs)
    steps: list[dict[str, Any]] = []
    held = sorted(n for n in loose if n in program.constants or n in device.constants)
    if held:
        values = {n: device.constants.get(n, program.constants.get(n)) for n in held}
        blob = segments.constants_model(values, graph.opset).SerializeToString()
        steps.append({"run": add(blob), "inputs": [], "outputs": held})
    count = 0
    for segment in segments.cut(partitioned, device):
        if not segment.empty:
            data = segments.model(partitioned, device, segment, graph.opset)
            steps.append(
                {
                    "run": add(data.SerializeToString()),
                    "inputs": list(segment.inputs),
                    "outputs": list(segment.outputs),
                }
            )
        if isinstance(segment.collective, LocalCollective):
            steps.append({"collective": count})
            count += 1
    return steps


def write_steps(
    folder: Path, partitioned: Partitioned, graph: Graph, weight_files: Mapping[int, str | None]
) -> dict[str, Any]:
    """Write OUT/steps.json and OUT/segments/ (stale segments of an earlier run removed)."""
    manifest, files = steps_manifest(partitioned, graph, weight_files)
    (folder / SEGMENTS).mkdir(exist_ok=True)
    for name, blob in sorted(files.items()):
        target = folder / name
        if not target.is_file() or target.read_bytes() != blob:
            write_atomic(target, blob)
    for stale in (folder / SEGMENTS).glob("*.onnx"):
        if f"{SEGMENTS}/{stale.name}" not in files:
            stale.unlink()
    write_atomic(folder / STEPS, json_text(manifest).encode())
    return manifest


def read_steps(out: str | os.PathLike[str]) -> dict[str, Any]:
    """The step manifest of partition folder `out`, checked to be one."""
    path = Path(out) / STEPS
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise StepsError(
            f"'{out}' has no {STEPS}: not a partition folder, or one of a shape-only model "
            "(make one with autoshard partition)"
        ) from None
    except (OSError, ValueError) as error:
        raise StepsError(f"cannot read '{path}': {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StepsError(f"'{path}' is not a {FORMAT} manifest")
    count = len(manifest["collectives"])
    for device in manifest["devices"]:
        for step in device["steps"]:
            if "collective" in step and not 0 <= step["collective"] < count:
                raise StepsError(
                    f"'{path}': device {device['index']} names collective {step['collective']}; "
                    f"there are {count}"
                )
    return manifest

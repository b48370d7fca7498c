"""The partition folder `autoshard partition` writes and `autoshard verify` reads.

    OUT/manifest.json                    what verify needs to rebuild the same partition (model
                                         sha256, mesh, dims, annotations), every weight's
                                         sharding, per-device files (sha256) and slices, and the
                                         collectives with their device groups and bytes
    OUT/weights/device-<k>.safetensors   device k's slice of every initializer, nothing else
    OUT/spmd.mlir                        the SPMD program (MLIR text, `mesh` or `shard` dialect)
    OUT/steps.json, OUT/segments/        the same program as `autoshard run` executes it: ONNX
                                         segments between collectives and the steps of each
                                         device (autoshard/steps.py); not for a shape-only model
                                         (a training step's: `execute.train_verify` runs them)

Every file is written to a temporary name and renamed, and nothing in it depends on time or
on the order a dict happened to be filled: running the command twice gives the same bytes.
A shape-only model (weight data absent) writes no weight files and says so in the manifest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from autoshard.annotations import Annotation, AnnotationError, parse_annotations
from autoshard.document.blocks import Decisions, training_of
from autoshard.errors import AutoshardError
from autoshard.execute.steps import STEPS, read_steps, write_steps
from autoshard.execute.train_check import TrainingReport
from autoshard.execute.train_verify import verify_training
from autoshard.execute.verify import Report, verify
from autoshard.files import json_text, sha256_file, write_atomic
from autoshard.mesh import Mesh
from autoshard.mlir import DIALECTS, Dialect
from autoshard.pipeline import AfterStage, Built, PipelineStage, Setup, build_setup, print_spmd
from autoshard.progress import Tracker
from autoshard.weights import Entry, File, read_safetensors, write_safetensors

FORMAT = "autoshard-partition/1"
MANIFEST = "manifest.json"
SPMD = "spmd.mlir"
WEIGHTS = "weights"


class PartitionFolderError(AutoshardError):
    """A partition folder that is missing, malformed, or made from another model or setup."""


def _annotation_json(a: Annotation) -> dict[str, object]:
    return {
        "value": a.value,
        "sharding": a.sharding.text(),
        "required": a.required,
        "for": "users" if a.for_users else "result",
    }


def _slices_json(region: Sequence[tuple[int, int]]) -> list[list[int]]:
    return [[a, b] for a, b in region]


def write_partition(
    setup: Setup,
    out: str | os.PathLike[str],
    dialect: str = Dialect.MESH,
    after: AfterStage | None = None,
    tracker: Tracker | None = None,
) -> dict:
    """Partition the model as `setup` says and write the folder `out`; return the manifest."""
    _check_dialect(dialect)
    return write_built(setup, build_setup(setup, after, tracker), out, dialect, tracker)


def _check_dialect(dialect: str) -> None:
    if dialect not in DIALECTS:
        raise PartitionFolderError(f"unknown dialect {dialect!r}; valid: {', '.join(Dialect)}")


def write_built(
    setup: Setup,
    built: Built,
    out: str | os.PathLike[str],
    dialect: str = Dialect.MESH,
    tracker: Tracker | None = None,
) -> dict:
    """Write the folder `out` of `built`, the partition `setup` makes (`build_setup`'s);
    return the manifest."""
    _check_dialect(dialect)
    graph, partitioned = built.graph, built.partitioned
    program = partitioned.program
    folder = Path(out)
    shape_only = any(not w.has_data for w in graph.weights.values())
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not shape_only:
            (folder / WEIGHTS).mkdir(exist_ok=True)
    except OSError as error:
        raise PartitionFolderError(f"cannot create '{folder}': {error.strerror}") from None
    if tracker is not None:
        tracker.stage(PipelineStage.WRITE, f"{len(partitioned.devices)} devices' files in {folder}")
    names = sorted(graph.weights)
    devices = write_weights(folder, setup.mesh, built, names, shape_only)
    remove_stale(folder / WEIGHTS, {d["file"] for d in devices})
    write_atomic(folder / SPMD, print_spmd(partitioned, dialect).encode())
    # Runnable steps of a model with weights: a training step's segments hold its gradient,
    # sync and update ops (domain autoshard.train), run as torch ops (`execute.train_ops`).
    runnable = not shape_only
    if runnable:
        write_steps(folder, partitioned, graph, {d["index"]: d["file"] for d in devices})
    manifest = {
        "format": FORMAT,
        "model": {"path": str(setup.model), "sha256": sha256_file(setup.model)},
        "mesh": {
            "shape": list(setup.mesh.shape),
            "axis_names": list(setup.mesh.axis_names),
            "name": setup.mesh.name,
        },
        "dims": dict(sorted(setup.dims.items())),
        "annotations": [_annotation_json(a) for a in setup.annotations],
        "plan": setup.plan.to_json() if setup.plan is not None else None,
        **({"training": setup.training.to_json()} if setup.training else {}),
        "shape_only": shape_only,
        "weights": {
            n: {
                "dtype": graph.weights[n].dtype,
                "shape": list(graph.weights[n].shape),
                "sharding": program.tensors[n].sharding.text(len(graph.weights[n].shape)),
            }
            for n in names
        },
        "devices": devices,
        "collectives": partitioned.collectives_json(),
        "bytes_per_device": program.bytes_per_device,
        "spmd": {"file": SPMD, "dialect": dialect},
        "steps": STEPS if runnable else None,
        "unruled": list(program.unruled),
    }
    write_atomic(folder / MANIFEST, json_text(manifest).encode())
    return manifest


def write_weights(
    folder: Path, mesh: Mesh, built: Built, names: list[str], shape_only: bool
) -> list[dict[str, Any]]:
    """Each device's weight shards in one safetensors file (none for a shape-only model), and
    the manifest's entry per device: its slices of every weight and its file's hash."""
    graph, partitioned = built.graph, built.partitioned
    devices: list[dict[str, Any]] = []
    files: list[File] = []
    for device in partitioned.devices:
        slices = {n: partitioned.slices(n, device.index) for n in names}
        entry: dict[str, Any] = {
            "index": device.index,
            "coordinates": list(device.device),
            "file": None,
            "sha256": None,
            "bytes": 0,
            "slices": {n: _slices_json(slices[n]) for n in names},
        }
        devices.append(entry)
        if not shape_only and names:
            entry["file"] = f"{WEIGHTS}/device-{device.index}.safetensors"
            metadata = {
                "format": FORMAT,
                "mesh": str(mesh),
                "device": str(device.index),
                "coordinates": ",".join(map(str, device.device)),
            }
            entries = tuple(Entry(n, graph.weights[n], slices[n]) for n in names)
            files.append(File(folder / entry["file"], entries, metadata))
    written = iter(write_safetensors(files))
    for entry in devices:
        if entry["file"] is not None:
            entry["sha256"], entry["bytes"] = next(written)
    return devices


def remove_stale(folder: Path, keep: set[str | None]) -> None:
    """Weight files of an earlier run on a larger mesh would look like this run's."""
    for path in folder.glob("device-*.safetensors") if folder.is_dir() else ():
        if f"{WEIGHTS}/{path.name}" not in keep:
            path.unlink()


# ---- reading ----------------------------------------------------------------------------------


def read_manifest(out: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(out) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise PartitionFolderError(
            f"'{out}' is not a partition folder: no {MANIFEST} (make one with autoshard partition)"
        ) from None
    except (OSError, ValueError) as error:
        raise PartitionFolderError(f"cannot read '{path}': {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PartitionFolderError(f"'{path}' is not a {FORMAT} manifest")
    return manifest


def check_model(manifest: Mapping[str, Any], model: str | os.PathLike[str]) -> None:
    """`model` must be the model the partition was made from (by sha256)."""
    recorded = manifest["model"]["sha256"]
    try:
        actual = sha256_file(model)
    except OSError as error:
        raise PartitionFolderError(f"cannot read model '{model}': {error.strerror}") from None
    if actual != recorded:
        raise PartitionFolderError(
            f"model '{model}' is not the model this partition was made from "
            f"({manifest['model']['path']}, sha256 {recorded[:12]}…)"
        )


def setup_of(
    manifest: Mapping[str, Any], model: str | os.PathLike[str], dims: Mapping[str, int]
) -> Setup:
    """The setup a manifest records, for `model` (checked to be the model it was made from);
    `dims` given again must agree with the recorded ones."""
    check_model(manifest, model)
    saved = {k: int(v) for k, v in manifest["dims"].items()}
    for name, size in dims.items():
        if saved.get(name) != size:
            raise PartitionFolderError(
                f"--dim {name}={size} differs from the partition's {name}={saved.get(name)}; "
                "partition again to change dims"
            )
    mesh_data, plan = manifest["mesh"], manifest.get("plan")
    mesh = Mesh(tuple(mesh_data["shape"]), tuple(mesh_data["axis_names"]), mesh_data["name"])
    try:
        annotations = parse_annotations({"annotations": manifest["annotations"]}, "manifest")
    except AnnotationError as error:
        raise PartitionFolderError(str(error)) from None
    return Setup(
        model=Path(model), mesh=mesh, dims=saved, annotations=annotations,
        plan=Decisions.from_json(plan, "the manifest's plan") if plan is not None else None,
        training=training_of(manifest, "the manifest"),
    )  # fmt: skip


def load_partition(
    out: str | os.PathLike[str],
    model: str | os.PathLike[str],
    dims: Mapping[str, int],
    built: Built | None = None,
) -> tuple[Built, Callable[[int], Mapping[str, np.ndarray]], dict[str, Any]]:
    """Rebuild the partition a folder records (or take `built`, the caller's, as
    `write_built` wrote it) and a loader of each device's own weight file (checked against the
    manifest's sha256 and the partition's slices)."""
    manifest = read_manifest(out)
    setup = setup_of(manifest, model, dims)
    built = built if built is not None else build_setup(setup)
    program = built.partitioned.program
    for name, info in manifest["weights"].items():
        if name not in program.tensors:
            raise PartitionFolderError(f"weight {name!r} of the manifest is not in the model")
        rebuilt = program.tensors[name].sharding.text(len(info["shape"]))
        if rebuilt != info["sharding"]:
            raise PartitionFolderError(
                f"weight {name!r} is sharded {rebuilt} now but {info['sharding']} in the "
                "manifest; partition again"
            )
    if manifest["shape_only"]:
        raise PartitionFolderError(
            f"'{out}' is the partition of a shape-only model: there are no weights to run"
        )
    devices = manifest["devices"]
    if len(devices) != len(built.partitioned.devices):
        raise PartitionFolderError(
            f"the manifest lists {len(devices)} devices; the mesh has "
            f"{len(built.partitioned.devices)}"
        )

    def weights(index: int) -> Mapping[str, np.ndarray]:
        entry = devices[index]
        path = Path(out) / entry["file"]
        if not path.is_file():
            raise PartitionFolderError(f"device {index}'s weight file '{path}' is missing")
        if sha256_file(path) != entry["sha256"]:
            raise PartitionFolderError(
                f"device {index}'s weight file '{path}' does not match the manifest's sha256"
            )
        arrays = read_safetensors(path)
        for name in manifest["weights"]:
            want = built.partitioned.devices[index].shapes[name]
            have = arrays[name].shape if name in arrays else None
            if have != want:
                raise PartitionFolderError(
                    f"device {index}'s weight file has {name!r} as {have}; its slice is {want}"
                )
        return arrays

    return built, weights, manifest


def verify_folder(
    out: str | os.PathLike[str],
    model: str | os.PathLike[str],
    dims: Mapping[str, int],
    inputs: Mapping[str, np.ndarray] | None = None,
    rtol: float | None = None,
) -> Report:
    """Rebuild the partition of folder `out`, run it on every device with each device's own
    weight file, and compare with onnxruntime on `model`."""
    if "training" in read_manifest(out):
        raise PartitionFolderError(
            f"'{out}' is the partition of a training step: train it with verify_training_folder"
        )
    built, weights, _ = load_partition(out, model, dims)
    return verify(built.partitioned, built.graph, model, weights, inputs, rtol)


def verify_training_folder(
    out: str | os.PathLike[str],
    model: str | os.PathLike[str],
    dims: Mapping[str, int],
    steps: int = 3,
    inputs: Mapping[str, np.ndarray] | None = None,
    floats: str = "float32",
    loss: str | None = None,
) -> TrainingReport:
    """Rebuild the training step's partition of folder `out`, train it `steps` steps on every
    device as its steps.json says, each from its own weight file, and compare every step with
    PyTorch autograd on `model` (`execute.train_verify`)."""
    built, weights, manifest = load_partition(out, model, dims)
    training = training_of(manifest, "the manifest")
    if training is None:
        raise PartitionFolderError(f"'{out}' is the partition of a forward pass: verify it")
    return verify_training(
        built.partitioned,
        built.graph,
        model,
        weights,
        read_steps(out),
        out,
        training,
        steps,
        inputs=inputs,
        floats=floats,
        loss=loss,
    )


def load_inputs(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The arrays of an .npz file, by name."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: np.asarray(data[name]) for name in data.files}
    except FileNotFoundError:
        raise PartitionFolderError(f"inputs file '{path}': no such file") from None
    except (OSError, ValueError) as error:
        raise PartitionFolderError(
            f"inputs file '{path}' is not an .npz archive: {error}"
        ) from None

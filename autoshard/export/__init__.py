"""Exports of a saved plan to the frameworks users train and serve with: PyTorch DTensor
placements and an `apply_plan(model, mesh)` module, JAX PartitionSpecs, and the ONNX model with
IR v11 sharding metadata. Each target is one module (`to_dtensor`, `to_jax`, `to_onnx`); all
start from `held.held_params` (the plan's weights, named by `names.recover_names`)."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard.export.held import held_params


class Target(enum.StrEnum):
    DTENSOR = "dtensor"
    JAX = "jax"
    ONNX = "onnx"


@dataclass(frozen=True)
class Exported:
    """An export: `document` (JSON: parameters or annotated nodes, unnamed weights, warnings)
    and `payload`, the bytes `-o` writes (the Python module, the JSON, the ONNX model)."""

    target: Target
    document: dict[str, Any]
    payload: bytes


def export_plan(
    plan_path: str | Path,
    target: Target,
    model: str | None = None,
    checkpoint: str | None = None,
) -> Exported:
    """Export the plan at `plan_path` (its model found beside it, or `model`) to `target`."""
    held = held_params(plan_path, model, checkpoint)
    if target is Target.DTENSOR:
        from autoshard.export.to_dtensor import dtensor_export, dtensor_module

        document = dtensor_export(held)
        return Exported(target, document, dtensor_module(document, Path(plan_path).name).encode())
    if target is Target.JAX:
        from autoshard.export.to_jax import jax_export

        document = jax_export(held)
        return Exported(target, document, (json.dumps(document, indent=2) + "\n").encode())
    from autoshard.document import read_document
    from autoshard.export.held import find_model
    from autoshard.export.to_onnx import onnx_export

    path = find_model(plan_path, read_document(plan_path), model)
    proto, warnings = onnx_export(held, path)
    annotated = sum(1 for n in proto.graph.node if n.device_configurations)
    document = {
        "schema": "autoshard.export.onnx/1",
        "ir_version": proto.ir_version,
        "devices": held.mesh.size,
        "nodes_annotated": annotated,
        "nodes": len(proto.graph.node),
        "warnings": warnings,
    }
    return Exported(target, document, proto.SerializeToString())

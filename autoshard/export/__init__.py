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

from autoshard.document.plan_document import PlanDocument, read_document
from autoshard.export.held import find_model, held_params


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
    """Export the plan file at `plan_path` (its model found beside it, or `model`)."""
    document = read_document(plan_path)
    path = find_model(plan_path, document, model)
    return export_document(document, path, target, checkpoint, Path(plan_path).name)


def export_document(
    document: PlanDocument,
    model: str | Path,
    target: Target,
    checkpoint: str | None = None,
    source: str = "plan.json",
) -> Exported:
    """Export a plan document made from the ONNX model at `model` to `target`."""
    held = held_params(document, model, checkpoint, f"plan {source}")
    if target is Target.DTENSOR:
        from autoshard.export.dtensor_module import dtensor_module
        from autoshard.export.to_dtensor import dtensor_export

        exported = dtensor_export(held)
        return Exported(target, exported, dtensor_module(exported, source).encode())
    if target is Target.JAX:
        from autoshard.export.to_jax import jax_export

        exported = jax_export(held)
        return Exported(target, exported, (json.dumps(exported, indent=2) + "\n").encode())
    from autoshard.export.to_onnx import onnx_export

    proto, warnings = onnx_export(held, model)
    exported = {
        "schema": "autoshard.export.onnx/1",
        "ir_version": proto.ir_version,
        "devices": held.mesh.size,
        "nodes_annotated": sum(1 for n in proto.graph.node if n.device_configurations),
        "nodes": len(proto.graph.node),
        "warnings": warnings,
    }
    return Exported(target, exported, proto.SerializeToString())

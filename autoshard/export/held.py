"""What every export starts from: a saved plan on its model, and each source-model parameter
with the sharding its ONNX weight is held in (`Held`).

A training plan holds each weight as its strategy stores it (`stored`: the plan's value
sharding of the weight), so its exports place parameters as stored; the optimizer state's split
comes with them (`Held.strategies`).

The plan names ONNX weights; `names.recover_names` maps them to parameters. A parameter that
several ONNX weights hold (the TorchScript exporter's transposed copy of a tied embedding) gets
the sharding of the most trusted one, and a warning when the others are held differently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from autoshard.document.blocks import WeightStrategy
from autoshard.document.plan_document import PlanDocument, plan_from_document
from autoshard.errors import AutoshardError
from autoshard.export.unroll import unrolled
from autoshard.files import sha256_file
from autoshard.ir.graph import Graph, Weight
from autoshard.ir.onnx_import import file_weights, import_onnx, load_model
from autoshard.mesh import Mesh
from autoshard.names import NameSource, load_checkpoint, recover_names
from autoshard.plan import Plan
from autoshard.sharding import Sharding

Split = tuple[tuple[int, ...], ...]


def torch_layout(split: Split, transposed: bool) -> Split:
    """Split axes per dim of an ONNX weight, in its parameter's layout (a transposed weight's
    two dims swapped)."""
    if not transposed:
        return split
    padded = split + ((),) * (2 - len(split))
    return (padded[1], padded[0])


class ExportError(AutoshardError):
    """A plan that cannot be exported as asked: its model not found, or not the plan's."""


@dataclass(frozen=True)
class ParamPlacement:
    """A source-model parameter, the ONNX weight holding it and how that weight is held."""

    param: str
    weight: str
    sharding: Sharding
    transposed: bool
    source: NameSource

    def torch_split(self) -> Split:
        """The split axes per dim of the parameter itself (swapped when transposed)."""
        return torch_layout(self.sharding.split_axes, self.transposed)


@dataclass(frozen=True, eq=False)
class Held:
    """A plan's parameters with their held shardings; `unnamed`: weight -> why it has no name."""

    mesh: Mesh
    graph: Graph
    plan: Plan
    params: tuple[ParamPlacement, ...]
    shapes: Mapping[str, tuple[int, ...]]
    unnamed: dict[str, str]
    warnings: tuple[str, ...]
    # A training plan's strategy per ONNX weight (`stored`, `used`, `state`, `strategy`).
    strategies: Mapping[str, WeightStrategy] = field(default_factory=dict)
    # A parameter held by two ONNX weights of one content (a tied embedding and LM head the
    # TorchScript exporter copies): each of the pair -> the first of it, by name.
    tied: Mapping[str, str] = field(default_factory=dict)
    # A pipelined plan's `pipeline` block (the plan document's): its stages and schedule.
    pipeline: Mapping[str, Any] | None = None


def mesh_dim_names(mesh: Mesh) -> tuple[str, ...]:
    """The mesh's axis names (`dp`, `tp`), else `axis0`, `axis1`, ..."""
    return mesh.axis_names or tuple(f"axis{i}" for i in range(mesh.ndim))


def find_model(plan_path: str | Path, document: PlanDocument, model: str | None) -> Path:
    """The ONNX model a plan was made from: `model` when given, else the plan's `model.file`
    beside the plan or in the working folder; its sha256 must be the plan's."""
    file, digest = document.model.file, document.model.sha256
    if model is not None:
        path = Path(model)
        if not path.is_file():
            raise ExportError(f"cannot read ONNX model '{model}': no such file")
    else:
        places = [Path(plan_path).parent / str(file), Path(str(file))] if file else []
        found = next((p for p in places if p.is_file()), None)
        if found is None:
            raise ExportError(
                f"plan {plan_path} was made from {file or 'a model'}, which is not beside it "
                "nor here: give it with --model"
            )
        path = found
    if digest and sha256_file(path) != digest:
        raise ExportError(
            f"model '{path}' is not the one plan {plan_path} was made from (sha256 differs)"
        )
    return path


def held_params(
    document: PlanDocument,
    path: str | Path,
    checkpoint: str | None = None,
    source: str = "the plan",
) -> Held:
    """A plan document on its model (and the checkpoint, when given): every named parameter
    with the sharding its weight is held in (a pipelined plan's stage unrolled over the whole
    model: `export.unroll`)."""
    mesh = document.mesh
    graph = import_onnx(path, document.model.dims)
    decisions, strategies = unrolled(document, graph)
    plan = plan_from_document(decisions, graph, mesh, source)
    proto = load_model(path)
    weights = file_weights(proto, path)
    names = recover_names(proto, weights, load_checkpoint(checkpoint) if checkpoint else None)
    claims: dict[str, list[ParamPlacement]] = {}
    for weight, entry in names.items():
        sharding = plan.values.get(weight, Sharding())
        for p in entry.params:
            claims.setdefault(p.name, []).append(
                ParamPlacement(p.name, weight, sharding, p.transposed, p.source)
            )
    order = list(NameSource)
    params, warnings = [], []
    for name in sorted(claims):
        ranked = sorted(claims[name], key=lambda c: (order.index(c.source), c.transposed, c.weight))
        first = ranked[0]
        params.append(first)
        for other in ranked[1:]:
            if other.torch_split() != first.torch_split():
                warnings.append(
                    f"{name}: held as {first.weight} {first.sharding} (exported) and as "
                    f"{other.weight} {other.sharding}{' transposed' if other.transposed else ''}"
                )
    unnamed = {w: e.note for w, e in names.items() if not e.params}
    shapes = {w: tuple(weights[w].shape) for w in names}
    tied = _ties(graph, params, weights)
    return Held(
        mesh,
        graph,
        plan,
        tuple(params),
        shapes,
        unnamed,
        tuple(warnings),
        strategies,
        tied,
        document.pipeline,
    )


def _ties(graph: Graph, params: list[ParamPlacement], weights: Mapping[str, Weight]) -> dict:
    """Pairs of parameters whose weights hold one content in the torch layout, an embedding
    table among them (torch ties a table to its LM head; only those are compared, not every
    weight of a large model): each of a pair -> the first of it by name."""
    tables = {
        p.param
        for p in params
        if not p.transposed and any(op.type == "Gather" for op in graph.consumers(p.weight))
    }
    tied: dict[str, str] = {}
    for table in sorted(tables):
        first = next(p for p in params if p.param == table)
        if not weights[first.weight].has_data:
            continue
        data = weights[first.weight].load()
        for other in params:
            w = weights[other.weight]
            shape = w.shape[::-1] if other.transposed else w.shape
            if other.weight == first.weight or shape != tuple(data.shape) or not w.has_data:
                continue
            array = w.load().T if other.transposed else w.load()
            if np.array_equal(array, data):
                pair = sorted((table, other.param))
                tied[pair[0]] = tied[pair[1]] = pair[0]
    return tied

"""A plan as JAX `PartitionSpec`s per parameter, on a `Mesh` with the plan's axis names.

A dim split over one mesh axis is that axis's name; over several, a tuple of names major to
minor, which is the plan's split_axes order (`[[1, 0]]` on dp=2,tp=2 is `P(('tp', 'dp'))`).
Specs are in the parameter's own layout (an ONNX weight that is its transpose swaps them).
JAX splits evenly only: a dim a spec does not divide is listed in the warnings (`device_put`
refuses it). A pipelined plan's specs are a stage's; its `pipeline` block says which stage
holds each layer and parameter, on the whole mesh with the pipeline axis first.
"""

from __future__ import annotations

import math

from autoshard.export.held import Held, mesh_dim_names, torch_layout
from autoshard.export.stages import StageSplit, parameter_stages, stage_split
from autoshard.sharding import Sharding

SCHEMA = "autoshard.export.jax/1"

Spec = list[None | str | list[str]]


def partition_spec(split: tuple[tuple[int, ...], ...], rank: int, names: tuple[str, ...]) -> Spec:
    """Per dim: None, an axis name, or a list of names major to minor (JSON for a tuple)."""
    padded = split + ((),) * (rank - len(split))
    return [
        None if not axes else names[axes[0]] if len(axes) == 1 else [names[a] for a in axes]
        for axes in padded
    ]


def spec_text(spec: Spec) -> str:
    """The Python of a spec: `PartitionSpec(None, ('dp', 'tp'))`."""
    parts = [
        "None" if s is None else repr(s) if isinstance(s, str) else repr(tuple(s)) for s in spec
    ]
    return f"PartitionSpec({', '.join(parts)})"


def jax_export(held: Held) -> dict[str, object]:
    """Per parameter its PartitionSpec as the plan holds it (a training plan: as stored, with
    its strategy and the optimizer state's spec), on the mesh's axis names."""
    mesh, names = held.mesh, mesh_dim_names(held.mesh)
    parameters: dict[str, dict[str, object]] = {}
    warnings = list(held.warnings)
    for p in held.params:
        shape = held.shapes[p.weight]
        shape = shape[::-1] if p.transposed else shape
        split = p.torch_split()
        spec = partition_spec(split, len(shape), names)
        parameters[p.param] = {
            "spec": spec,
            "text": spec_text(spec),
            "shape": list(shape),
            "onnx_weight": p.weight,
            "transposed": p.transposed,
            "source": str(p.source),
        }
        for dim, axes in enumerate(split):
            if axes and shape[dim] % math.prod(mesh.shape[a] for a in axes):
                warnings.append(
                    f"{p.param}: dim {dim} of {shape[dim]} does not divide over "
                    f"{', '.join(names[a] for a in axes)}; JAX shards evenly only"
                )
        strategy = held.strategies.get(p.weight)
        if strategy is not None:  # a training plan: held as stored; the optimizer state too
            state = torch_layout(Sharding.parse(strategy.state).split_axes, p.transposed)
            state_spec = partition_spec(state, len(shape), names)
            parameters[p.param]["strategy"] = strategy.strategy
            parameters[p.param]["optimizer_state"] = spec_text(state_spec)
            parameters[p.param]["optimizer_state_spec"] = state_spec
        if p.sharding.partial_axes:
            warnings.append(f"{p.param}: a partial value has no PartitionSpec; exported unsplit")
    document: dict[str, object] = {
        "schema": SCHEMA,
        "mesh": {"shape": list(mesh.shape), "axis_names": list(names)},
        "parameters": parameters,
        "unnamed": held.unnamed,
        "warnings": warnings,
    }
    stages = stage_split(held)
    if stages is not None:
        document["pipeline"] = pipeline_layout(held, stages, parameters)
    return document


def pipeline_layout(
    held: Held, split: StageSplit, parameters: dict[str, dict[str, object]]
) -> dict[str, object]:
    """A pipelined plan's layout: the specs above are a stage's, on the mesh without the
    pipeline axis; the whole mesh puts that axis first, and each layer and each parameter
    (added to `parameters` as `stages`) lives on the stages listed."""
    for param, stages in parameter_stages(held, split).items():
        parameters[param]["stages"] = stages
    return {
        "axis": split.axis_name,
        "mesh": {"shape": list(split.mesh_shape), "axis_names": list(split.mesh_names)},
        "stages": split.stages,
        "virtual_stages": split.virtual,
        "schedule": split.schedule.flag,
        "micro_batches": split.micro_batches,
        "stage_of_layer": list(split.stage_of_layer),
        "layer_modules": list(split.layer_modules),
        "split_points": list(split.split_points),
    }

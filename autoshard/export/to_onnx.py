"""A plan as ONNX multi-device sharding metadata (IR version 11, onnx >= 1.18).

The model gets one `DeviceConfigurationProto` (the mesh's devices, named by their mesh
coordinates) in `ModelProto.configuration`, and every planned node a
`NodeDeviceConfigurationProto` with a `ShardingSpecProto` per input and output: for each split
dim a `ShardedDimProto` (dim size, number of shards), and the devices holding each shard, the
shards taken in row-major order over the split dims. A shard held by several devices (the
tensor replicated over the other mesh axes) is a device group: a negative key mapped to its
devices (`device = [-1, -2]`, `{-1: [0, 1], -2: [2, 3]}`).

What the format cannot say is listed in the warnings: partial results (ONNX reads a split
contraction's result as reduced), and uneven splits (left to the backend).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import onnx
import onnx.inliner
from onnx import ModelProto, ShardingSpecProto

from autoshard.export.held import Held
from autoshard.ir.onnx_import import load_model, name_nodes
from autoshard.mesh import Mesh
from autoshard.sharding import Sharding

IR_VERSION = 11
CONFIGURATION = "autoshard"


def shard_index(sharding: Sharding, mesh: Mesh, device: Sequence[int]) -> tuple[int, ...]:
    """The device's shard on each split dim: its in-group index over that dim's axes."""
    out = []
    for axes in sharding.split_axes:
        if axes:
            index = 0
            for axis in axes:
                index = index * mesh.shape[axis] + device[axis]
            out.append(index)
    return tuple(out)


def sharding_spec(
    name: str, sharding: Sharding, shape: Sequence[int], mesh: Mesh
) -> ShardingSpecProto:
    """The spec of tensor `name` of `shape` held as `sharding` (see the module's docstring)."""
    spec = ShardingSpecProto(tensor_name=name)
    counts = []
    for dim, axes in enumerate(sharding.split_axes):
        if axes:
            count = math.prod(mesh.shape[a] for a in axes)
            counts.append(count)
            sharded = spec.sharded_dim.add(axis=dim)
            sharded.simple_sharding.add(dim_value=shape[dim], num_shards=count)
    holders: dict[tuple[int, ...], list[int]] = {}
    for device in mesh.devices():
        holders.setdefault(shard_index(sharding, mesh, device), []).append(
            mesh.linear_index(device)
        )
    shards = list(itertools.product(*(range(c) for c in counts)))
    if all(len(holders[s]) == 1 for s in shards):
        spec.device.extend(holders[s][0] for s in shards)
    else:
        for k, s in enumerate(shards, start=1):
            spec.device.append(-k)
            spec.index_to_device_group_map.add(key=-k, value=holders[s])
    return spec


def _issues(what: str, sharding: Sharding, shape: Sequence[int], mesh: Mesh) -> list[str]:
    out = []
    if sharding.partial_axes:
        partial = list(sharding.partial_axes)
        out.append(f"{what}: partial over mesh axes {partial}; ONNX reads it as reduced")
    for dim, axes in enumerate(sharding.split_axes):
        if axes and shape[dim] % math.prod(mesh.shape[a] for a in axes):
            out.append(f"{what}: dim {dim} of {shape[dim]} splits unevenly")
    return out


def onnx_export(held: Held, model_path: str | Path) -> tuple[ModelProto, list[str]]:
    """The model with the plan as sharding metadata, and what the format could not say."""
    graph, plan, mesh = held.graph, held.plan, held.mesh
    model = load_model(model_path)
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    name_nodes(model.graph.node)
    model.ir_version = max(model.ir_version, IR_VERSION)
    del model.configuration[:]
    model.configuration.add(
        name=CONFIGURATION,
        num_devices=mesh.size,
        device=["(" + ",".join(map(str, d)) + ")" for d in mesh.devices()],
    )
    warnings: list[str] = []
    for node in model.graph.node:
        op = graph.op_by_name.get(node.name)
        if op is None:  # folded away by the importer (a shape computation): not planned
            continue
        config = node.device_configurations.add(configuration_id=CONFIGURATION)
        for i, name in enumerate(node.input):
            if name and i < len(op.inputs) and op.inputs[i]:
                needs = plan.needs[(op.name, i)]
                shape = graph.values[op.inputs[i]].shape
                config.sharding_spec.append(sharding_spec(name, needs, shape, mesh))
                warnings += _issues(f"{node.name} input {name}", needs, shape, mesh)
        for name in (n for n in node.output if n and n in graph.values):
            produced, shape = plan.produced[name], graph.values[name].shape
            config.sharding_spec.append(sharding_spec(name, produced, shape, mesh))
            warnings += _issues(f"{node.name} output {name}", produced, shape, mesh)
    _external_warning(model, warnings)
    return model, warnings


def _external_warning(model: ModelProto, warnings: list[str]) -> None:
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        warnings.append("weights stay in the model's external data files (paths relative to it)")

"""A plan as ONNX multi-device sharding metadata (IR version 11, onnx >= 1.18), written with
onnx_ir's multi-device API (`Model.add_device_configuration`, `ShardingSpec` bound to the
values it shards) and serialized to the protos below.

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
import onnx_ir as ir
from onnx import ModelProto

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
    value: ir.Value, sharding: Sharding, shape: Sequence[int], mesh: Mesh
) -> ir.ShardingSpec:
    """The spec of `value` of `shape` held as `sharding` (see the module's docstring)."""
    dims, counts = [], []
    for dim, axes in enumerate(sharding.split_axes):
        if axes:
            count = math.prod(mesh.shape[a] for a in axes)
            counts.append(count)
            simple = ir.SimpleShardedDim(dim=shape[dim], num_shards=count)
            dims.append(ir.ShardedDim(axis=dim, simple_shardings=(simple,)))
    holders: dict[tuple[int, ...], list[int]] = {}
    for device in mesh.devices():
        holders.setdefault(shard_index(sharding, mesh, device), []).append(
            mesh.linear_index(device)
        )
    shards = list(itertools.product(*(range(c) for c in counts)))
    if all(len(holders[s]) == 1 for s in shards):
        return ir.ShardingSpec(value, tuple(holders[s][0] for s in shards), (), tuple(dims))
    groups = tuple(
        ir.IndexToDeviceGroupMapEntry(-k, tuple(holders[s])) for k, s in enumerate(shards, 1)
    )
    return ir.ShardingSpec(value, tuple(g.key for g in groups), groups, tuple(dims))


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
    proto = load_model(model_path)
    if proto.functions:
        proto = onnx.inliner.inline_local_functions(proto)
    name_nodes(proto.graph.node)  # the names the plan gives its ops
    model = ir.from_proto(proto)
    model.ir_version = max(model.ir_version, IR_VERSION)
    model.device_configurations = ()
    config = model.add_device_configuration(
        CONFIGURATION, device_names=["(" + ",".join(map(str, d)) + ")" for d in mesh.devices()]
    )
    warnings: list[str] = []
    for node in model.graph:
        op = graph.op_by_name.get(node.name or "")
        if op is None:  # folded away by the importer (a shape computation): not planned
            continue
        specs: dict[str, ir.ShardingSpec] = {}  # one per value, though read twice
        for i, value in enumerate(node.inputs):
            if value is not None and value.name and i < len(op.inputs) and op.inputs[i]:
                needs = plan.needs[(op.name, i)]
                shape = graph.values[op.inputs[i]].shape
                specs.setdefault(value.name, sharding_spec(value, needs, shape, mesh))
                warnings += _issues(f"{node.name} input {value.name}", needs, shape, mesh)
        for value in node.outputs:
            if value.name and value.name in graph.values:
                produced, shape = plan.produced[value.name], graph.values[value.name].shape
                specs[value.name] = sharding_spec(value, produced, shape, mesh)
                warnings += _issues(f"{node.name} output {value.name}", produced, shape, mesh)
        node.device_configurations = (ir.NodeDeviceConfiguration(config, tuple(specs.values())),)
    out = ir.to_proto(model)
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in out.graph.initializer):
        warnings.append("weights stay in the model's external data files (paths relative to it)")
    return out, warnings

"""A pipelined plan's stage split as the frameworks take it: PyTorch's
`torch.distributed.pipelining` (split points, the schedule's class, the micro-batches) and the
JAX export's layout (the stage of each layer and parameter, the pipeline axis's name).

A split point is the module path of the first layer of a stage (`model.layers.16`), which
`pipeline(module, mb_args, split_spec={path: SplitPoint.BEGINNING})` cuts the traced model
before. A layer's module is found from its parameters' names: the path up to the first
numeric part (`lm.model.layers.2.self_attn.q_proj.weight` is in `lm.model.layers.2`), the
one most of its parameters share. The stages' layers are the plan's (`pipeline.stages`); an
interleaved schedule's `p * v` chunks are the plan's (`pipeline.chunks`, placed by the price;
a plan from before them: the layers split evenly), chunk `c` on pipeline rank `c % p`
(Megatron's and torch's order), the embedding in chunk 0 and the head in the last.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autoshard.analysis.shorten import layer_run
from autoshard.cost.schedule import Schedule, ScheduleKind
from autoshard.export.held import ExportError, Held, mesh_dim_names
from autoshard.mesh import Mesh
from autoshard.search.pipelined import split_layers

SCHEDULE_CLASSES = {
    ScheduleKind.GPIPE: "ScheduleGPipe",
    ScheduleKind.ONE_F_ONE_B: "Schedule1F1B",
    ScheduleKind.INTERLEAVED: "ScheduleInterleaved1F1B",
    ScheduleKind.ZB_H1: "ScheduleInterleavedZeroBubble",  # one stage a rank: ZB-H1's order
}
"""Each schedule's class in `torch.distributed.pipelining`."""


@dataclass(frozen=True)
class StageSplit:
    """A pipeline of `stages` over mesh dim `axis_name` (of the whole mesh `mesh_shape`,
    `mesh_names`: the pipeline dim first, then a stage's devices), `chunks` runs of the
    repeated layers (`virtual` per stage; chunk `c` on stage `c % stages`), the modules of
    the layers, the schedule and the micro-batches."""

    axis_name: str
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]
    stages: int
    virtual: int
    chunks: tuple[range, ...]
    layer_modules: tuple[str, ...]
    schedule: Schedule
    micro_batches: int

    @property
    def split_points(self) -> tuple[str, ...]:
        """The module of each chunk's first layer, but the first chunk's."""
        return tuple(self.layer_modules[chunk.start] for chunk in self.chunks[1:])

    @property
    def stage_of_layer(self) -> tuple[int, ...]:
        return tuple(c % self.stages for c, chunk in enumerate(self.chunks) for _ in chunk)

    @property
    def schedule_class(self) -> str:
        return SCHEDULE_CLASSES[self.schedule.kind]

    def to_json(self) -> dict[str, Any]:
        return {
            "axis": self.axis_name,
            "mesh": {"shape": list(self.mesh_shape), "dim_names": list(self.mesh_names)},
            "stages": self.stages,
            "virtual_stages": self.virtual,
            "schedule": self.schedule.flag,
            "schedule_class": self.schedule_class,
            "micro_batches": self.micro_batches,
            "split_points": [{"module": m, "split": "SplitPoint.BEGINNING"}
                             for m in self.split_points],
            "chunks": [{"layers": [c.start, c.stop], "stage": i % self.stages,
                        "modules": [self.layer_modules[c.start], self.layer_modules[c.stop - 1]]}
                       for i, c in enumerate(self.chunks)],
            "stage_of_layer": list(self.stage_of_layer),
        }  # fmt: skip


def stage_split(held: Held) -> StageSplit | None:
    """The stage split of `held`'s pipelined plan (None: it has no pipeline)."""
    block = held.pipeline
    if block is None:
        return None
    schedule = Schedule.parse(block["schedule"])
    ranges = tuple(range(*s["layers"]) for s in block["stages"])
    stages, layers = len(ranges), ranges[-1].stop
    recorded = tuple(range(*c["layers"]) for c in block.get("chunks", ()))  # the plan's places
    chunks = recorded or (split_layers(layers, stages * schedule.virtual)
                          if schedule.virtual > 1 else ranges)  # fmt: skip
    names = mesh_dim_names(held.mesh)
    whole = Mesh.parse(block["mesh"])
    axis = next(n for n in (*whole.axis_names[block["axis"] : block["axis"] + 1], "pp", "stage")
                if n not in names)  # fmt: skip
    return StageSplit(
        axis_name=axis, mesh_shape=(stages, *held.mesh.shape), mesh_names=(axis, *names),
        stages=stages, virtual=schedule.virtual, chunks=chunks,
        layer_modules=layer_modules(held, layers), schedule=schedule,
        micro_batches=int(block["micro_batches"]),
    )  # fmt: skip


def _module(param: str) -> str | None:
    """The path of `param` up to its first numeric part: its layer's module."""
    parts = param.split(".")
    first = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
    return None if first is None else ".".join(parts[: first + 1])


def layer_modules(held: Held, layers: int) -> tuple[str, ...]:
    """The module of each of the model's `layers` repeated layers (the module's docstring);
    `ExportError` where a layer's parameters name none."""
    run = layer_run(held.graph)
    if run is None or run.count != layers:
        raise ExportError(
            f"the plan pipelines {layers} repeated layers, the model has "
            f"{run.count if run else 0}: is it the plan's model?"
        )
    param_of = {p.weight: p.param for p in held.params}
    found = []
    for g, ops in enumerate(run.layers):
        paths = [_module(param_of[name]) for i in ops for name in held.graph.ops[i].inputs
                 if name in param_of]  # fmt: skip
        counted = collections.Counter(p for p in paths if p is not None)
        if not counted:
            raise ExportError(
                f"layer {g}'s parameters name no module of a layer (a path with an index, "
                "`model.layers.3`): no split point for torch.distributed.pipelining"
            )
        found.append(max(sorted(counted), key=lambda p: counted[p]))
    if len(set(found)) != len(found):
        raise ExportError(f"layers share a module ({', '.join(found)}): no split points")
    return tuple(found)


def parameter_stages(held: Held, split: StageSplit) -> dict[str, list[int]]:
    """The stages that hold each parameter: its layer's, and for one outside the layers the
    first stage where the ops before the layers read it, the last where those after do (a
    tied embedding and head: both)."""
    run = layer_run(held.graph)
    assert run is not None
    index = {op.name: i for i, op in enumerate(held.graph.ops)}
    layer_of = {i: g for g, ops in enumerate(run.layers) for i in ops}
    stage_of, last = split.stage_of_layer, (len(split.chunks) - 1) % split.stages
    found: dict[str, list[int]] = {}
    for p in held.params:
        stages = set()
        for op in held.graph.consumers(p.weight):
            i = index[op.name]
            stages.add(stage_of[layer_of[i]] if i in layer_of else 0 if i < run.start else last)
        found[p.param] = sorted(stages)
    return found


TORCH = '''

# ---- The pipeline: stages over mesh dim PP_DIM ----------------------------------------------
#
#     mesh = init_device_mesh("cuda", PIPELINE_MESH_SHAPE, mesh_dim_names=PIPELINE_MESH_DIM_NAMES)
#     stages = build_stages(model, mesh, (micro_batch,))   # this rank's stage(s)
#     schedule = build_schedule(stages, loss_fn)
#     schedule.step(batch)   # on the first stage; the others step() (the last: target=, losses=)

PP_DIM = {pp}
PIPELINE_MESH_SHAPE = {shape}
PIPELINE_MESH_DIM_NAMES = {names}
"""The whole mesh: PP_DIM's positions are the stages, the other dims (MESH_SHAPE) a stage's
devices, over which its parameters are placed as the plan stores them (PLACEMENTS)."""
SPLIT_POINTS = {points}
"""Where each stage after the first begins, `SplitPoint.BEGINNING` (each chunk, in an
interleaved schedule): the module of its first layer."""
CHUNKS = {chunks}
"""Each chunk's repeated layers [start, stop); chunk c runs on pipeline rank c % stages."""
SCHEDULE = {schedule}
"""The schedule's class in torch.distributed.pipelining."""
MICRO_BATCHES = {micro_batches}
"""Micro-batches per step: the batch the plan's model was given is one."""


def split_spec():
    """SPLIT_POINTS as `pipeline(split_spec=...)` takes them."""
    from torch.distributed.pipelining import SplitPoint

    return {{path: SplitPoint.BEGINNING for path in SPLIT_POINTS}}


def build_stages(model, mesh, example_args, device="cpu"):
    """This rank's stages of `model` (one; an interleaved schedule's chunks of this rank):
    the model traced by `torch.distributed.pipelining.pipeline` on one micro-batch's
    `example_args` and split at SPLIT_POINTS, each a PipelineStage over mesh dim PP_DIM of
    `mesh` (PIPELINE_MESH_SHAPE), its parameters placed over the stage's devices."""
    from torch.distributed.pipelining import pipeline

    if tuple(mesh.shape) != PIPELINE_MESH_SHAPE:
        shape = tuple(mesh.shape)
        raise ValueError(f"the pipeline's mesh is {{PIPELINE_MESH_SHAPE}}, not {{shape}}")
    pipe = pipeline(model, mb_args=tuple(example_args), split_spec=split_spec())
    pp = mesh[PP_DIM]
    stages = []
    for index in range(pp.get_local_rank(), pipe.num_stages, pp.size()):
        module = pipe.get_stage_module(index)
        if any(size > 1 for size in MESH_SHAPE):
            _place_stage(module, mesh[MESH_DIM_NAMES])
        stages.append(pipe.build_stage(index, torch.device(device), group=pp.get_group()))
    return stages


def build_schedule(stages, loss_fn=None):
    """The plan's schedule (SCHEDULE) of this rank's `stages` over MICRO_BATCHES."""
    import torch.distributed.pipelining as pipelining

    kind = getattr(pipelining, SCHEDULE)
    if SCHEDULE in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        return kind(stages, MICRO_BATCHES, loss_fn=loss_fn)
    return kind(stages[0], MICRO_BATCHES, loss_fn=loss_fn)


def _place_stage(module, mesh):
    """A traced stage's parameters distributed as the plan stores them over the stage's
    devices (its modules are no nn.Linear: DTensor lays out the activations op by op); the
    stage takes and hands on whole tensors, as the pipeline's sends carry them."""
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.utils._pytree import tree_map

    _without_asserts(module)
    names = {{name for name, _ in module.named_parameters()}}
    names |= {{name for name, _ in module.named_buffers()}}
    _distribute(module, mesh, {{n: p for n, p in PLACEMENTS.items() if n in names}})
    forward = module.forward

    def whole(*args, **kwargs):
        with implicit_replication():
            out = forward(*args, **kwargs)
        return tree_map(lambda t: t.full_tensor() if isinstance(t, DTensor) else t, out)

    module.forward = whole


def _without_asserts(module):
    """The metadata checks tracing leaves in a stage's graphs dropped: DTensor has no rule for
    them, and nothing reads them."""
    check = torch.ops.aten._assert_tensor_metadata.default
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in [n for n in graph.nodes if n.target is check and not n.users]:
            graph.erase_node(node)
        for compiled in (sub, getattr(sub, "graph_module", None)):
            if isinstance(compiled, torch.fx.GraphModule):
                compiled.recompile()
'''


def torch_text(block: Mapping[str, Any]) -> str:
    """The generated DTensor module's pipeline part, from a `StageSplit.to_json` block."""
    return TORCH.format(
        pp=repr(block["axis"]),
        shape=repr(tuple(block["mesh"]["shape"])),
        names=repr(tuple(block["mesh"]["dim_names"])),
        points=repr(tuple(p["module"] for p in block["split_points"])),
        chunks=repr(tuple(tuple(c["layers"]) for c in block["chunks"])),
        schedule=repr(block["schedule_class"]),
        micro_batches=repr(block["micro_batches"]),
    )

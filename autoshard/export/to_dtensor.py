"""A plan as PyTorch DTensor placements per parameter, and a module that applies them.

One placement per mesh axis: `Shard(d)`, `Replicate()`, or `Partial()`. A tensor dim split over
several mesh axes lists them outer to inner (the plan's split_axes order, major to minor), but
DTensor shards a dim over its mesh axes in mesh order (a lower mesh dim is more major). So an
axis gets `Shard(d)` when no axis listed before it on that dim has a higher mesh index, and
`_StridedShard(d, split_factor=F)` otherwise, F being the product of the sizes of the axes
listed before it with a higher index. Worked example, mesh dp=2,tp=2, dim 0 of 8 rows split
`[[1, 0]]` (tp-major): device (dp=i, tp=j) holds rows [2(2j + i), 2(2j + i) + 2); placements
`[_StridedShard(0, split_factor=2), Shard(0)]`. `_StridedShard` is private torch API
(torch.distributed.tensor.placement_types); the round trip in tests/export checks it.

A parameter whose ONNX weight is its transpose swaps the dim (an ONNX MatMul's B of shape
[in, out] split on dim 1 is `Shard(0)` of the torch Linear.weight [out, in]).

Uneven shards differ: the plan splits a dim of K over M shards in ceil(K/M) pieces, DTensor in
nested `torch.chunk` (6 rows on 2x2: the plan 2/2/2/0, DTensor 2/1/2/1); such parameters are
listed in the warnings.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoshard.export.dtensor_traffic import dtensor_traffic
from autoshard.export.held import Held, mesh_dim_names
from autoshard.export.styles import choose_styles
from autoshard.mesh import Mesh
from autoshard.sharding import Sharding

SCHEMA = "autoshard.export.dtensor/1"


class Kind(enum.Enum):
    SHARD = "Shard"
    STRIDED = "_StridedShard"
    REPLICATE = "Replicate"
    PARTIAL = "Partial"


@dataclass(frozen=True)
class Placement:
    """One mesh axis's DTensor placement; `str` is the Python that builds it."""

    kind: Kind
    dim: int = 0
    split_factor: int = 1

    def __str__(self) -> str:
        if self.kind is Kind.SHARD:
            return f"Shard({self.dim})"
        if self.kind is Kind.STRIDED:
            return f"_StridedShard({self.dim}, split_factor={self.split_factor})"
        return f"{self.kind.value}()"


def placements(sharding: Sharding, mesh: Mesh, transposed: bool = False) -> tuple[Placement, ...]:
    """The DTensor placements of a tensor held as `sharding` (see the module's docstring)."""
    out = [Placement(Kind.REPLICATE)] * mesh.ndim
    for dim, axes in enumerate(sharding.split_axes):
        torch_dim = 1 - dim if transposed else dim
        for i, axis in enumerate(axes):
            higher = [a for a in axes[:i] if a > axis]
            out[axis] = (
                Placement(Kind.STRIDED, torch_dim, math.prod(mesh.shape[a] for a in higher))
                if higher
                else Placement(Kind.SHARD, torch_dim)
            )
    for axis in sharding.partial_axes:
        out[axis] = Placement(Kind.PARTIAL)
    return tuple(out)


def _uneven(sharding: Sharding, mesh: Mesh, shape: Sequence[int]) -> bool:
    """A dim split over several axes whose shards differ: ceil-div and nested torch.chunk part
    ways (a single axis cuts the same in both)."""
    return any(
        len(axes) > 1 and shape[dim] % math.prod(mesh.shape[a] for a in axes)
        for dim, axes in enumerate(sharding.split_axes)
    )


def dtensor_export(held: Held) -> dict[str, object]:
    """The DTensor export: the mesh, the parallel styles that apply the plan, then per
    parameter its placements as stored, as read, its style and where it came from (and, of a
    training plan, its strategy and the optimizer state's placements); weights with no
    recovered name, and what DTensor cannot hold as planned."""
    mesh, names = held.mesh, mesh_dim_names(held.mesh)
    styles = choose_styles(held)
    parameters: dict[str, dict[str, object]] = {}
    warnings = list(held.warnings)
    for p in held.params:
        shape = held.shapes[p.weight]
        entry: dict[str, object] = {
            "placements": [str(x) for x in placements(p.sharding, mesh, p.transposed)],
            "used": [str(x) for x in placements(Sharding(styles.used[p.param]), mesh)],
            "style": styles.params[p.param],
            "onnx_weight": p.weight,
            "transposed": p.transposed,
            "source": str(p.source),
        }
        strategy = held.strategies.get(p.weight)
        if strategy is not None:
            state = Sharding.parse(strategy.state)
            entry["strategy"] = strategy.strategy
            entry["optimizer_state"] = [str(x) for x in placements(state, mesh, p.transposed)]
        if p.param in styles.direct:
            entry["held"] = [str(x) for x in placements(Sharding(styles.direct[p.param]), mesh)]
        parameters[p.param] = entry
        if _uneven(p.sharding, mesh, shape):
            warnings.append(
                f"{p.param}: {p.sharding.text(len(shape))} on shape {list(shape)} is uneven; "
                "DTensor cuts it by nested torch.chunk, not the plan's ceil-div"
            )
    modules: dict[str, dict[str, object]] = {}
    for path, m in styles.modules.items():
        modules[path] = {"style": str(m.style)}
        if m.sequence_dim is not None:
            modules[path]["sequence_dim"] = m.sequence_dim
        if m.fsdp_dims:
            modules[path]["fsdp_dims"] = dict(sorted(m.fsdp_dims.items()))
            modules[path]["reshard_after_forward"] = not m.zero
    inputs = {
        name: [str(x) for x in placements(held.plan.values.get(name, Sharding()), mesh)]
        for name in held.graph.inputs
        if name not in held.graph.weights
    }
    document: dict[str, object] = {
        "schema": SCHEMA,
        "mesh": {"shape": list(mesh.shape), "dim_names": list(names)},
        "inputs": inputs,
        "data": data_dims(held),
        "parallelize": {
            "tp": None if styles.tp_axis is None else names[styles.tp_axis],
            "fsdp": None if styles.fsdp_axis is None else names[styles.fsdp_axis],
            "fallback": styles.fallback,
            "modules": modules,
        },
        "parameters": parameters,
        "unnamed": held.unnamed,
        "warnings": warnings,
    }
    if held.strategies:  # a training plan: what its step moves as torch runs it
        document["traffic"] = dtensor_traffic(held, document).to_json()
    return document


def data_dims(held: Held) -> list[str]:
    """The mesh dims that split the batch (dim 0 of some model input): each data-parallel
    group of those dims reads its own examples, and the gradients are averaged over them."""
    axes: set[int] = set()
    for name in held.graph.inputs:
        if name not in held.graph.weights:
            axes.update(held.plan.values.get(name, Sharding()).axes_of(0))
    names = mesh_dim_names(held.mesh)
    return [names[a] for a in sorted(axes)]


MODULE = '''"""Generated by `autoshard export --to dtensor` from {plan}: the plan applied to a
torch model on a DeviceMesh of shape {shape} (dims {names}).

    mesh = init_device_mesh("cuda", {shape}, mesh_dim_names={names})
    apply_plan(model, mesh)   # in place
    with implicit_replication():  # plain tensors (inputs, masks) read as replicated
        out = model(inputs)       # inputs: this rank's piece of the batch (INPUTS)
    loss.backward(); sync_gradients(model, mesh); optimizer.step()   # to train

(`from torch.distributed.tensor.experimental import implicit_replication`.)

Activations follow the plan through torch's parallel styles over the mesh dim TP_DIM (STYLES:
ColwiseParallel / RowwiseParallel / SequenceParallel per module), and FSDP2's `fully_shard` over
FSDP_DIM holds the parameters the plan stores split further than they are read (FSDP: the dim
per parameter); every other parameter is distributed with `distribute_tensor`. When no style
applies (FALLBACK says why) each parameter is distributed as stored over the whole mesh, and
DTensor lays out the activations op by op. An nn.Embedding distributed split on its vocabulary
looks tokens up in its own rows and sums over the mesh dims that split them (`_vocab_parallel`);
any other module reads a parameter held `_StridedShard` gathered on that dim (`_gather_strided`).
Data parallelism is the caller's: feed each data-parallel group its slice of the batch
(INPUTS), and average the gradients over DATA_DIMS after backward (`sync_gradients`).

`_StridedShard` (a dim split over several mesh dims, minor one first) is private torch API.
"""

import functools
import warnings

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

MESH_SHAPE = {shape}
MESH_DIM_NAMES = {names}
PLACEMENTS = {{
{table}}}
"""Each parameter's placements as the plan stores it, one per mesh dim."""
TP_DIM = {tp}
FSDP_DIM = {fsdp}
FALLBACK = {fallback}
STYLES = {styles}
FSDP = {fsdp_dims}
KEEP_GATHERED = {keep}
"""fully_shard modules a training plan stores whole and updates in slices (ZeRO-1/2): their
parameters stay gathered from forward to backward (`reshard_after_forward=False`)."""
HELD_AS = {{
{held}}}
"""Parameters a training plan stores or updates split as fully_shard cannot hold them (a ZeRO
state split over two mesh dims, on two tensor dims, or on TP_DIM beyond the read): held as a
DTensor over the whole mesh in these placements (their optimizer state's), gathered to their
read for each forward, their gradients reduce-scattered back (`_hold_as`)."""
UNNAMED = {unnamed}
"""ONNX weights whose parameter name could not be recovered: left as they are."""
INPUTS = {{
{inputs}}}
"""Each model input's placements as the plan holds it: a rank reads its piece of the whole
batch, `distribute_tensor(batch, mesh, INPUTS[name]).to_local()`."""
DATA_DIMS = {data}
"""The mesh dims that split the batch: `sync_gradients` averages the gradients over them."""


def apply_plan(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """Apply the plan to `model` in place: styles, fully_shard, distribute_tensor."""
    if tuple(mesh.shape) != MESH_SHAPE:
        raise ValueError(f"the plan's mesh is {{MESH_SHAPE}}, not {{tuple(mesh.shape)}}")
    missing = [name for name in PLACEMENTS if _lookup(model, name) is None]
    if missing:
        raise KeyError(f"model has no parameter or buffer {{missing[0]!r}} ({{len(missing)}})")
    if FALLBACK is not None:
        _distribute(model, mesh, PLACEMENTS)
        _vocab_parallel(model, styled=set())
        _gather_strided(model)
        return model
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    compute = mesh[TP_DIM] if TP_DIM is not None else mesh
    # A style or fully_shard would give each of two tied parameters its own copy: a module
    # holding one is distributed instead (keeping the tie), and warned about.
    owners = {{}}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(tensor), []).append(name.rpartition(".")[0])
    tied = {{path for paths in owners.values() if len(paths) > 1 for path in paths}}
    for path in sorted(tied & (set(STYLES) | set(FSDP))):
        warnings.warn(f"{{path}} holds a tied parameter: distributed, not by its style")
    # Column and row splits are torch's for nn.Linear and nn.Embedding only.
    layers = (torch.nn.Linear, torch.nn.Embedding)
    other = {{path for path, (style, _) in STYLES.items()
             if style != "sequence" and not isinstance(model.get_submodule(path), layers)}}
    for path in sorted(other - tied):
        warnings.warn(f"{{path}} is no nn.Linear or nn.Embedding: distributed, not by its style")
    styles = {{path: style for path, style in STYLES.items() if path not in tied | other}}
    fsdp = {{path: dims for path, dims in FSDP.items() if path not in tied}}
    plan = {{}}
    for path, (style, sequence_dim) in styles.items():
        module = model.get_submodule(path)
        if style == "sequence":
            wanted = Shard(sequence_dim)
            plan[path] = SequenceParallel(sequence_dim=sequence_dim, use_local_output=False)
        else:  # outputs stay DTensors for what follows
            linear = isinstance(module, torch.nn.Linear)
            wanted = Shard(-1) if style == "rowwise" and linear else Replicate()
            kind = ColwiseParallel if style == "colwise" else RowwiseParallel
            plan[path] = kind(input_layouts=wanted, use_local_output=False)
        # A style takes a plain input as its local shard: hand it the whole input, moved to
        # the layout the style reads (an all-gather after a sequence split, a slice, ...).
        module.register_forward_pre_hook(_input_as(compute, wanted))
    if plan:
        parallelize_module(model, compute, plan)
    styled = {{n for n in PLACEMENTS if n.rpartition(".")[0] in styles}}
    sharded = {{n for n in PLACEMENTS if n.rpartition(".")[0] in fsdp}}
    if TP_DIM is not None:
        tp = MESH_DIM_NAMES.index(TP_DIM)
        rest = {{n: (p[tp],) for n, p in PLACEMENTS.items() if n not in styled}}
    else:  # FSDP and `_hold_as` gather plain tensors (a tied one's too): the others DTensors
        gathered = {{id(_lookup(model, n)[2]) for n in HELD_AS}}
        rest = {{n: p for n, p in PLACEMENTS.items() if n not in styled | sharded
                and id(_lookup(model, n)[2]) not in gathered}}
    _distribute(model, compute, rest)
    _vocab_parallel(model, styled=set(styles))
    _gather_strided(model)
    _hold_as(model, mesh, HELD_AS)
    for path, dims in fsdp.items():
        module = model.get_submodule(path)
        shard = {{id(getattr(module, leaf)): Shard(dim) for leaf, dim in dims.items()}}
        fully_shard(module, mesh=mesh[FSDP_DIM], reshard_after_forward=path not in KEEP_GATHERED,
                    shard_placement_fn=lambda p, s=shard: s[id(p)])
    return model


def sync_gradients(model: torch.nn.Module, mesh) -> None:
    """Average every gradient over the data-parallel mesh dims (DATA_DIMS), as DDP does: call
    it after backward, before the optimizer step. A parameter held split on such a dim is
    fully_shard's, which reduce-scattered (averaged) its gradient in backward: that dim is
    skipped. Several dims are one all_reduce over their flattened group."""
    import torch.distributed as dist

    for param in model.parameters():
        if param.grad is None:
            continue
        held = dict(zip(param.device_mesh.mesh_dim_names, param.placements)
                    if isinstance(param, DTensor) else ())
        dims = tuple(d for d in DATA_DIMS if isinstance(held.get(d, Replicate()), Replicate))
        if not dims:
            continue
        group = mesh[dims[0]] if len(dims) == 1 else mesh[dims]._flatten("_".join(dims))
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        dist.all_reduce(grad, group=group.get_group())
        grad.div_(group.size())


def held_placements(model: torch.nn.Module, mesh) -> dict:
    """Each planned parameter's placements over the whole mesh, as `model` now holds it
    (Replicate on the mesh dims of a DTensor's submesh it does not span)."""
    out = {{}}
    for name in PLACEMENTS:
        tensor = _lookup(model, name)[2]
        held = [Replicate()] * len(MESH_SHAPE)
        if isinstance(tensor, DTensor):
            for dim, placement in zip(tensor.device_mesh.mesh_dim_names, tensor.placements):
                held[MESH_DIM_NAMES.index(dim)] = placement
        out[name] = tuple(held)
    return out


def _hold_as(model, mesh, table):
    """Hold each parameter of `table` as a DTensor over the whole mesh in its placements; each
    forward of its module reads it as `apply_plan` would have (its placements on TP_DIM, or a
    plain tensor), gathered by `_Gathered`."""
    views, owners = {{}}, {{}}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        path, _, leaf = name.rpartition(".")
        owners.setdefault(id(tensor), []).append((model.get_submodule(path), leaf))
    for name, placements in table.items():
        tensor = _lookup(model, name)[2]
        spread = isinstance(tensor, DTensor)
        view = (tensor.device_mesh, tuple(tensor.placements)) if spread else None
        held = distribute_tensor((tensor.full_tensor() if spread else tensor).detach(), mesh,
                                 placements)
        param = torch.nn.Parameter(held, requires_grad=tensor.requires_grad)
        for module, leaf in owners[id(tensor)]:  # tied: every holder reads the one parameter
            module.register_parameter(leaf, param)
            views.setdefault(module, {{}})[leaf] = view
    for module, leaves in views.items():
        held = {{}}
        module.register_forward_pre_hook(functools.partial(_viewed, leaves, held))
        module.register_forward_hook(functools.partial(_restored, held))


def _viewed(leaves, held, module, args):
    for leaf, view in leaves.items():
        param = held[leaf] = module._parameters[leaf]
        module._parameters[leaf] = _Gathered.apply(param, view)


class _Gathered(torch.autograd.Function):
    """A parameter held over the whole mesh, gathered to `view` (a mesh and placements, or None:
    a plain tensor). Backward sums the gradient over the data dims it is held split on and not
    read split (reduce_scatter, averaged as `sync_gradients` averages), then keeps this rank's
    shard on the others (a slice: the gradient is the same there)."""

    @staticmethod
    def forward(ctx, param, view):
        mesh = param.device_mesh
        by_dim = dict(zip(view[0].mesh_dim_names, view[1])) if view is not None else {{}}
        read = [by_dim.get(n, Replicate()) for n in mesh.mesh_dim_names]
        ctx.mesh, ctx.held, ctx.read, ctx.view = mesh, tuple(param.placements), read, view
        local = param.redistribute(mesh, read).to_local()
        return local if view is None else DTensor.from_local(local, *view, run_check=False)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor):  # a plain view's too, where DTensors met it
            mesh, read = ctx.view or (grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
            grad = grad.redistribute(mesh, read).to_local()
        mesh, names = ctx.mesh, ctx.mesh.mesh_dim_names
        summed = [n in DATA_DIMS and h != r for n, h, r in zip(names, ctx.held, ctx.read)]
        partial = [Partial() if s else r for s, r in zip(summed, ctx.read)]
        # the sums first, then the slices: what is reduce-scattered does not hang on the order
        step = [h if s else r for s, h, r in zip(summed, ctx.held, ctx.read)]
        grad = DTensor.from_local(grad, mesh, partial, run_check=False).redistribute(mesh, step)
        groups = 1
        for name, s in zip(names, summed):
            groups *= mesh[name].size() if s else 1
        return grad.redistribute(mesh, ctx.held) / groups, None


def _input_as(mesh, placement):
    def hook(module, args):
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return (x.redistribute(mesh, [placement]), *args[1:])

    return hook


def _distribute(model, mesh, table):
    """distribute_tensor each parameter (or buffer) of `table`; a tied parameter is
    distributed once and stays tied."""
    done = {{}}
    for name, placements in table.items():
        module, leaf, tensor = _lookup(model, name)
        if isinstance(tensor, DTensor) and id(tensor) not in done:
            continue
        if id(tensor) in done:  # tied to a parameter distributed before: it stays tied
            first, new = done[id(tensor)]
            if tuple(placements) != tuple(new.placements):
                warnings.warn(f"{{name}} is tied to {{first}}: it keeps {{first}}'s placements "
                              f"{{tuple(new.placements)}}, not the planned {{placements}}")
        else:
            local = distribute_tensor(tensor.detach(), mesh, placements)
            new = (
                torch.nn.Parameter(local, requires_grad=tensor.requires_grad)
                if isinstance(tensor, torch.nn.Parameter)
                else local
            )
            done[id(tensor)] = (name, new)
        if isinstance(new, torch.nn.Parameter):
            module.register_parameter(leaf, new)
        else:
            module.register_buffer(leaf, new)


def _vocab_parallel(model, styled):
    """Each nn.Embedding (not given a style) whose weight is distributed split on the
    vocabulary (dim 0) looks its tokens up as the plan's program does: every rank in its own
    rows, the other tokens masked to zero, then a sum over the mesh dims that split the
    vocabulary. DTensor's own rule (`_MaskPartial`) takes the rows of one mesh dim: over two,
    both dims share one mask ("MaskBuffer has been materialized with conflicting data") and
    offset the tokens by the whole table."""
    for path, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, torch.nn.Embedding) and path not in styled
                and module.max_norm is None and isinstance(weight, DTensor)
                and any(getattr(p, "dim", None) == 0 for p in weight.placements)):
            module.forward = _masked_lookup(module)


def _gather_strided(model):
    """Each module (but a masked lookup) reads a parameter it holds `_StridedShard` (a dim
    split over several mesh dims, the minor one first) gathered on that dim, for its forward
    alone: DTensor's op rules read a `_StridedShard` as a plain `Shard` (a Linear's rows so
    held give its outputs in the wrong order, and a wrong result). The gather is
    differentiable: the gradient comes back to the parameter as it is held."""
    for module in model.modules():
        leaves = [leaf for leaf, p in module.named_parameters(recurse=False)
                  if isinstance(p, DTensor) and "forward" not in vars(module)
                  and any(isinstance(q, _StridedShard) for q in p.placements)]
        if leaves:
            held = {{}}
            module.register_forward_pre_hook(functools.partial(_gathered, leaves, held))
            module.register_forward_hook(functools.partial(_restored, held))


def _gathered(leaves, held, module, args):
    for leaf in leaves:
        param = held[leaf] = module._parameters[leaf]
        dims = {{p.dim for p in param.placements if isinstance(p, _StridedShard)}}
        want = [Replicate() if getattr(p, "dim", None) in dims else p for p in param.placements]
        module._parameters[leaf] = param.redistribute(param.device_mesh, want)


def _restored(held, module, args, output):
    module._parameters.update(held)
    held.clear()


def _masked_lookup(module):
    def forward(ids):
        weight = module.weight
        mesh, placements = weight.device_mesh, weight.placements
        if isinstance(ids, DTensor):
            ids = ids.full_tensor()
        # The plan's shards of a dim are contiguous rows: the first one's index and the count.
        (rows, _), (start, _) = compute_local_shape_and_global_offset(
            weight.shape, mesh, placements)
        table = weight.to_local()
        outside = (ids < start) | (ids >= start + rows)
        if rows:
            pad = module.padding_idx  # its row gets no gradient: the rank holding it says so
            pad = pad - start if pad is not None and start <= pad < start + rows else None
            local = torch.nn.functional.embedding(
                torch.where(outside, 0, ids - start), table, padding_idx=pad)
            local = local.masked_fill(outside.unsqueeze(-1), 0)
        else:
            local = table.new_zeros((*ids.shape, table.shape[1]))
        out = []
        for p in placements:  # a vocabulary split sums; a hidden split splits the output
            if getattr(p, "dim", None) == 0:
                p = Partial()
            elif isinstance(p, _StridedShard):
                p = _StridedShard(ids.dim(), split_factor=p.split_factor)
            elif isinstance(p, Shard):
                p = Shard(ids.dim())
            out.append(p)
        result = DTensor.from_local(local, mesh, out, run_check=False)
        return result.redistribute(
            mesh, [Replicate() if isinstance(p, Partial) else p for p in out])

    return forward


def _lookup(model, name):
    path, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    tensor = getattr(module, leaf, None)
    return (module, leaf, tensor) if isinstance(tensor, torch.Tensor) else None
'''


def dtensor_module(export: Mapping[str, object], plan_name: str) -> str:
    """The generated Python module of a DTensor export (deterministic text)."""
    mesh = export["mesh"]
    assert isinstance(mesh, dict)
    params = export["parameters"]
    assert isinstance(params, dict)
    parallel = export["parallelize"]
    assert isinstance(parallel, dict)
    table = "".join(
        f"    {json.dumps(name)}: ({', '.join(entry['placements'])},),\n"
        for name, entry in params.items()
    )
    modules = parallel["modules"]
    styles = {
        path: (m["style"], m.get("sequence_dim"))
        for path, m in modules.items()
        if m["style"] in ("colwise", "rowwise", "sequence")
    }
    fsdp = {path: m["fsdp_dims"] for path, m in modules.items() if m.get("fsdp_dims")}
    unnamed = export["unnamed"]
    assert isinstance(unnamed, dict)
    inputs, data = export.get("inputs", {}), export.get("data", [])
    assert isinstance(inputs, dict) and isinstance(data, list)
    return MODULE.format(
        plan=plan_name,
        shape=tuple(mesh["shape"]),
        names=tuple(mesh["dim_names"]),
        table=table,
        tp=repr(parallel["tp"]),
        fsdp=repr(parallel["fsdp"]),
        fallback=repr(parallel["fallback"]),
        styles=repr(styles),
        fsdp_dims=repr(fsdp),
        keep=repr(sorted(p for p, m in modules.items() if m.get("reshard_after_forward") is False)),
        held="".join(
            f"    {json.dumps(name)}: ({', '.join(entry['held'])},),\n"
            for name, entry in params.items()
            if "held" in entry
        ),
        unnamed=json.dumps(sorted(unnamed)),
        inputs="".join(
            f"    {json.dumps(name)}: ({', '.join(p)},),\n" for name, p in inputs.items()
        ),
        data=repr(tuple(data)),
    )

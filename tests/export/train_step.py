"""A training step of a DTensor export on a gloo rank, and the same step in one process: what
the tests and bench/export_dtensor_train.py share. The loss is the plan's, the sum of the
model's output; a rank reads its piece of the batch (`INPUTS`), scales its loss by the number
of data-parallel groups (gradients are averaged over them: `sync_gradients`, FSDP2), and the
step's collectives are counted per phase (`traffic.Traffic`). Each checked step of the one
process starts from the weights and optimizer states the ranks hold after the step before
(`Start`), as `run`'s reference does (`train_check.ReferenceRun`): float32 rounding, which a few
steps amplify, does not compound into the comparison. torch is imported inside."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.export.gloo import load_module
from tests.export.traffic import Traffic

LEARNING_RATES = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}


def make_optimizer(name: str, params: Any, scale: float = 1.0) -> Any:
    """SGD with momentum, Adam or AdamW, its learning rate `LEARNING_RATES`' times `scale`."""
    import torch

    lr = LEARNING_RATES[name] * scale
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


STEPS = (1, 3)  # checked after these steps


def _full(tensor: Any) -> Any:
    from torch.distributed.tensor import DTensor

    value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return value.detach().clone()


Start = tuple[dict[str, Any], dict[str, dict[str, Any]]]
"""Where a checked step starts: every parameter's whole value and its optimizer state (each
state key's whole tensor), by name."""


def held(model: Any, opt: Any) -> Start:
    """The whole weights and optimizer states `model` and `opt` hold now (gathered)."""
    params = dict(model.named_parameters())
    states = {n: {k: _full(v) for k, v in opt.state[p].items()} for n, p in params.items()
              if p in opt.state}  # fmt: skip
    return {n: _full(p) for n, p in params.items()}, states


def _restart(model: Any, opt: Any, start: Start) -> None:
    """`model`'s weights and `opt`'s states set to `start`."""
    import torch

    weights, states = start
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    for name, state in states.items():
        opt.state[params[name]] = {k: v.clone() for k, v in state.items()}


def reference(
    model: Any, batches: Sequence[Any], optimizer: str, scale: float = 1.0,
    starts: Mapping[int, Start] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """The single-process steps: per checked step, its loss, every gradient and weight; a step
    of `starts` taken from there (the ranks' state after the step before)."""
    opt = make_optimizer(optimizer, model.parameters(), scale)
    out = []
    for step, batch in enumerate(batches, 1):
        if starts and step in starts:
            _restart(model, opt, starts[step])
        opt.zero_grad()
        loss = model(batch).sum()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        if step in STEPS:
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            out.append({"loss": loss.detach().clone(), "grads": grads, "weights": weights})
    return out


def distributed(
    module_path: str | Path,
    build: Callable[[], Any],
    batches: Sequence[Any],
    optimizer: str,
    input_name: str,
    scale: float = 1.0,
) -> tuple[list[dict[str, Any]], Traffic, Any]:
    """The export's steps on this rank (every rank builds the mesh): per checked step its loss,
    every full gradient and weight, and (but the first step) the `Start` it took; the
    collectives counted; the generated module."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    generated = load_module(module_path, f"apply_{Path(module_path).parent.name}")
    shape, names = generated.MESH_SHAPE, generated.MESH_DIM_NAMES
    mesh = torch.distributed.device_mesh.DeviceMesh(
        "cpu", torch.arange(math.prod(shape)).reshape(shape), mesh_dim_names=names
    )
    model = build()
    generated.apply_plan(model, mesh)
    opt = make_optimizer(optimizer, model.parameters(), scale)
    data = math.prod(shape[names.index(d)] for d in generated.DATA_DIMS)
    traffic, out = Traffic(), []
    for step, batch in enumerate(batches, 1):
        local = distribute_tensor(batch, mesh, generated.INPUTS[input_name]).to_local()
        start = held(model, opt) if step in STEPS and step > 1 else None
        opt.zero_grad()
        with traffic.phase("forward"), implicit_replication():
            output = model(local)
            loss = output.sum() * data
        with traffic.phase("backward"), implicit_replication():
            loss.backward()
        with traffic.phase("gradient_sync"):
            generated.sync_gradients(model, mesh)
        checked = step in STEPS  # gathering the gradients is the check's, not the step's
        grads = {n: _full(p.grad) for n, p in model.named_parameters()} if checked else {}
        with traffic.phase("optimizer"):
            opt.step()
        if checked:
            total = _full(loss) / data
            dims = generated.DATA_DIMS
            if dims:  # the data-parallel groups' losses summed
                group = mesh[dims[0]] if len(dims) == 1 else mesh[dims]._flatten("_".join(dims))
                dist.all_reduce(total, group=group.get_group())
            weights = {n: _full(p) for n, p in model.named_parameters()}
            out.append({"loss": total, "grads": grads, "weights": weights, "start": start})
    return out, traffic, generated


def worst(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> dict[str, float]:
    """The largest relative error of each checked quantity (`step loss`, `step grad NAME`,
    `step weight NAME`): max |a - b| / max |b|."""
    errors = {}
    for step, g, w in zip(STEPS, got, want, strict=True):
        errors[f"{step} loss"] = _rel(g["loss"], w["loss"])
        for what in ("grads", "weights"):
            assert g[what].keys() == w[what].keys(), (g[what].keys(), w[what].keys())
            for name in w[what]:
                errors[f"{step} {what[:-1]} {name}"] = _rel(g[what][name], w[what][name])
    return errors


def _rel(a: Any, b: Any) -> float:
    scale = float(b.abs().max()) or 1.0
    return float((a - b).abs().max()) / scale

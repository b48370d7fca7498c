"""What one training step of a DTensor export moves, per device, phase and collective kind: the
plan's estimate *for that target*, priced with the plan's own ring formula
(`collectives.ring_bytes`). torch runs the export, not the plan's program: it moves what its
styles, FSDP2 and `sync_gradients` issue, which is not the plan's list of collectives.

    phase          what torch moves                                   for
    forward        all_gather of a module's flat parameter shards     each fully_shard module
                   all_reduce of a rowwise Linear's output (tp)       each rowwise Linear
                   all_gather of a colwise Linear's input (tp)        when a column split made it
                   all_reduce of a vocabulary-split lookup (tp)       each such nn.Embedding,
                                                                      styled rowwise or not
    backward       all_gather again (reshard_after_forward=True)      each fully_shard module
                                                                      but ZeRO-1/2's
                   reduce_scatter of the module's flat gradient       each fully_shard module
                   a colwise Linear's input gradient (tp):            each colwise Linear whose
                     reduce_scatter where a column split made it,     input needs a gradient
                     else all_reduce
                   a rowwise Linear's input gradient all_gathered     when it was sliced from a
                   (tp)                                               whole input
                   all_reduce of a tied LM head's input gradient      a tied tensor split on
                   (tp), partial where the next op needs it whole     its vocabulary
                   all_gather of a layer norm's input (tp), in        a column-split input
                   forward and again in backward                      (a residual stream)
    gradient_sync  all_reduce of a gradient over the data dims it     each parameter
                   is held whole on (one flattened group); a
                   rowwise nn.Embedding's whole: torch's lookup
                   backward gives its gradient whole
    optimizer      nothing: each rank updates the shard it holds

Modules styled over another mesh dim than tp (2-D tensor parallel: `axis` in the export) move
their activations over their own dim; a column split made on one dim and read by a module of
the other is all-gathered over its dim in forward by the reader's input hook (then read as a
whole input with a gradient), and so is one read by a Linear with no split (`replicated`).

A parameter `apply_plan` holds over the whole mesh in its ZeRO state's placements (`held`:
split as fully_shard cannot) is all-gathered to its read on each mesh dim where they differ in
forward, and its gradient reduce-scattered on those of them that split the batch in backward.

Where an activation comes from (`_sources`) decides: the model's inputs and constants (no
gradient), the same with a trained weight (held whole, a gradient), column-split Linears'
outputs alone (attention over their heads, a gated product: split as they are), or a mix.
FSDP2 gathers a module's parameters as one flat buffer, each parameter's shard padded to
ceil(size / n) rows of its sharded dim; a parameter's local shape elsewhere is DTensor's
(nested `torch.chunk`: the first device's ceil-div piece). What the table does not cover is
listed in `DtensorTraffic.unmodeled` (a sequence-parallel norm, a parameter distributed on tp
with no style, a fallback export), and not priced.

Worked example, models/mlp.onnx, batch 8 on dp=2,tp=2 under Megatron (x split over dp): the
rowwise Linear `2`'s output [4, 64] float32 (1 KiB) is all-reduced over tp in forward, ring
bytes 2(n-1)/n of it: 1024; the gradients are all-reduced over dp: 0.weight [128, 64] local,
32 KiB, and so on.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoshard.collectives import CollectiveKind, ring_bytes
from autoshard.export.held import Held
from autoshard.export.styles import LINEAR_OPS, NORM_OPS
from autoshard.ir import dtypes
from autoshard.ir.graph import Graph

PHASES = ("forward", "backward", "gradient_sync", "optimizer")
ALL_GATHER, ALL_REDUCE = CollectiveKind.ALL_GATHER, CollectiveKind.ALL_REDUCE
REDUCE_SCATTER = CollectiveKind.REDUCE_SCATTER
_SHARD = re.compile(r"Shard\((\d+)")


@dataclass(frozen=True)
class Moved:
    """One collective the export's step issues: where, what kind, over which mesh dims, for
    which module or parameter, and the bytes one device sends (`ring_bytes`)."""

    phase: str
    kind: CollectiveKind
    dims: tuple[str, ...]
    serves: str
    bytes_per_device: int


@dataclass(frozen=True)
class DtensorTraffic:
    moved: tuple[Moved, ...]
    unmodeled: tuple[str, ...]

    def by_phase(self) -> dict[str, dict[str, int]]:
        """Bytes per device by phase, then kind (phases in step order, kinds sorted)."""
        out: dict[str, dict[str, int]] = {}
        for m in sorted(self.moved, key=lambda m: (PHASES.index(m.phase), m.kind)):
            kinds = out.setdefault(m.phase, {})
            kinds[str(m.kind)] = kinds.get(str(m.kind), 0) + m.bytes_per_device
        return out

    def to_json(self) -> dict[str, Any]:
        return {"bytes_per_device": self.by_phase(), "unmodeled": list(self.unmodeled)}


def _sizes(export: Mapping[str, Any]) -> dict[str, int]:
    mesh = export["mesh"]
    return dict(zip(mesh["dim_names"], mesh["shape"], strict=True))


def _held(
    entry: Mapping[str, Any],
    names: Sequence[str],
    tp: str | None,
    fsdp: str | None,
    dim: int | None,
) -> list[str]:
    """The placement per mesh dim `apply_plan` leaves a parameter with: its style's on tp,
    FSDP's shard of torch dim `dim` on the fsdp dim (None: not fully_shard-ed), and with no tp
    dim the stored placements of the rest."""
    out = []
    for name, placement in zip(names, entry["placements"], strict=True):
        if name == fsdp and dim is not None:
            out.append(f"Shard({dim})")
        elif name == tp or (tp is None and dim is None):
            out.append(placement)
        else:
            out.append("Replicate()")
    return out


def _local(shape: Sequence[int], placements: Sequence[str], sizes: Sequence[int]) -> list[int]:
    """The first device's shard of `shape` (ceil-div per splitting mesh dim)."""
    local = list(shape)
    for placement, n in zip(placements, sizes, strict=True):
        found = _SHARD.search(placement)
        if found:
            dim = int(found.group(1))
            local[dim] = -(-local[dim] // n)
    return local


def dtensor_traffic(held: Held, export: Mapping[str, Any]) -> DtensorTraffic:
    """The collectives one training step of `export` (`to_dtensor.dtensor_export` of `held`)
    issues on the first device (see the module's docstring)."""
    parallel = export["parallelize"]
    if parallel["fallback"] is not None:
        return DtensorTraffic((), (f"no parallel style: {parallel['fallback']}",))
    sizes = _sizes(export)
    names, tp, fsdp = list(sizes), parallel["tp"], parallel["fsdp"]
    data = tuple(export["data"])
    by_param = {p.param: p for p in held.params}
    moved: list[Moved] = []
    unmodeled: list[str] = []
    flat: dict[str, int] = {}  # fully_shard module -> its flat shard's bytes
    for name, entry in export["parameters"].items():
        p = by_param[name]
        shape = held.shapes[p.weight][::-1] if p.transposed else held.shapes[p.weight]
        path, _, leaf = name.rpartition(".")
        dim = parallel["modules"].get(path, {}).get("fsdp_dims", {}).get(leaf)
        if name in held.tied:  # apply_plan distributes a tied tensor, once: no fully_shard
            if held.tied[name] != name:
                continue
            dim = None
        axis = parallel["modules"].get(path, {}).get("axis", tp)
        placements = _held(entry, names, axis, fsdp, dim)
        itemsize = dtypes.nbytes(held.graph.values[p.weight].dtype, 1)
        if "held" in entry:  # `_hold_as`: gathered to its read, the gradient scattered back
            readers = 1 + sum(1 for n, first in held.tied.items() if first == name != n)
            stored = zip(names, entry["placements"], strict=True)
            read = [x if d == tp else "Replicate()" for d, x in stored]
            for _ in range(readers):  # a tied parameter: each module holding it reads it
                moved += _gathered(name, shape, itemsize, entry["held"], read, sizes, data)
            placements = entry["held"]
        if dim is not None:  # FSDP2's padded shard of the tensor-parallel shard
            tp_only = [
                x if d == tp else "Replicate()" for d, x in zip(names, placements, strict=True)
            ]
            shard = _local(shape, tp_only, list(sizes.values()))
            shard[dim] = -(-shard[dim] // sizes[fsdp])
            flat[path] = flat.get(path, 0) + math.prod(shard) * itemsize
        whole = tuple(
            d for d, x in zip(names, placements, strict=True) if d in data and x == "Replicate()"
        )
        if name not in held.tied and _table_rowwise(
            held, parallel["modules"].get(path, {}), p.weight
        ):
            placements = ["Replicate()"] * len(names)  # torch gives its gradient whole
        if whole:
            local = math.prod(_local(shape, placements, list(sizes.values()))) * itemsize
            sent = ring_bytes(ALL_REDUCE, math.prod(sizes[d] for d in whole), local)
            moved.append(Moved("gradient_sync", ALL_REDUCE, whole, name, sent))
    for path, local in sorted(flat.items()):
        n, axes = sizes[fsdp], (fsdp,)
        gather = ring_bytes(ALL_GATHER, n, local)
        moved.append(Moved("forward", ALL_GATHER, axes, path, gather))
        if parallel["modules"][path].get("reshard_after_forward", True):
            moved.append(Moved("backward", ALL_GATHER, axes, path, gather))
        scatter = ring_bytes(REDUCE_SCATTER, n, n * local)
        moved.append(Moved("backward", REDUCE_SCATTER, axes, path, scatter))
    moved += _activations(held, export, data, sizes, unmodeled)
    return DtensorTraffic(tuple(moved), tuple(unmodeled))


def _table_rowwise(held: Held, module: Mapping[str, Any], weight: str) -> bool:
    """An embedding table under torch's RowwiseParallel (split on its vocabulary): DTensor's
    lookup backward gives the table's gradient whole on every rank of tp."""
    lookups = [o for o in held.graph.consumers(weight) if o.type == "Gather"]
    return module.get("style") == "rowwise" and bool(lookups) and lookups[0].inputs[0] == weight


def _gathered(
    name: str,
    shape: Sequence[int],
    itemsize: int,
    held: Sequence[str],
    read: Sequence[str],
    sizes: Mapping[str, int],
    data: Sequence[str],
) -> list[Moved]:
    """A parameter held over the whole mesh as `held` and read as `read`: all-gathered on each
    mesh dim where they differ in forward, its gradient reduce-scattered in backward on those of
    them that split the batch (the others: a slice)."""
    n = list(sizes.values())
    local = math.prod(_local(shape, held, n)) * itemsize
    moved = []
    differ = [d for d, h, r in zip(sizes, held, read, strict=True) if h != r]
    for d in differ:
        moved.append(
            Moved("forward", ALL_GATHER, (d,), name, ring_bytes(ALL_GATHER, sizes[d], local))
        )
        local *= sizes[d]
    for d in (d for d in differ if d in data):
        sent = ring_bytes(REDUCE_SCATTER, sizes[d], local)
        moved.append(Moved("backward", REDUCE_SCATTER, (d,), name, sent))
        local //= sizes[d]
    return moved


def _activations(
    held: Held,
    export: Mapping[str, Any],
    data: Sequence[str],
    sizes: Mapping[str, int],
    unmodeled: list[str],
) -> list[Moved]:
    """The tensor-parallel styles' activation collectives (see the module's docstring)."""
    tp = export["parallelize"]["tp"]
    groups = math.prod(sizes[d] for d in data)
    graph, by_param = held.graph, {p.param: p for p in held.params}
    # the op of a styled Linear -> (module, style, its mesh dim)
    linears: dict[str, tuple[str, str, str]] = {}
    n, axes = (sizes[tp] if tp is not None else 1), (tp,)
    modules = export["parallelize"]["modules"]
    two = any("axis" in m for m in modules.values())  # a Linear with no split gathers its input
    moved = []
    for path, module in modules.items():
        style = module["style"]
        styled = ("colwise", "rowwise", "sequence") + (("replicate",) if two else ())
        if style not in styled or f"{path}.weight" in held.tied:
            continue  # no style, or a tied module's (distributed, not styled)
        weight = by_param[f"{path}.weight" if path else "weight"]
        lookup = [o for o in graph.consumers(weight.weight) if o.type == "Gather"]
        if style == "rowwise" and lookup and lookup[0].inputs[0] == weight.weight:
            # a vocabulary split: each rank's rows looked up, the output summed
            out = graph.values[lookup[0].outputs[0]].nbytes // groups
            moved.append(Moved("forward", ALL_REDUCE, axes, path, ring_bytes(ALL_REDUCE, n, out)))
            continue
        op = next((o for o in graph.consumers(weight.weight) if o.type in LINEAR_OPS), None)
        if style == "replicate" and (op is None or op.inputs[1] != weight.weight):
            continue  # a norm's weight: it reads its input as DTensor gives it
        if style == "sequence" or op is None or op.inputs[1] != weight.weight:
            unmodeled.append(f"{path}: a {style} {op.type if op else 'module'}'s activations")
            continue
        linears[op.name] = (path, style, module.get("axis", tp))
    linears.update(_tied_linears(held, export, unmodeled))
    sources = _sources(graph, linears, frozenset(held.strategies), tp)
    for name, (path, style, axis) in linears.items():
        op = graph.op_by_name[name]
        n, axes = sizes[axis], (axis,)
        whole = graph.values[op.inputs[0]].nbytes // groups  # the rank's examples, whole on tp
        source = sources.get(op.inputs[0], "input")
        other = source.partition("@")[2] or tp if source.startswith("colwise") else axis
        if other != axis:  # another dim's column split, gathered by the reader's input hook
            sent = ring_bytes(ALL_GATHER, sizes[other], -(-whole // sizes[other]))
            moved.append(Moved("forward", ALL_GATHER, (other,), f"{path} input", sent))
        source = "whole" if other != axis else source.partition("@")[0]
        if style == "replicate":
            if source == "colwise":  # split on this dim: DTensor's moves
                unmodeled.append(f"{path}: a column-split input into a Linear with no split")
            continue
        if style == "rowwise":
            out = graph.values[op.outputs[0]].nbytes // groups
            moved.append(Moved("forward", ALL_REDUCE, axes, path, ring_bytes(ALL_REDUCE, n, out)))
            if source not in ("colwise", "input"):  # sliced from a whole input
                sent = ring_bytes(ALL_GATHER, n, -(-whole // n))
                moved.append(Moved("backward", ALL_GATHER, axes, f"{path} input", sent))
        elif path in held.tied and source == "colwise":  # no style gathers it: DTensor's
            unmodeled.append(f"{path}: a split input into a tied {op.type}")
        elif source == "colwise":  # gathered to be read whole; its gradient summed to shards
            sent = ring_bytes(ALL_GATHER, n, -(-whole // n))
            moved.append(Moved("forward", ALL_GATHER, axes, f"{path} input", sent))
            sent = ring_bytes(REDUCE_SCATTER, n, whole)
            moved.append(Moved("backward", REDUCE_SCATTER, axes, f"{path} input", sent))
        elif source != "input":  # a gradient flows back to a whole input: summed
            sent = ring_bytes(ALL_REDUCE, n, whole)
            moved.append(Moved("backward", ALL_REDUCE, axes, f"{path} input", sent))
    moved += _norms(graph, sources, groups, n, axes, unmodeled)
    return moved + _lookups(held, export, groups, sizes, unmodeled)


def _norms(
    graph: Graph,
    sources: Mapping[str, str],
    groups: int,
    n: int,
    axes: tuple[str, ...],
    unmodeled: list[str],
) -> list[Moved]:
    """A column-split activation carried on to a norm (a residual stream a colwise Linear's
    output was added to: DTensor keeps the sum split): torch's layer norm reads its input
    whole, all-gathered in forward and again in backward (the saved input), and its output
    is whole. An RMS norm written as ops (Llama's) is not modeled."""
    moved = []
    for op in graph.ops:
        if op.type not in NORM_OPS or graph.phase(op.name) != "forward":
            continue
        if sources.get(op.inputs[0], "").startswith("colwise@"):
            unmodeled.append(f"{op.name}: an input split over another mesh dim into {op.type}")
        if sources.get(op.inputs[0]) != "colwise":
            continue
        if op.type != "LayerNormalization":
            unmodeled.append(f"{op.name}: a column-split input into {op.type}")
            continue
        whole = graph.values[op.inputs[0]].nbytes // groups
        sent = ring_bytes(ALL_GATHER, n, -(-whole // n))
        for phase in ("forward", "backward"):
            moved.append(Moved(phase, ALL_GATHER, axes, f"{op.name} input", sent))
    return moved


def _tied_linears(
    held: Held, export: Mapping[str, Any], unmodeled: list[str]
) -> dict[str, tuple[str, str, str]]:
    """The linear ops reading a tied parameter (a tied LM head), which `apply_plan`
    distributes, not styles: split on its output dim over tp it runs as a colwise Linear does
    (its input's gradient partial over tp, summed where DTensor's next op needs it whole: the
    final norm's backward). op -> (parameter, "colwise", tp); other splits are not modeled."""
    tp, names = export["parallelize"]["tp"], list(export["mesh"]["dim_names"])
    found = {}
    for p in held.params:
        first = held.tied.get(p.param)
        if first is None or tp is None:
            continue
        placement = export["parameters"][first]["placements"][names.index(tp)]
        for op in held.graph.consumers(p.weight):
            if op.type not in LINEAR_OPS or op.inputs[1] != p.weight:
                continue
            if placement == "Shard(0)":  # F.linear reads it as torch's [out, in]
                found[op.name] = (p.param, "colwise", tp)
            elif placement != "Replicate()":
                unmodeled.append(f"{p.param}: a tied {op.type} split {placement} on {tp}")
    return found


def _lookups(
    held: Held,
    export: Mapping[str, Any],
    groups: int,
    sizes: Mapping[str, int],
    unmodeled: list[str],
) -> list[Moved]:
    """A parameter `apply_plan` distributes (no style) split on tp: an embedding table split on
    its vocabulary over one mesh dim sums its masked lookups there (an all_reduce of the
    output in forward); DTensor's own moves for any other are not modeled."""
    tp = export["parallelize"]["tp"]
    names = list(sizes)
    moved = []
    for name, entry in export["parameters"].items():
        if (entry["style"].split("+")[0] != "distribute" and name not in held.tied) or tp is None:
            continue  # styled (a tied parameter is distributed, not styled)
        placement = entry["placements"][names.index(tp)]
        if placement == "Replicate()":
            continue
        p = next(q for q in held.params if q.param == name)
        readers = [o for o in held.graph.consumers(p.weight) if o.inputs[0] == p.weight]
        if not p.transposed and placement == "Shard(0)" and [o.type for o in readers] == ["Gather"]:
            out = held.graph.values[readers[0].outputs[0]].nbytes // groups
            sent = ring_bytes(ALL_REDUCE, sizes[tp], out)
            moved.append(Moved("forward", ALL_REDUCE, (tp,), f"{name} lookup", sent))
        elif name not in held.tied:  # a tied LM head: `_tied_linears`
            unmodeled.append(f"{name}: distributed {placement} on {tp}, DTensor's moves")
    return moved


def _sources(
    graph: Graph,
    linears: Mapping[str, tuple[str, str, str]],
    trained: frozenset[str],
    tp: str | None,
) -> dict[str, str]:
    """Where each forward activation comes from: `input` (from the model's inputs and
    constants alone: held whole, no gradient), `whole` (the same with a trained weight among
    them: a gradient flows back), `colwise` (from column-split Linears' outputs, split as they
    are: attention over their heads, a gated product; a bias or a table beside them) or `other`
    (a row-split Linear's summed output, or a mix). Values no op writes: `input`, or `whole`
    for a trained weight. A column split over another mesh dim than `tp` is `colwise@DIM`; a
    Linear with no split reads its input gathered: `whole`."""
    found: dict[str, str] = {w: "whole" for w in trained}
    for op in graph.ops:
        if graph.phase(op.name) != "forward":
            continue
        if op.name in linears:
            _, style, axis = linears[op.name]
            column = "colwise" if axis == tp else f"colwise@{axis}"
            kind = {"colwise": column, "replicate": "whole"}.get(style, "other")
        elif op.type == "LayerNormalization" and found.get(op.inputs[0]) == "colwise":
            kind = "whole"  # gathered to be normalized (`_norms`)
        else:
            kinds = {found.get(i, "input") for i in op.inputs if i}
            split = kinds - {"input", "whole"}
            if split:
                kind = split.pop() if len(split) == 1 else "other"
            else:
                kind = "whole" if "whole" in kinds else "input"
        for out in op.outputs:
            found[out] = kind
    return found

"""Which of torch's parallel styles apply a plan so that activations follow it, not only the
parameters: per torch module, `ColwiseParallel` / `RowwiseParallel` (Megatron's column and row
splits of a Linear; the vocabulary or hidden split of an Embedding), `SequenceParallel` (a norm
whose input is split on the sequence) over one mesh axis, and `fully_shard` (FSDP2) over another
for parameters held split further than they are read (and, kept gathered from forward to
backward, those a training plan stores whole but updates in slices: ZeRO-1/2, the optimizer
state's split).

A parameter is *stored* as the plan holds it (a training plan's `stored`) and *used* as its
forward readers need it. DTensor's styles each take one mesh dim, so they apply when every
parameter is used split over at most one mesh axis, the tensor-parallel one (`tp`). What is
stored split beyond that on another axis is FSDP's (`fsdp`: one axis for all, one tensor dim
per parameter, listed last on that dim: FSDP2 shards the tensor-parallel shard, tp-major). A
parameter held on `tp` otherwise than read (split but gathered by its reader, or whole and
sliced) is distributed as held, and DTensor moves it when read; its module takes no style.
Otherwise every parameter is distributed as stored on the whole mesh, and `fallback` says why.

A plan may read different modules' parameters split over different mesh dims (the attention's
heads over one, the MLP's hidden over another: 2-D tensor parallelism): each module then takes
its style over its own mesh dim (`axes`; `tp` is the dim most parameters are read over) when
each module reads over one dim, no such dim splits the batch and none is stored split further
(no fully_shard beside them). A module with no split (a replicated Linear) then reads its input
whole: DTensor's output of another dim's styles all-gathered (`replicated` in the export).

Worked example, models/mlp.onnx (Gemm, weights [out, in]) on dp=2,tp=2, `0.weight` stored
`[[1], [0]]` and used `[[1], []]`, `0.bias` `[[1]]`, `2.weight` `[[], [1]]`, `2.bias` `[[]]`:
tp is axis 1, fsdp axis 0; module `0` is colwise with `weight` sharded by FSDP on dim 1, module
`2` rowwise.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from autoshard.export.held import Held, ParamPlacement, Split, mesh_dim_names, torch_layout
from autoshard.sharding import Sharding

LINEAR_OPS = frozenset({"MatMul", "Gemm"})
NORM_OPS = frozenset({"LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization"})


class Style(enum.StrEnum):
    COLWISE = "colwise"
    ROWWISE = "rowwise"
    SEQUENCE = "sequence"
    REPLICATE = "replicate"  # no split to follow: Replicate on the tensor-parallel axis
    DISTRIBUTE = "distribute"  # no style matches: distribute_tensor as used


class Role(enum.Enum):
    LINEAR = "linear"  # the [out, in] weight of a Linear and its bias
    IN_OUT = "in_out"  # an [in, out] weight read `x @ weight + bias` (GPT-2's Conv1D)
    EMBEDDING = "embedding"
    NORM = "norm"
    OTHER = "other"


@dataclass(frozen=True)
class ModuleStyle:
    """A torch module's style on the tp axis, and the dim FSDP shards each of its parameters
    on (by leaf name; empty: not fully_shard-ed)."""

    style: Style
    sequence_dim: int | None = None
    fsdp_dims: Mapping[str, int] = field(default_factory=dict)
    # ZeRO-1/2: every sharded parameter is held whole and only its optimizer state split, so
    # FSDP keeps it gathered from forward to backward (`reshard_after_forward=False`).
    zero: bool = False
    # its weight is [in, out] (GPT-2's Conv1D): torch's Linear styles with the dims swapped
    in_out: bool = False


@dataclass(frozen=True)
class Styles:
    tp_axis: int | None
    fsdp_axis: int | None
    modules: Mapping[str, ModuleStyle]
    params: Mapping[str, str]  # parameter -> its style, `colwise+fsdp`, `distribute`, ...
    used: Mapping[str, Split]  # parameter -> its used split (torch layout)
    fallback: str | None = None
    # module -> the mesh axis its style splits over, where it is not `tp_axis`
    axes: Mapping[str, int] = field(default_factory=dict)
    # parameter -> the split (torch layout) it is held in as a DTensor over the whole mesh,
    # its ZeRO state's (or, beside one, its stored split): gathered for the forward.
    direct: Mapping[str, Split] = field(default_factory=dict)


def _axes(split: Split) -> set[int]:
    return {a for axes in split for a in axes}


def _dims(split: Split, rank: int) -> Split:
    return tuple(split) + ((),) * (rank - len(split))


@dataclass(frozen=True)
class _Read:
    role: Role
    used: Split
    sequence: tuple[int, int] | None  # a norm's input split: (dim, axis)


def _read(held: Held, p: ParamPlacement) -> _Read:
    """How the forward reads a parameter: its first reader's role and need."""
    graph, rank = held.graph, len(held.shapes[p.weight])
    readers = [
        (op, i)
        for op in graph.consumers(p.weight)
        for i, n in enumerate(op.inputs)
        if n == p.weight
    ]
    if not readers:
        return _Read(Role.OTHER, torch_layout(p.sharding.split_axes, p.transposed), None)
    op, index = readers[0]
    used = torch_layout(held.plan.needs.get((op.name, index), p.sharding).split_axes, p.transposed)
    role, sequence = Role.OTHER, None
    if op.type in LINEAR_OPS and index == 1 and rank == 2:
        # torch's Linear holds [out, in]: a MatMul reads its transpose, a Gemm with transB.
        out_in = p.transposed if op.type == "MatMul" else bool(op.attr("transB", 0)) != p.transposed
        role = Role.LINEAR if out_in else Role.IN_OUT
    elif op.type in LINEAR_OPS | {"Add"} and rank == 1:
        role = Role.LINEAR  # a bias: its module decides
    elif op.type == "Gather" and index == 0 and rank == 2 and not p.transposed:
        role = Role.EMBEDDING
    elif op.type in NORM_OPS:
        role = Role.NORM
        need = held.plan.needs.get((op.name, 0), Sharding()).split_axes
        x_rank = len(graph.values[op.inputs[0]].shape)
        # Split on one dim between the batch (the caller's data parallelism) and the
        # normalized last dim: the sequence.
        need = need + ((),) * (x_rank - len(need))
        split = [(d, axes) for d, axes in enumerate(need[1:-1], 1) if axes]
        if len(split) == 1 and len(split[0][1]) == 1 and not need[-1]:
            sequence = (split[0][0], split[0][1][0])
    return _Read(role, used, sequence)


def _module_style(reads: Mapping[str, _Read], tp: int | None) -> tuple[Style, int | None]:
    """The style of a module from its parameters' reads (by leaf name)."""
    weight = reads.get("weight")
    rest = {k: r for k, r in reads.items() if k != "weight"}
    if all(not _axes(r.used) for r in reads.values()):
        sequence = weight.sequence if weight is not None and weight.role is Role.NORM else None
        if sequence is not None and sequence[1] == tp:
            return Style.SEQUENCE, sequence[0]
        return Style.REPLICATE, None
    if weight is None or weight.role not in (Role.LINEAR, Role.IN_OUT, Role.EMBEDDING):
        return Style.DISTRIBUTE, None
    used = _dims(weight.used, 2)
    biases = {k: _dims(r.used, 1) for k, r in rest.items()}
    if set(biases) - {"bias"}:
        return Style.DISTRIBUTE, None
    # the weight's split of a column-parallel module (its output features), of a row-parallel
    # one (its input features; an embedding's vocabulary)
    col: tuple[object, ...] = ((tp,), ()) if weight.role is Role.LINEAR else ((), (tp,))
    row: tuple[object, ...] = ((), (tp,)) if weight.role is Role.LINEAR else ((tp,), ())
    if used == col and all(b == ((tp,),) for b in biases.values()):
        return Style.COLWISE, None
    if used == row and all(b == ((),) for b in biases.values()):
        return Style.ROWWISE, None
    return Style.DISTRIBUTE, None


def choose_styles(held: Held) -> Styles:
    """The parallel style of every planned parameter (see the module's docstring)."""
    reads = {p.param: _read(held, p) for p in held.params}
    used = {name: r.used for name, r in reads.items()}
    stored = {p.param: p.torch_split() for p in held.params}
    tp_axes = set().union(*map(_axes, used.values())) if used else set()
    sequence_axes = {r.sequence[1] for r in reads.values() if r.sequence}
    if not tp_axes and len(sequence_axes) == 1:  # sequence parallel alone
        tp_axes = sequence_axes
    tp, axes, why = _tp_axes(held, reads, tp_axes)
    if why is not None:
        return _fallback(held, used, why)
    tps = frozenset(tp_axes)
    fsdp: dict[str, tuple[int, int]] = {}  # parameter -> (dim, axis) FSDP shards
    as_stored: set[str] = set()  # held on tp otherwise than read: distributed as held
    zero, direct = _zero(held, stored, used, tps)
    zeroed = _zeroed(held)
    for p in held.params:
        rank = len(held.shapes[p.weight])
        have = _dims(zero.get(p.param, stored[p.param]), rank)
        if held.tied.get(p.param, p.param) in direct:  # as stored on tp; the rest `_hold_as`'s
            have = tuple(tuple(a for a in axes if a == tp) for axes in have)
        need = _dims(used[p.param], rank)
        extra = _extra(have, need, tps)
        if len(extra) > 1 or (extra and have[extra[0][0]][-1] != extra[0][1]):
            return _fallback(
                held,
                used,
                f"{p.param} is stored {Sharding(stored[p.param])} and read "
                f"{Sharding(used[p.param])}: fully_shard splits one tensor dim over one mesh "
                "dim more, inside the rest",
            )
        if extra:
            fsdp[p.param] = extra[0]
            d = extra[0][0]
            have = (*have[:d], have[d][:-1], *have[d + 1 :])
        if have != need:  # held split on tp but read whole, or held whole and read split
            as_stored.add(p.param)
    fsdp_axes = {axis for _, axis in fsdp.values()}
    why = _off_main(held, axes, set(fsdp), {*direct, *as_stored})
    if why is not None:
        return _fallback(held, used, why)
    if len(fsdp_axes) > 1:
        return _fallback(
            held,
            used,
            f"parameters are stored split further over mesh dims {_names(held, fsdp_axes)}; "
            "fully_shard here takes one",
        )
    by_module: dict[str, dict[str, _Read]] = {}
    for name, r in reads.items():
        path, _, leaf = name.rpartition(".")
        by_module.setdefault(path, {})[leaf] = r
    modules: dict[str, ModuleStyle] = {}
    params: dict[str, str] = {}
    for path, members in sorted(by_module.items()):
        names = {leaf: f"{path}.{leaf}" if path else leaf for leaf in members}
        sharded = {leaf: fsdp[n][0] for leaf, n in names.items() if n in fsdp}
        if sharded and len(sharded) != len(members):
            return _fallback(
                held,
                used,
                f"module {path or '(root)'} holds parameters split further "
                f"({', '.join(sorted(sharded))}) and others not; fully_shard shards them all",
            )
        style, sequence_dim = _module_style(members, axes.get(path, tp))
        if path in axes and style not in (Style.COLWISE, Style.ROWWISE):
            return _fallback(held, used, f"module {path}: {_ONE_STYLE}")
        if as_stored & set(names.values()):
            style, sequence_dim = Style.DISTRIBUTE, None
        kept = bool(sharded) and all(n in zero for n in names.values())
        weight = members.get("weight")
        in_out = weight is not None and weight.role is Role.IN_OUT
        modules[path] = ModuleStyle(style, sequence_dim, sharded, kept, in_out)
        for leaf, n in names.items():
            params[n] = str(style) + ("" if leaf not in sharded else "+zero" if kept else "+fsdp")
            if n in direct:
                params[n] = str(style) + ("+zero" if n in zeroed else "+fsdp")
    fsdp_axis = next(iter(fsdp_axes), None)
    return Styles(tp, fsdp_axis, modules, params, used, axes=axes, direct=direct)


def _tp_axes(
    held: Held, reads: Mapping[str, _Read], tp_axes: AbstractSet[int]
) -> tuple[int | None, dict[str, int], str | None]:
    """The tensor-parallel axis (of parameters read split over several mesh dims: the one most
    are read over, the last of a tie), the modules reading over another (path -> axis), or why
    no style fits."""
    if len(tp_axes) < 2:
        return min(tp_axes, default=None), {}, None
    by_module: dict[str, set[int]] = {}
    count: dict[int, int] = {}
    for name, r in reads.items():
        by_module.setdefault(name.rpartition(".")[0], set()).update(_axes(r.used))
        for axis in _axes(r.used):
            count[axis] = count.get(axis, 0) + 1
    tp = max(count, key=lambda a: (count[a], a))
    two = sorted((path, found) for path, found in by_module.items() if len(found) > 1)
    batch = data_axes(held) & set(count)
    why = None
    if two:
        why = (
            f"module {two[0][0] or '(root)'} reads parameters split over mesh dims "
            f"{_names(held, two[0][1])}; DTensor's parallel styles take one"
        )
    elif batch:
        why = (
            f"mesh dim {_names(held, batch)} splits both the batch and parameters' reads; "
            "DTensor's parallel styles read their input whole over it"
        )
    axes = {path: a for path, found in by_module.items() for a in found if a != tp}
    return tp, {} if why else axes, why


_ONE_STYLE = "read split over another mesh dim, but not by a column or row style"


def _off_main(
    held: Held, axes: Mapping[str, int], fsdp: AbstractSet[str], as_held: AbstractSet[str]
) -> str | None:
    """Beside modules styled over another mesh dim (`axes`), why a parameter fully_shard would
    hold, or one of such a module held otherwise than read (`as_held`), is not written."""
    odd = {*fsdp, *(n for n in as_held if n.rpartition(".")[0] in axes)}
    if not axes or not odd:
        return None
    return (
        f"{min(odd)} is stored split otherwise than read beside parameters read split over "
        f"mesh dims {_names(held, {*axes.values()})} and another: not written"
    )


def data_axes(held: Held) -> set[int]:
    """The mesh axes that split the batch: dim 0 of a model input."""
    axes: set[int] = set()
    for name in held.graph.inputs:
        if name not in held.graph.weights:
            axes.update(held.plan.values.get(name, Sharding()).axes_of(0))
    return axes


def _zero(
    held: Held, stored: Mapping[str, Split], used: Mapping[str, Split], tps: frozenset[int]
) -> tuple[dict[str, Split], dict[str, Split]]:
    """Where a training plan's ZeRO-1/2 optimizer states (and its weights split as fully_shard
    cannot) are held: the parameters it stores as used but whose state it splits further (their
    state's split, torch layout) that FSDP2 holds, and those held as plain DTensors over the
    whole mesh (`direct`). fully_shard shards a module's parameters all, one more tensor dim over
    one mesh dim beside tp, inside the rest: a module with a parameter or state split otherwise
    (over two mesh dims, on two tensor dims, a state on tp beyond the read) or with parameters
    held whole beside split ones holds every parameter it stores or updates split as a DTensor
    in its state's split (or its stored one), gathered for the forward (`apply_plan`'s
    `_hold_as`). An inference plan's weights so split fall back (`choose_styles`): DTensor reads
    them as stored."""
    states: dict[str, Split] = {}
    further: dict[str, Split] = {}  # held further than read, beside tp: fully_shard's
    unfit = set()  # modules with a weight or state split as fully_shard cannot hold it
    for p in held.params:
        rank = len(held.shapes[p.weight])
        need, have = _dims(used[p.param], rank), _dims(stored[p.param], rank)
        stored_extra = _extra(have, need, tps)
        if stored_extra:
            further[p.param] = have
            odd = len(stored_extra) > 1 or have[stored_extra[0][0]][-1] != stored_extra[0][1]
            if odd and held.strategies:  # an inference plan's falls back (DTensor reads it)
                unfit.add(p.param.rpartition(".")[0])
        strategy = held.strategies.get(p.weight)
        if strategy is None or "zero" not in strategy.strategy.split("+"):
            continue
        state = _dims(torch_layout(Sharding.parse(strategy.state).split_axes, p.transposed), rank)
        extra = _extra(state, need, tps)
        on_tp = any(t in state[d] and t not in need[d] for t in tps for d in range(rank))
        if not extra and not on_tp:
            continue
        states[p.param] = state
        if on_tp or len(extra) > 1 or state[extra[0][0]][-1] != extra[0][1]:
            unfit.add(p.param.rpartition(".")[0])
    modules: dict[str, list[str]] = {}
    for p in held.params:
        modules.setdefault(p.param.rpartition(".")[0], []).append(p.param)
    mixed = {
        path
        for path, names in modules.items()
        if path in unfit
        or (any(n in states for n in names) and not all(n in states or n in further for n in names))
    }
    direct = {
        n: states.get(n, further.get(n, ()))
        for path in mixed
        for n in modules[path]
        if (n in states or n in further) and held.tied.get(n, n) == n
    }
    return {n: s for n, s in states.items() if n.rpartition(".")[0] not in mixed}, direct


def _zeroed(held: Held) -> set[str]:
    """The parameters whose optimizer state a training plan splits further (ZeRO)."""
    strategies = held.strategies
    return {
        p.param
        for p in held.params
        if p.weight in strategies and "zero" in strategies[p.weight].strategy.split("+")
    }


def _extra(have: Split, need: Split, tps: frozenset[int]) -> list[tuple[int, int]]:
    """(dim, mesh axis) of each split `have` holds beyond `need`, the styles' axes aside."""
    return [(d, a) for d in range(len(have)) for a in have[d] if a not in need[d] and a not in tps]


def _names(held: Held, axes: AbstractSet[int]) -> str:
    return ", ".join(mesh_dim_names(held.mesh)[a] for a in sorted(axes))


def _fallback(held: Held, used: Mapping[str, Split], reason: str) -> Styles:
    params = {p.param: str(Style.DISTRIBUTE) for p in held.params}
    return Styles(None, None, {}, params, used, reason)

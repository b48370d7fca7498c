"""What changed between two plans (`autoshard diff A.json B.json`): the ops whose sharding
option changed and the weights and inputs held or read otherwise (`held`), grouped by repeated
layer; the collectives added and removed (by value, kind and mesh axes); the cost deltas.

It reads the two plan documents only (no model): a layer is the document's
`search.repeated_layers` (op `first_op + k*ops_per_layer + j` is op j of layer k, in the
document's op order, which is the graph's), a weight belongs to the layer of the first op
reading it. Layers changed alike (the same changes at the same offsets) are told once:

    layers 0-11 (each alike; names of layer 0): 4 ops, 2 weights
      op /h.0/mlp/c_fc/Gemm: [[0]] -> [[], [1]]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from autoshard.document.blocks import CollectiveEntry, CostFigures, HeldValue
from autoshard.document.plan_document import PlanDocument
from autoshard.explain.report import format_seconds
from autoshard.units import format_bytes

COSTS = (
    ("memory_bytes_per_device", "memory per device", "bytes"),
    ("comm_bytes_per_device", "communication per device", "bytes"),
    ("comm_time_s", "communication time", "seconds"),
    ("compute_time_s", "compute time", "seconds"),
    ("objective", "objective", "seconds"),
)
OUTSIDE = "outside the layers"


def _layers(document: PlanDocument) -> tuple[int, int, int]:
    """(first op, ops per layer, layers) of a document; (0, 1, 1) without a search block."""
    if document.search is None:
        return 0, 1, 1
    layers = document.search.repeated_layers
    return layers.first_op, layers.ops_per_layer, layers.layers


def _where(index: int, layers: tuple[int, int, int]) -> tuple[int | None, int]:
    """(layer, offset in it) of op `index`; (None, index) outside the layers."""
    first, period, count = layers
    if count > 1 and first <= index < first + period * count:
        return (index - first) // period, (index - first) % period
    return None, index


def _held(value: HeldValue | None) -> str:
    return value.held if value is not None else "None"


def diff_plans(a: PlanDocument, b: PlanDocument) -> dict[str, Any]:
    """The changes from plan `a` to plan `b` as JSON (see the module docstring)."""
    layers = _layers(a) if _layers(a)[2] > 1 else _layers(b)
    order = {name: i for i, name in enumerate(a.ops)}
    order |= {name: len(order) + i for i, name in enumerate(n for n in b.ops if n not in order)}
    changes: list[tuple[int | None, int, dict[str, Any]]] = []
    for name in order:
        old, new = a.ops.get(name), b.ops.get(name)
        was = old.sharding_option if old is not None else None
        now = new.sharding_option if new is not None else None
        if was != now or old is None or new is None:
            layer, offset = _where(order[name], layers)
            either = old or new
            entry: dict[str, Any] = {"kind": "op", "name": name,
                                     "type": either.type if either else None,
                     "a": was, "b": now}  # fmt: skip
            changes.append((layer, offset, entry))
    for name in sorted(a.values.keys() | b.values.keys()):
        held_a, held_b = a.values.get(name), b.values.get(name)
        read_a = held_a.read_as if held_a is not None else None
        read_b = held_b.read_as if held_b is not None else None
        if read_a is None and read_b is None:
            continue  # computed inside the model: its producer's op says it
        was, now = _held(held_a), _held(held_b)
        read_a, read_b = dict(read_a or {}), dict(read_b or {})
        if was == now and read_a == read_b:
            continue
        first = min((order[op] for op in {**read_a, **read_b} if op in order), default=None)
        layer, offset = _where(first, layers) if first is not None else (None, -1)
        entry = {"kind": "held", "name": name, "a": was, "b": now}  # a weight or graph input
        if read_a != read_b:
            entry |= {"read_a": read_a, "read_b": read_b}
        changes.append((layer, offset, entry))
    found: dict[str, Any] = {}
    if a.pipeline is not None or b.pipeline is not None:
        found["pipeline"] = {"a": pipeline_words(a.pipeline), "b": pipeline_words(b.pipeline)}
    return found | {
        "a": {"model": a.model.label, "mesh": str(a.mesh)},
        "b": {"model": b.model.label, "mesh": str(b.mesh)},
        "same_model": a.model.sha256 == b.model.sha256,
        "changed": _grouped(changes),
        "collectives": _collectives(a.collectives, b.collectives),
        "cost": {
            key: {"a": ca, "b": cb, "delta": cb - ca}
            for key, _, _ in COSTS
            for ca, cb in [(_figure(a.cost, key), _figure(b.cost, key))]
            if isinstance(ca, int | float) and isinstance(cb, int | float)
        },
    }


def pipeline_words(block: Mapping[str, Any] | None) -> str:
    """A plan's pipeline in a line: its stages (their layers), schedule, micro-batches, step
    and bubble, then each tied weight (`tied_words`); "none" without one."""
    if block is None:
        return "none"
    layers = " ".join(f"{first}..{stop - 1}" for first, stop in
                      (stage["layers"] for stage in block["stages"]))  # fmt: skip
    return (f"{len(block['stages'])} stages (layers {layers}) on mesh {block['mesh']}, "
            f"{block['schedule']}, {block['micro_batches']} micro-batches, step "
            f"{format_seconds(block['step_time_s'])}, bubble {block['bubble']:.1%}"
            + "".join(f"; {tied_words(t)}" for t in block.get("tied", ())))  # fmt: skip


def tied_words(tied: Mapping[str, Any]) -> str:
    """A weight tied across stages (an entry of the pipeline block's `tied`) in words: the
    stages holding a copy, and a trained one's gradient sum."""
    first, last = tied["stages"]
    sync = tied["sync"]
    summed = (f", its gradients summed ({format_bytes(sync['bytes_per_device'])} per device, "
              f"{format_seconds(sync['time_s'])})" if sync["bytes_per_device"] else "")  # fmt: skip
    return f"tied {tied['weight']} on stages {first} and {last}{summed}"


def _figure(cost: CostFigures | None, key: str) -> object:
    """The cost figure `key` (a field of `CostFigures`); None without a cost block."""
    return getattr(cost, key) if cost is not None else None


def _grouped(changes: list[tuple[int | None, int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Changes by layer; consecutive layers whose changes are alike (same offsets, same
    shardings) are one group, told with the names of its first layer."""
    by_layer: dict[int | None, list[tuple[int, dict[str, Any]]]] = {}
    for layer, offset, entry in changes:
        by_layer.setdefault(layer, []).append((offset, entry))

    def signature(items: list[tuple[int, dict[str, Any]]]) -> tuple:
        def reads(e: Mapping[str, Any]) -> tuple[str, ...]:
            return tuple(str(sorted(e.get(side, {}).values())) for side in ("read_a", "read_b"))

        return tuple((o, e["kind"], e["a"], e["b"], *reads(e)) for o, e in items)

    groups: list[dict[str, Any]] = []
    inside = sorted(k for k in by_layer if k is not None)
    for layer in inside:
        items = by_layer[layer]
        last = groups[-1] if groups and groups[-1]["layers"] else None
        if (last is not None and last["layers"][-1] == layer - 1
                and last["signature"] == signature(items)):  # fmt: skip
            last["layers"].append(layer)
            continue
        groups.append({"layers": [layer], "signature": signature(items),
                       "changes": [e for _, e in items]})  # fmt: skip
    if None in by_layer:
        groups.append({"layers": [], "changes": [e for _, e in by_layer[None]]})
    for group in groups:
        group.pop("signature", None)
        span = group["layers"]
        group["where"] = (
            OUTSIDE if not span
            else f"layer {span[0]}" if len(span) == 1
            else f"layers {span[0]}-{span[-1]} (each alike; names of layer {span[0]})"
        )  # fmt: skip
    return groups


def _collectives(a: Sequence[CollectiveEntry], b: Sequence[CollectiveEntry]) -> dict:
    """Collectives in one plan and not the other, by (value, kind, mesh axes), counted."""

    def key(c: CollectiveEntry) -> tuple:
        return (c.value, c.kind, c.mesh_axes, c.bytes_per_device)

    ca, cb = Counter(map(key, a)), Counter(map(key, b))

    def listed(counter: Counter) -> list[dict[str, Any]]:
        return [{"value": v, "kind": k, "mesh_axes": list(axes), "bytes_per_device": size}
                for (v, k, axes, size), n in sorted(counter.items()) for _ in range(n)]  # fmt: skip

    return {"added": listed(cb - ca), "removed": listed(ca - cb)}


def _amount(value: float, unit: str, signed: bool = False) -> str:
    sign = ("+" if value > 0 else "-" if value < 0 else "") if signed else ""
    magnitude = abs(value) if signed else value
    text = format_bytes(int(magnitude)) if unit == "bytes" else format_seconds(magnitude)
    return sign + text


def diff_text(diff: Mapping[str, Any]) -> str:
    """The diff for a terminal: cost deltas, changes by layer, collectives added/removed."""
    a, b = diff["a"], diff["b"]
    lines = [f"A: {a['model']} on mesh {a['mesh']}", f"B: {b['model']} on mesh {b['mesh']}"]
    if not diff["same_model"]:
        lines.append("note: A and B are plans of different models (sha256)")
    if "pipeline" in diff:
        pipe = diff["pipeline"]
        lines += [f"pipeline A: {pipe['a']}", f"pipeline B: {pipe['b']}"]
    return "\n".join(lines + cost_lines(diff) + change_lines(diff))


def cost_lines(diff: Mapping[str, Any]) -> list[str]:
    """`title: a -> b (delta)` for each cost both plans have."""
    lines = []
    for key, title, unit in COSTS:
        if key in diff["cost"]:
            c = diff["cost"][key]
            delta = _amount(c["delta"], unit, signed=True) if c["delta"] else "same"
            lines.append(f"{title}: {_amount(c['a'], unit)} -> {_amount(c['b'], unit)} ({delta})")
    return lines


def change_lines(diff: Mapping[str, Any], indent: str = "") -> list[str]:
    """The changes by layer, then the collectives added and removed."""
    lines = []
    groups = diff["changed"]
    if not groups:
        lines.append(f"{indent}no op or weight changed its sharding")
    for group in groups:
        counts = Counter(e["kind"] for e in group["changes"])
        lines.append(f"{indent}{group['where']}: " + ", ".join(
            f"{n} {kind}{'s' if n > 1 else ''}" for kind, n in sorted(counts.items())))  # fmt: skip
        for e in group["changes"]:
            lines.append(f"{indent}  {e['kind']} {e['name']}: {e['a']} -> {e['b']}")
    coll = diff["collectives"]
    for verb in ("added", "removed"):
        lines.append(f"{indent}collectives {verb}: {len(coll[verb])}")
        for c in coll[verb]:
            lines.append(f"{indent}  {c['kind']} of {c['value']} over mesh axes {c['mesh_axes']} "
                         f"({format_bytes(int(c['bytes_per_device']))})")  # fmt: skip
    return lines

"""Why a plan shards a value or an op as it does (`autoshard explain PLAN.json --model MODEL
NAME`): its sharding as held and as each reader uses it, who decided it, and what it costs.

Who decided is read from how the search ties its decisions (`search.coarsen.Grouping`): a
decision that follows another (an op of a repeated layer follows its copy in the first layer,
an elementwise op its producer, a gradient op its forward op, a weight of a repeated layer its
first copy) says which and why, up the chain to the decision that leads its group. The leader
was pinned or narrowed by required annotations, chosen by the search among its candidates
(nudged by a hint), or had one choice only (no sharding rule: computed replicated).

    /lm/transformer/h.1/mlp/act/Mul (Mul): [[0, 1]]
      decided by: follower: copy of /lm/transformer/h.0/mlp/act/Mul (repeated layer), which
      computes in the sharding of its producer /lm/transformer/h.0/mlp/c_fc/Gemm, which the
      search chose among 21 candidates

The plan is read as `autoshard partition --plan` reads it (its `ops` and `values`) and lowered
and priced again, on the cluster the plan was priced on (its `cluster` block: read from it when
its device is a preset, else the flags that made it are given again and checked against it).
Its costs are the cost model's: the op's compute, the collectives on its edges (charged to the
op they serve), the bytes it holds.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard.annotations import Annotation, binds, parse_annotations
from autoshard.cost.cluster import Cluster, make_cluster, recorded_flags
from autoshard.cost.liveness import held_bytes, live_kinds, memory, memory_kinds
from autoshard.cost.price import Cost, price
from autoshard.document.plan_document import (
    DocumentError,
    PlanDocument,
    decisions_for,
    read_document,
)
from autoshard.errors import AutoshardError
from autoshard.explain.diff import pipeline_words
from autoshard.holding import words_of
from autoshard.ir.graph import Graph
from autoshard.mesh import Mesh
from autoshard.names import parameter_names
from autoshard.pipeline import Lowered, PlanRequest, lower_document
from autoshard.plan import RETURN
from autoshard.program import Program
from autoshard.rules import rule_for
from autoshard.search.candidates import candidates
from autoshard.search.coarsen import Grouping, Key, Kind, OpDecision, Tie
from autoshard.search.options import Objective
from autoshard.search.problem import decision_groups
from autoshard.training.strategy import held_as
from autoshard.units import format_bytes, format_seconds

TIES = {
    Tie.COPY: "copy of {0} (repeated layer)",
    Tie.ELEMENTWISE: "computes in the sharding of its producer {0}",
    Tie.GRADIENT: "computes with the option of its forward op {0}",
}


class ExplainError(AutoshardError):
    """A name the plan's model does not have, or a plan that cannot be explained."""


@dataclass(frozen=True, kw_only=True)
class Saved:
    """A saved plan read back on its model and cluster: lowered and priced again, with how its
    search grouped the decisions and what the search was asked."""

    path: str
    document: PlanDocument
    lowered: Lowered
    cluster: Cluster
    cost: Cost
    grouping: Grouping
    request: PlanRequest  # what the plan's search was asked: `--why-not` asks it again
    parameters: Mapping[str, str]  # weight -> its source parameter's name

    @property
    def annotations(self) -> Sequence[Annotation]:
        return self.request.annotations

    @property
    def graph(self) -> Graph:
        return self.lowered.graph

    @property
    def program(self) -> Program:
        return self.lowered.program


def load_saved(
    path: str, model: str | Path, cluster_on: Callable[[Mesh], Cluster] | None = None
) -> Saved:
    """Read plan `path` of `model`. `cluster_on` makes the cluster of the user's flags on the
    plan's mesh (they must be the flags the plan was made with: its `cluster` block must be
    what they give); None when no flag is given: the cluster is read from that block."""
    document = read_document(path)
    mesh, dims = document.mesh, dict(document.model.dims)
    decided = decisions_for(document, path, mesh, model, dims)
    asked = document.search.asked if document.search is not None else None
    if asked is None:
        raise DocumentError(
            f"plan {path} does not record what its search was asked (objective, time limit, "
            "annotations): it was not made by `autoshard plan`, or by an older autoshard; "
            "plan it again"
        )
    made = document.cluster.to_json() if document.cluster is not None else {}
    if cluster_on is None:
        # No flags: the plan's own cluster, when its device is a preset (else the check below
        # asks for the flags or file it was made with). A --why-not re-solve gets it too.
        cluster = make_cluster(str(mesh), **(recorded_flags(made) or {}))
    else:
        cluster = cluster_on(mesh)
    _check_cluster(path, made, cluster.to_json())
    annotations = parse_annotations({"annotations": list(asked.annotations)}, f"plan {path}")
    try:
        objective, time_limit = Objective(asked.objective), float(asked.time_limit)
    except (TypeError, ValueError) as error:
        raise DocumentError(f"plan {path} has a malformed search block: {error!r}") from None
    training = decided.training
    request = PlanRequest(
        model_path=model, cluster=cluster, dims=dims, annotations=annotations,
        objective=objective, time_limit=time_limit, training=training,
    )  # fmt: skip
    lowered = lower_document(document, model)
    return Saved(
        path=path, document=document, lowered=lowered, cluster=cluster,
        cost=price(lowered.program, lowered.graph, cluster,
                   overlap=training.overlap if training is not None else None),
        grouping=decision_groups(lowered.graph, cluster, annotations), request=request,
        parameters=parameter_names(model),
    )  # fmt: skip


def _check_cluster(path: str, made: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    for key in sorted(made.keys() | given.keys()):
        if made.get(key) != given.get(key):
            raise ExplainError(
                f"plan {path} was priced with cluster {key} = {made.get(key)}, these flags give "
                f"{given.get(key)}: give the --device, --bandwidth, --latency, --memory and "
                "--cluster the plan was made with"
            )


def resolve(
    graph: Graph, name: str, what: str = "", parameters: Mapping[str, str] | None = None
) -> tuple[str, str]:
    """('value' or 'op', the model's name) for a name of the model (a value first) or a source
    parameter's name (`export.names.parameter_names`: the weight it was exported as); an
    unknown name is one line naming the closest names."""
    by_parameter = {p: w for w, p in (parameters or {}).items()}
    if name not in graph.values and name not in graph.op_by_name:
        name = by_parameter.get(name, name)
    if name in graph.values:
        return "value", name
    if name in graph.op_by_name:
        return "op", name
    known = [*graph.values, *graph.op_by_name, *by_parameter]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = f"; closest: {', '.join(close)}" if close else "; see the plan's values and ops"
    raise ExplainError(f"{what}the model has no value, op or parameter named {name!r}{hint}")


# ---- who decided --------------------------------------------------------------------------------


def _touching(saved: Saved, key: Key) -> list[Annotation]:
    """The annotations on decision `key`: on an op's results (as produced) or operands (as
    read), or on a weight or input itself."""
    if key.kind is Kind.VALUE:
        return [a for a in saved.annotations if a.value == key.name and not a.for_users]
    op = saved.graph.op_by_name[key.name]
    return [
        a for a in saved.annotations
        if (a.value in op.outputs and not a.for_users)
        or (a.value in op.inputs and a.for_users and binds(op))
    ]  # fmt: skip


def decided_by(saved: Saved, name: str, kind: Kind = Kind.OP) -> dict[str, Any]:
    """Who decided op or weight/input `name`: `by` is annotation, search, fixed (one choice)
    or follower (`chain`: whom it follows and why, to the group's `leader`)."""
    grouping, chain = saved.grouping, []
    current = Key(kind, name)
    while current in grouping.ties:
        followed, tie = grouping.ties[current]
        chain.append({"name": current.name, "follows": followed.name, "tie": str(tie)})
        current = followed
    decision = grouping.decision(current)
    count = len(decision.choices)
    required = [a for a in _touching(saved, current) if a.required]
    hints = [a for a in saved.annotations if not a.required and _decides(saved, current, a.value)]
    if required:
        how = "annotation"
        total = _candidate_count(saved, current)
        told = "pinned by" if count == 1 else f"narrowed to {count} of {total} candidates by"
        text = f"{told} {'; '.join(map(str, required))}"
        if count > 1:
            text += ", then chosen by the search"
    elif count == 1:
        how = "fixed"
        text = "its only choice" + (
            " (no sharding rule: computed replicated)"
            if isinstance(decision, OpDecision) and decision.choices == (None,)
            else ""
        )
    else:
        how, text = "search", f"the search chose among {count} candidates"
        if hints:
            text += f", with the hint {'; '.join(map(str, hints))}"
    if chain:
        steps = [TIES[Tie(step["tie"])].format(step["follows"]) for step in chain]
        text = "follower: " + ", which ".join(steps) + f"; {current}: {text}"
    return {
        "by": "follower" if chain else how, "leader": current.name, "leader_by": how,
        "chain": chain, "candidates": count,
        "annotations": [a.to_json() for a in required + hints], "text": text,
    }  # fmt: skip


def _decides(saved: Saved, decision: Key, value: str) -> bool:
    """Whether `decision` says how `value` is held (its producer's, or its own)."""
    producer = saved.graph.producer(value)
    held_by = Key(Kind.OP, producer.name) if producer is not None else Key(Kind.VALUE, value)
    return held_by == decision


def _candidate_count(saved: Saved, key: Key) -> int:
    """An op's candidates before any annotation (a weight's pin leaves it one: 1)."""
    op = saved.graph.op_by_name.get(key.name) if key.kind is Kind.OP else None
    rule = rule_for(op, saved.graph) if op is not None else None
    return len(candidates(rule, saved.cluster.mesh)) if rule is not None else 1


# ---- what it costs ---------------------------------------------------------------------------


def _collectives(saved: Saved, keep: Any) -> list[dict[str, Any]]:
    return [c.to_json() for c in saved.cost.collectives if keep(c)]


def _by_axes(moved: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    found: dict[str, dict[str, float]] = {}
    for c in moved:
        entry = found.setdefault(str(c["mesh_axes"]), {"bytes_per_device": 0, "time_s": 0.0})
        entry["bytes_per_device"] += c["bytes_per_device"]
        entry["time_s"] += c["time_s"]
    return dict(sorted(found.items()))


def _memory(saved: Saved, values: Sequence[str]) -> dict[str, Any]:
    """Bytes per device of `values` as held, and what of them (their buffers too) is live at
    the program's peak."""
    graph, plan, program = saved.graph, saved.lowered.plan, saved.program
    peak = memory(program)
    at_peak = {
        name: size for name, _, size in live_kinds(program, graph, peak)
        if program.tensors[name].value in values
    }  # fmt: skip
    held = sum(
        held_bytes(
            v, graph.values[v].shape, graph.values[v].dtype, plan.values[v], plan.mesh, graph.fused
        )
        for v in values
    )
    return {"bytes_per_device": held, "live_at_peak": dict(sorted(at_peak.items())),
            "peak_bytes_per_device": peak.peak}  # fmt: skip


def explain_value(saved: Saved, name: str) -> dict[str, Any]:
    graph, plan = saved.graph, saved.lowered.plan
    value = graph.values[name]
    rank = len(value.shape)
    producer = graph.producer(name)
    if producer is not None:  # held as its producer writes it
        decided = decided_by(saved, producer.name)
        decided["text"] = f"its producer {producer.name}: {decided['text']}"
    elif name in graph.constants:
        decided = {"by": "fixed", "text": "a constant, computed while planning: replicated"}
    else:
        decided = decided_by(saved, name, Kind.VALUE)
    readers = [
        {"op": op.name, "operand": i, "reads": plan.needs[(op.name, i)].text(rank),
         "resharded": plan.needs[(op.name, i)] != plan.values[name]}
        for op in graph.consumers(name) for i, x in enumerate(op.inputs) if x == name
    ]  # fmt: skip
    readers += [
        {"op": RETURN, "operand": k, "reads": plan.needs[(RETURN, k)].text(rank),
         "resharded": plan.needs[(RETURN, k)] != plan.values[name]}
        for k, out in enumerate(graph.outputs) if out == name
    ]  # fmt: skip
    moved = _collectives(saved, lambda c: c.value == name)
    return {
        "name": name, "kind": "value", "memory_kind": memory_kinds(graph)[name],
        "shape": list(value.shape), "dtype": value.dtype,
        "producer": producer.name if producer is not None else None,
        "held": plan.values[name].text(rank), "produced": plan.produced[name].text(rank),
        "readers": readers, "decided": decided, "collectives": moved,
        "comm_by_mesh_axes": _by_axes(moved), "memory": _memory(saved, [name]),
        "parameter": saved.parameters.get(name),
        "holding": _holding(saved, name), "training": _strategy(saved.document, name),
    }  # fmt: skip


def _holding(saved: Saved, name: str) -> str | None:
    """How a weight is held (`autoshard.holding`'s key): a training plan's strategy, else
    held against read; None for any other value."""
    graph, plan = saved.graph, saved.lowered.plan
    if name not in graph.weights or name in graph.constants:
        return None
    found = _strategy(saved.document, name)
    if found is not None:
        return str(found["strategy"])
    return str(held_as(graph, plan, name))


def _strategy(document: PlanDocument, weight: str) -> dict[str, Any] | None:
    """How a training plan's step treats `weight` (None: not a trained weight)."""
    found = document.strategy.weights.get(weight) if document.strategy is not None else None
    return found.to_json() if found is not None else None


def explain_op(saved: Saved, name: str) -> dict[str, Any]:
    graph, plan = saved.graph, saved.lowered.plan
    op = graph.op_by_name[name]
    option = plan.options[name]
    rule = rule_for(op, graph) if option is not None else None

    def text(value: str, sharding: Any) -> str:
        return str(sharding.text(len(graph.values[value].shape)))

    operands = [
        {"value": x, "held": text(x, plan.values[x]), "reads": text(x, plan.needs[(name, i)])}
        for i, x in enumerate(op.inputs) if x
    ]  # fmt: skip
    results = [
        {"value": y, "writes": text(y, plan.produced[y]), "held": text(y, plan.values[y])}
        for y in op.outputs if y
    ]  # fmt: skip
    served = _collectives(saved, lambda c: c.op == name)
    outgoing = _collectives(saved, lambda c: c.value in op.outputs and c.op != name)
    compute = saved.cost.ops.get(name)
    return {
        "name": name, "kind": "op", "type": op.type, "phase": graph.phase(name),
        "sharding_option": str(option) if option is not None else None,
        "rule": str(rule) if rule is not None else None,
        "operands": operands, "results": results, "decided": decided_by(saved, name),
        "compute": compute.to_json() if compute is not None else None,
        "collectives": {"operands": served, "results": outgoing},
        "comm_by_mesh_axes": _by_axes(served + outgoing),
        "memory": _memory(saved, [y for y in op.outputs if y]),
    }  # fmt: skip


def explain(saved: Saved, name: str) -> dict[str, Any]:
    """The explanation of value or op `name` as JSON (see the module docstring)."""
    kind, name = resolve(saved.graph, name, parameters=saved.parameters)
    found = explain_value(saved, name) if kind == "value" else explain_op(saved, name)
    block = saved.document.pipeline
    if block is not None:  # the plan is each stage's: the name stands for its every copy
        found["pipeline"] = pipeline_words(block)
    return found


# ---- text --------------------------------------------------------------------------------------


def _collective_line(c: Mapping[str, Any]) -> str:
    return (
        f"{c['kind']} of {c['value']} over mesh axes {c['mesh_axes']} for {c['op']}: "
        f"{format_bytes(int(c['bytes_per_device']))}, {format_seconds(c['time_s'])}"
    )


def _memory_lines(held: Mapping[str, Any]) -> list[str]:
    live = ", ".join(f"{n} {format_bytes(b)}" for n, b in held["live_at_peak"].items())
    return [
        f"memory: {format_bytes(held['bytes_per_device'])} per device as held; at the peak "
        f"({format_bytes(held['peak_bytes_per_device'])}): {live or 'not live'}"
    ]


def explain_text(found: Mapping[str, Any]) -> str:
    """The explanation for a terminal."""
    decided = found["decided"]
    if found["kind"] == "value":
        lines = [
            f"value {found['name']} ({'x'.join(map(str, found['shape']))} {found['dtype']}, "
            f"{found['memory_kind']}): held {found['held']}"
            + (f" (produced {found['produced']})" if found["produced"] != found["held"] else ""),
            f"  produced by: {found['producer'] or 'none (a graph input or weight)'}",
            f"  decided by: {decided['text']}",
        ]
        if found["parameter"] not in (None, found["name"]):
            lines.insert(1, f"  source parameter: {found['parameter']}")
        if found["holding"]:  # a weight
            lines.append(f"  held as a weight: {words_of(found['holding'])}")
        if found["training"]:  # a training plan's weight: how its step treats it
            t = found["training"]
            lines.append(f"  training: stored {t['stored']}, used {t['used']}, optimizer state "
                         f"{t['state']}")  # fmt: skip
        for r in found["readers"]:
            how = "resharded" if r["resharded"] else "as held"
            lines.append(f"  read by {r['op']} (operand {r['operand']}): {r['reads']} ({how})")
        moved = found["collectives"]
    else:
        lines = [
            f"op {found['name']} ({found['type']}, {found['phase']}): "
            f"{found['sharding_option'] or 'replicated (no rule)'}",
            f"  decided by: {decided['text']}",
        ]
        if found["rule"]:
            lines.append(f"  rule: {found['rule']}")
        for x in found["operands"]:
            lines.append(f"  reads {x['value']}: {x['reads']} (held {x['held']})")
        for y in found["results"]:
            lines.append(f"  writes {y['value']}: {y['writes']} (held {y['held']})")
        if found["compute"]:
            c = found["compute"]
            lines.append(
                f"  compute: {c['flops']} FLOPs, {format_bytes(c['bytes'])} moved, "
                f"{format_seconds(c['compute_s'])}"
            )
        moved = found["collectives"]["operands"] + found["collectives"]["results"]
    lines.append(f"  collectives: {len(moved) or 'none'}")
    lines += [f"    {_collective_line(c)}" for c in moved]
    for axes, spent in found["comm_by_mesh_axes"].items():
        lines.append(
            f"    mesh axes {axes}: {format_bytes(int(spent['bytes_per_device']))}, "
            f"{format_seconds(spent['time_s'])}"
        )
    lines += [f"  {line}" for line in _memory_lines(found["memory"])]
    if "pipeline" in found:
        lines.append(f"  pipeline: {found['pipeline']}; the plan above is each stage's")
    return "\n".join(lines)

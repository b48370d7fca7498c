"""The strategy of a plan in words: one short paragraph saying what the plan does, in the terms
ML engineers use (data parallel, Megatron tensor parallel, sequence parallel, Ulysses, expert
parallel, FSDP/ZeRO, replicated weights).

Everything is recognised from the plan's shardings and the graph's structure
(`search.patterns`), never from names; the weights are then named by the source model's
parameter names (`export.names`, given by the caller), else by their initializer names:

- *batch split*: the batch (dim 0 of the graph inputs) followed through every op's rule, so
  through the Reshapes to [batch*seq, hidden] and [batch, seq, heads, d], split by an op over
  mesh axes (data parallel);
- *Megatron*: an MLP or attention block (`patterns.mlp_block`, `patterns.attention_blocks`)
  whose first projections produce their output features split over an axis (column) and whose
  last projections read their input features split over the same axis (row);
- *sequence parallel*: a norm or elementwise op outside attention with dim 1 of its 3-D result
  (the sequence of a [batch, seq, hidden] activation) split;
- *Ulysses*: an all_to_all of the program on a value an attention block reads or writes
  (heads <-> sequence);
- *context parallel (all-gather K/V)*: an attention core (a fused region, or an ONNX
  Attention op) with its query rows split, its keys and values read whole: gathered over
  the axes splitting the queries (Llama 3's context parallelism); *ring attention* where the
  core reads its keys or values split with the queries (`rules.base.ring_loops`): their
  blocks passed around those axes; "causal load-balanced" where its causal kernel takes two
  opposite chunks of the rows on each device (`cost.ring.balanced_pairs`);
- *experts split*: an MoE expert table (`patterns.expert_downs`) split on its expert dim;
- weights: in `autoshard.holding`'s words, held split further than read (sharded, gathered
  for use: FSDP/ZeRO-3), read split (tensor parallel), or replicated; a training plan counts
  its `strategy` per weight.

Each decision (an *idea*: what is split, and how) is told once, per repeated layer (the
forward's largest run of `repeats.find_repeats`: "in each of the 12 repeated layers", or "in 3
of 12" where layers differ), with ", also outside the layers" where the rest has it too, and
"Outside the layers" for what only the rest has. The variants of an idea (the same split over
other axes in other layers, as a tight budget's plan makes them) are one phrase, each variant
with where it is found: "elementwise ops split on the sequence (sequence parallel) over axis 1
(20 layers), axes 0, 1 (12 layers and outside)".

Worked example: GPT-2 with `dp_tp` on mesh `dp=2,tp=2` reads

    Batch split over mesh axis dp (data parallel). In each of the 2 repeated layers: Megatron
    column->row split of the MLP over axis tp; Megatron column->row split of the attention
    (fused QKV computed whole) over axis tp. Outside the layers: the embedding table split by
    vocabulary over axis tp. Weights: 19 replicated, 20% of the weight bytes; 10 split (tensor
    parallel), 80% of the weight bytes.

(with the blocks and tables named: "the MLP (lm.transformer.h.*.mlp)", "the embedding table
(lm.transformer.wte.weight)"; a layer's index is `*`.)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autoshard.analysis.attention import find_attention
from autoshard.analysis.patterns import (
    Projection,
    attention_blocks,
    embedding_tables,
    expert_downs,
    find_projections,
    mlp_block,
    weight_source,
)
from autoshard.analysis.repeats import Repeats, Run, find_repeats
from autoshard.holding import counts_text
from autoshard.ir.graph import Graph
from autoshard.mesh import Mesh
from autoshard.plan import Plan
from autoshard.rules import rule_for
from autoshard.rules.base import ring_loops
from autoshard.rules.elementwise import ELEMENTWISE
from autoshard.rules.gradient import RECOMPUTE_OF
from autoshard.sharding import Sharding
from autoshard.training.buffers import buffer_names, buffers_text
from autoshard.training.strategy import held_as, strategy_counts, weight_strategies

NORMS = frozenset(
    {"LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization",
     "SkipLayerNormalization", "SkipSimplifiedLayerNormalization"}
)  # fmt: skip
"""Norm op types (a decomposed norm is elementwise and reduce ops: its elementwise ops count)."""


class Role(enum.StrEnum):
    """What a mesh axis does in a plan, as the story finds it (the mesh drawing's labels)."""

    DATA = "data parallel"
    TENSOR = "tensor parallel"
    SEQUENCE = "sequence parallel"
    ULYSSES = "Ulysses all_to_all"
    CONTEXT = "context parallel"
    VOCABULARY = "vocabulary split"
    EXPERT = "expert parallel"
    FSDP = "FSDP/ZeRO-3"
    ZERO = "ZeRO-1/2"


@dataclass(frozen=True)
class Story:
    """The strategy paragraph and, per mesh axis, the roles it found the axis playing (in
    `Role`'s order; an axis splitting nothing has none)."""

    text: str
    roles: Mapping[int, tuple[Role, ...]]


def axes_text(mesh: Mesh, axes: Iterable[int]) -> str:
    """`axis tp` / `axes 0, 1`: a mesh's axes by their names when it has them."""
    ordered = sorted(set(axes))
    labels = [mesh.axis_names[a] if mesh.axis_names else str(a) for a in ordered]
    return ("axis " if len(labels) == 1 else "axes ") + ", ".join(labels)


def _dim_axes(sharding: Sharding, dim: int, rank: int) -> frozenset[int]:
    """The axes splitting `dim` (negative: from the end of `rank` dims)."""
    split, dim = sharding.split_axes, dim % rank if rank else 0
    return frozenset(split[dim]) if dim < len(split) else frozenset()


def _axes(sharding: Sharding) -> frozenset[int]:
    return frozenset(a for axes in sharding.split_axes for a in axes)


Idea = tuple[str, str]
"""A decision the story names once: what is split (`Megatron column->row split of the MLP
(layers.*.mlp)`) and the name of the technique ("sequence parallel"; "" for none)."""


class _Findings:
    """Each idea found, with the mesh axes of each variant and the layers each variant was
    found in (None: outside the repeated layers)."""

    def __init__(
        self, graph: Graph, mesh: Mesh, names: Mapping[str, str], repeats: Repeats | None
    ) -> None:
        self.mesh, self.graph, self.names = mesh, graph, names
        self.index = {op.name: i for i, op in enumerate(graph.ops)}
        repeats = find_repeats(graph) if repeats is None else repeats
        forward = [r for r in repeats.runs if graph.phase(graph.ops[r.start].name)
                   == "forward" and r.count > 1]  # fmt: skip
        self.run: Run | None = forward[0] if forward else None
        self.found: dict[Idea, dict[frozenset[int], set[int | None]]] = {}
        self.ops: dict[tuple[Idea, frozenset[int]], set[str]] = {}  # each variant's ops
        self.roles: dict[int, set[Role]] = {}

    def layer(self, op: str) -> int | None:
        i, run = self.index[op], self.run
        return run.layer(i) if run is not None else None

    def add(self, idea: Idea, axes: frozenset[int], ops: Iterable[str], role: Role) -> None:
        variants, ops = self.found.setdefault(idea, {}), list(ops)
        variants.setdefault(axes, set()).update(self.layer(op) for op in ops)
        self.ops.setdefault((idea, axes), set()).update(ops)
        self.role(role, axes)

    def role(self, role: Role, axes: Iterable[int]) -> None:
        for axis in axes:
            self.roles.setdefault(axis, set()).add(role)

    def named(self, weights: Iterable[str], ops: Iterable[str], module: bool) -> str:
        """The weights' parameter name (`module`: the module holding them all), a layer's
        index as `*` inside the repeated layers: `lm.transformer.h.*.mlp`; "" if unnamed."""
        paths = []
        for weight in weights:
            source = weight_source(self.graph, weight)
            name = source[0] if source else weight
            paths.append(self.names.get(name, name).split("."))
        if module:
            common = list(paths[0][:-1]) if paths else []
            for path in paths[1:]:
                same = 0
                while same < min(len(common), len(path) - 1) and common[same] == path[same]:
                    same += 1
                common = common[:same]
            paths = [common] if common else []
        if len(paths) != 1:
            return ""
        inside = any(self.layer(op) is not None for op in ops)
        return ".".join("*" if inside and part.isdigit() else part for part in paths[0])

    def phrase(self, idea: Idea) -> tuple[int, str]:
        """An idea in words, once, with the number of repeated layers it was found in. Its
        variants (other axes) are told with their layers, most first: `elementwise ops split
        on the sequence (sequence parallel) over axis 1 (20 layers), axes 0, 1 (12 layers and
        outside)`."""
        (subject, technique), variants = idea, self.found[idea]
        count = self.run.count if self.run is not None else 0
        tag = f" ({technique})" if technique else ""
        inside = len(set().union(*variants.values()) - {None})
        outside = any(None in layers for layers in variants.values())
        if len(variants) == 1:
            (axes,) = variants
            also = ", also outside the layers" if inside and outside else ""
            return inside, f"{subject} over {axes_text(self.mesh, axes)}{tag}{also}"
        told = []

        def most(kv: tuple[frozenset[int], set[int | None]]) -> tuple[int, int, list[int]]:
            return -len(kv[1]), -len(self.ops[(idea, kv[0])]), sorted(kv[0])

        for axes, layers in sorted(variants.items(), key=most):
            n = len(layers - {None})
            many = "every layer" if n == count else f"{n} layer{'s' if n > 1 else ''}"
            where = " and ".join(
                ([many] if n else [])
                + (["outside" if n else "outside the layers"] if None in layers else [])
            )
            if self.run is None:  # no layers: where is told by the ops
                ops = len(self.ops[(idea, axes)])
                where = f"{ops} op{'s' if ops > 1 else ''}"
            told.append(f"{axes_text(self.mesh, axes)} ({where})")
        return inside, f"{subject}{tag} over {', '.join(told)}"

    def sentences(self) -> list[str]:
        """`In each of the N repeated layers: ...`, `In K of the N ...`, then `Outside the
        layers: ...` for what is found outside them alone; each idea told once."""
        count = self.run.count if self.run is not None else 0
        by_layers: dict[int, list[str]] = {}
        rest: list[str] = []
        for idea in self.found:
            inside, text = self.phrase(idea)
            (by_layers.setdefault(inside, []) if inside else rest).append(text)
        out = []
        for inside in sorted(by_layers, reverse=True):
            where = f"each of the {count}" if inside == count else f"{inside} of the {count}"
            out.append(f"In {where} repeated layers: {'; '.join(by_layers[inside])}.")
        if rest:
            lead = "Outside the layers" if by_layers or self.run is not None else "Throughout"
            out.append(f"{lead}: {'; '.join(rest)}.")
        return out


def strategy_story(
    graph: Graph,
    plan: Plan,
    collectives: Sequence[Mapping[str, Any]] = (),
    names: Mapping[str, str] | None = None,
    repeats: Repeats | None = None,
) -> str:
    """The plan's strategy as one paragraph (deterministic: the same plan, the same text).
    `collectives` are the program's (`Program.collectives_json`), for the all_to_alls; `names`
    the source model's parameter name of each weight (`export.names.parameter_names`);
    `repeats` the graph's repeated layers (`find_repeats`), when the caller has them."""
    return recognise(graph, plan, collectives, names, repeats).text


def recognise(
    graph: Graph,
    plan: Plan,
    collectives: Sequence[Mapping[str, Any]] = (),
    names: Mapping[str, str] | None = None,
    repeats: Repeats | None = None,
) -> Story:
    """The plan's strategy paragraph and the role of each mesh axis in it."""
    mesh = plan.mesh
    parts = []
    batch = batch_axes(graph, plan)
    if batch:
        parts.append(f"Batch split over mesh {axes_text(mesh, batch)} (data parallel).")
    findings = _Findings(graph, mesh, names or {}, repeats)
    findings.role(Role.DATA, batch)
    forward = forward_view(graph)
    regions = _megatron(forward, plan, find_projections(forward), findings)
    _sequence_parallel(graph, plan, regions, findings)
    _ulysses(graph, regions, collectives, findings)
    _context_parallel(graph, forward, plan, findings)
    _tables(graph, plan, findings)
    parts += findings.sentences()
    weights = _weights(graph, plan, batch, findings)
    if not parts and not any(_axes(s) for s in plan.values.values()):
        parts.append("Nothing is split: every device computes everything.")
    parts.append(weights)
    parts.append(_attention(graph, forward))
    roles = {a: tuple(r for r in Role if r in found) for a, found in findings.roles.items()}
    return Story(" ".join(p for p in parts if p), dict(sorted(roles.items())))


def _attention(graph: Graph, forward: Graph) -> str:
    """How a training step runs its attention cores: fused (flash) kernels, or op by op."""
    if graph.fused:
        count = len(graph.fused.regions)
        cores = f"{count} core{'s' if count > 1 else ''}"
        return (f"Attention: {cores} planned and priced as fused (flash) kernels, which keep "
                "no SxS scores for the backward, only each row's softmax statistics.")  # fmt: skip
    if not graph.phases:
        return ""
    softmaxes = {region.softmax for region in find_attention(forward).regions}
    if not softmaxes:
        return ""
    cores = f"{len(softmaxes)} core{'s' if len(softmaxes) > 1 else ''}"
    if any(op.attr(RECOMPUTE_OF, "") in softmaxes for op in graph.ops):
        return f"Attention: {cores} priced op by op as exported, recomputed in the backward."
    return (
        f"Attention: {cores} priced op by op as exported, their SxS scores kept for the backward."
    )


def forward_view(graph: Graph) -> Graph:
    """A training step's forward ops alone (its backward reads the activations the patterns
    walk, which would end every MLP region); the graph itself outside training."""
    if not graph.phases:
        return graph
    ops = tuple(op for op in graph.ops if graph.phase(op.name) == "forward")
    produced = {name for op in ops for name in op.outputs}
    outputs = tuple(name for name in graph.outputs if name in produced)
    return replace(graph, ops=ops, outputs=outputs, updates={}, phases={})


def batch_axes(graph: Graph, plan: Plan) -> frozenset[int]:
    """The mesh axes some forward op splits the batch over. The batch is dim 0 of the graph
    inputs (not a training step's optimizer state), followed through the rules: a loop indexing
    a batch dim of an operand carries the batch to the result dims it indexes (a Reshape's loop
    is its block's outermost factor: [B, S, H] -> [B*S, H] or [B, S, heads, d] keep the batch
    on dim 0; a Transpose moves it; a MatMul's batch dims keep it). A training step's forward
    alone: a backward that splits only the loss gradient's batch (a partial output
    reduce-scattered, then gathered again) is no data parallelism."""
    carries = {name: {0} for name in graph.inputs
               if graph.values[name].shape and name not in graph.replaced}  # fmt: skip
    axes: set[int] = set()
    for op in forward_view(graph).ops:
        rule, option = rule_for(op, graph), plan.options.get(op.name)
        if rule is None:
            continue
        loops = {
            loop
            for name, indexing in zip(op.inputs, rule.operands, strict=False)
            if indexing is not None and name in carries
            for dim in carries[name]
            if dim < len(indexing.dims) and (loop := indexing.loop_of(dim)) is not None
        }
        if not loops:
            continue
        if option is not None:
            axes.update(a for loop in loops for a in option.loops[loop])
        for name, indexing in zip(op.outputs, rule.results, strict=False):
            dims = {d for d in range(len(indexing.dims)) if indexing.loop_of(d) in loops}
            if name and dims:
                carries[name] = dims
    return frozenset(axes)


def _aside(*notes: str) -> str:
    """` (a, b)` of the notes given; "" when none is."""
    told = [n for n in notes if n]
    return f" ({', '.join(told)})" if told else ""


def _reads(graph: Graph, plan: Plan, name: str) -> list[Sharding]:
    """How each op reading `name` computes with it."""
    return [plan.needs[(op.name, i)] for op in graph.consumers(name)
            for i, x in enumerate(op.inputs) if x == name]  # fmt: skip


def column_axes(graph: Graph, plan: Plan, p: Projection) -> frozenset[int]:
    """The axes splitting the projection's output features."""
    return _dim_axes(plan.produced[p.output], -1, len(graph.values[p.output].shape))


def row_axes(graph: Graph, plan: Plan, p: Projection) -> frozenset[int]:
    """The axes splitting the features the projection contracts."""
    return _dim_axes(plan.needs[(p.op, 0)], -1, len(graph.values[p.data].shape))


def _megatron(
    graph: Graph, plan: Plan, projections: dict[str, Projection], findings: _Findings
) -> dict[str, frozenset[str]]:
    """Megatron column->row splits of MLPs and attention; the attention regions found, with the
    values they read and write (op name -> block)."""
    seen: set[frozenset[str]] = set()
    for projection in projections.values():
        mlp = mlp_block(graph, projection, projections)
        if mlp is None or frozenset(p.op for p in mlp[0]) in seen:
            continue
        firsts, seconds = mlp
        seen.add(frozenset(p.op for p in firsts))
        axes = frozenset.intersection(
            *(column_axes(graph, plan, p) for p in firsts),
            *(row_axes(graph, plan, p) for p in seconds),
        )
        if axes:
            split = [p.op for p in firsts + seconds]
            where = findings.named([p.weight for p in firsts + seconds], split, module=True)
            idea = (f"Megatron column->row split of the MLP{_aside(where)}", "")
            findings.add(idea, axes, split, Role.TENSOR)
    regions: dict[str, frozenset[str]] = {}
    for block in attention_blocks(graph, projections):
        ops = block.region | block.inputs | block.outputs
        for op in ops:
            regions[op] = ops
        column = [
            column_axes(graph, plan, projections[p]) for p in sorted(block.inputs - block.fused)
        ]
        rows = [row_axes(graph, plan, projections[p]) for p in sorted(block.outputs)]
        axes = frozenset.intersection(*column, *rows) if rows else frozenset()
        if axes:
            split = sorted(block.inputs | block.outputs)
            weights = [projections[p].weight for p in split]
            where = findings.named(weights, split, module=True)
            fused = "fused QKV computed whole" if block.fused else ""
            idea = (f"Megatron column->row split of the attention{_aside(where, fused)}", "")
            findings.add(idea, axes, split, Role.TENSOR)
    return regions


def _sequence_parallel(
    graph: Graph, plan: Plan, regions: Mapping[str, object], findings: _Findings
) -> None:
    """Norms and elementwise ops of [batch, seq, ...] activations with the sequence split
    (attention's own ops hold heads on dim 1: not counted)."""
    by_axes: dict[frozenset[int], list[str]] = {}
    for op in graph.ops:
        if op.type not in NORMS | ELEMENTWISE or op.name in regions or not op.outputs:
            continue
        if graph.phase(op.name) != "forward" or len(graph.values[op.outputs[0]].shape) != 3:
            continue
        axes = _dim_axes(plan.produced[op.outputs[0]], 1, 3)
        if axes:
            by_axes.setdefault(axes, []).append(op.name)
    norms = any(graph.op_by_name[o].type in NORMS for ops in by_axes.values() for o in ops)
    kinds = "norms and elementwise ops" if norms else "elementwise ops"
    for axes, ops in sorted(by_axes.items(), key=lambda kv: sorted(kv[0])):
        findings.add((f"{kinds} split on the sequence", "sequence parallel"), axes, ops,
                     Role.SEQUENCE)  # fmt: skip


def _ulysses(
    graph: Graph,
    regions: Mapping[str, frozenset[str]],
    collectives: Sequence[Mapping[str, Any]],
    findings: _Findings,
) -> None:
    """all_to_alls on values attention reads or writes: heads <-> sequence (Ulysses)."""
    for c in collectives:
        if c.get("kind") != "all_to_all":
            continue
        producer = graph.producer(str(c["value"]))
        user = c.get("user")
        at = [o for o in (producer.name if producer else None, user) if o and o in regions]
        if at:
            idea = ("heads<->sequence all_to_all around the attention", "Ulysses")
            findings.add(idea, frozenset(c["mesh_axes"]), at[:1], Role.ULYSSES)


def _context_parallel(graph: Graph, forward: Graph, plan: Plan, findings: _Findings) -> None:
    """Attention cores whose query rows are split (their keys and values then read whole):
    a region's scores, probabilities and output split on their query dim alike (not moved
    between heads and rows inside the core), an Attention op's query loop."""
    cores = graph.fused.regions or find_attention(forward).regions
    for region in cores:
        scores = graph.op_by_name[region.ops[0]].outputs[0]
        values = (scores, region.probabilities, region.output)
        axes = frozenset.intersection(*(
            _dim_axes(plan.produced[v], -2, len(graph.values[v].shape)) for v in values
        ))  # fmt: skip
        ends = (plan.options.get(region.ops[0]), plan.options.get(region.ops[-1]))
        ring = any(option is not None and ring_loops(option) for option in ends)
        kernel = plan.options.get(region.softmax)
        balanced = kernel is not None and bool(ring_loops(kernel))
        if axes:
            findings.add(_CONTEXT[ring, balanced], axes, [region.softmax], Role.CONTEXT)
    for op in forward.ops:
        option = plan.options.get(op.name)
        if op.type == "Attention" and not op.domain and option is not None:
            axes = frozenset(option.loops[3]) if len(option.loops) == 6 else frozenset()
            ring = bool(ring_loops(option))
            if axes:
                idea = _CONTEXT[ring, ring and bool(op.attr("is_causal", 0))]
                findings.add(idea, axes, [op.name], Role.CONTEXT)


CONTEXT_PARALLEL: Idea = ("context parallel attention", "all-gather K/V")
RING_ATTENTION: Idea = ("ring attention", "K/V blocks passed around the axis")
_CONTEXT: dict[tuple[bool, bool], Idea] = {
    (False, False): CONTEXT_PARALLEL,
    (False, True): ("context parallel attention", "all-gather K/V, causal load-balanced"),
    (True, False): RING_ATTENTION,
    (True, True): ("ring attention", "causal load-balanced"),
}
"""The context-parallel idea by (K/V passed around a ring, the kernel load-balanced)."""


def _tables(graph: Graph, plan: Plan, findings: _Findings) -> None:
    """Embedding tables split by vocabulary; MoE expert tables split by expert."""
    for table in embedding_tables(graph):
        reader = graph.consumers(table)[0].name
        axes = frozenset().union(*(_dim_axes(s, 0, 2) for s in _reads(graph, plan, table)))
        if axes:
            named = _aside(findings.named([table], [reader], False))
            idea = (f"the embedding table{named} split by vocabulary", "")
            findings.add(idea, axes, [reader], Role.VOCABULARY)
    for table, dim in expert_downs(graph):
        reader, reads = graph.consumers(table)[0].name, _reads(graph, plan, table)
        axes = frozenset().union(*(_dim_axes(s, 0, 3) for s in reads))
        if axes:
            named = _aside(findings.named([table], [reader], False))
            findings.add((f"experts{named} split", "expert parallel"), axes, [reader], Role.EXPERT)
        inner = frozenset().union(*(_dim_axes(s, dim, 3) for s in reads))
        if inner:
            idea = ("each expert's FFN split Megatron-style", "")
            findings.add(idea, inner, [reader], Role.TENSOR)


def _weights(graph: Graph, plan: Plan, batch: frozenset[int], findings: _Findings) -> str:
    """How the weights are held (`autoshard.holding`): a training plan's strategies, else
    held vs read, with each kind's share of the weight bytes."""
    if any(graph.phase(op.name) != "forward" for op in graph.ops):
        strategies = weight_strategies(graph, plan, batch)
        for s in strategies.values():
            stored = _axes(Sharding.parse(s["stored"]))
            findings.role(Role.FSDP, stored - _axes(Sharding.parse(s["used"])))
            findings.role(Role.ZERO, _axes(Sharding.parse(s["state"])) - stored)
        told = counts_text(strategy_counts(strategies))
        buffers = buffer_names(graph)
        untrained = f" Not trained: {buffers_text(buffers, findings.names)}." if buffers else ""
        return (f"Weights: {told}." if told else "No trained weights.") + untrained
    kinds: dict[str, list[str]] = {}
    for name in sorted(graph.weights):
        if name in graph.constants:
            continue
        held = _axes(plan.values[name])
        findings.role(Role.FSDP, held - frozenset().union(*map(_axes, _reads(graph, plan, name))))
        kinds.setdefault(held_as(graph, plan, name), []).append(name)
    total = sum(graph.values[n].nbytes for names in kinds.values() for n in names) or 1
    ordered = sorted(kinds.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    shares = {k: sum(graph.values[n].nbytes for n in names) / total for k, names in ordered}
    notes = {
        k: f"{f'{v:.0%}' if v >= 0.01 else '<1%'} of the weight bytes" for k, v in shares.items()
    }
    told = counts_text({k: len(names) for k, names in ordered}, notes)
    return f"Weights: {told}." if told else "No weights."

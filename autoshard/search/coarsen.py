"""Coarsening: tie the search's decisions into groups, so the ILP solves far fewer of them.

Decisions are the ops (which sharding option) and the producer-less values the ops read (graph
inputs and weights: which sharding they are held in). `group_decisions` ties them into *groups*
sharing one one-hot variable vector, each member mapping the group's choice to one of its own:

- ops of repeated layers share the variables of the first layer (`repeats.find_repeats`: a
  training step has several periodic runs, its forward layers, their backward and their
  updates), and a weight of a repeated layer is held as its copy in the first layer is (its
  readers say which weight that is: a gradient reads it as its forward op's copy, an update
  of its optimizer state as the weight's copy), its gradient synchronized and updated as that
  one's; an op or weight a required annotation restricts is decided on its own (annotating
  layer 5 pins layer 5 only);
- a gradient op computes with its forward op's option, a recomputed op with its original's
  (`rules.gradient.computed_with`): they share its variables, coarsened or not;
- how a weight or input is held is a decision of its own, apart from how its readers read it
  (held split further and gathered before use: FSDP, ZeRO-3);
- an elementwise op follows the producer of its first operand when it can compute in the
  sharding that producer gives (the chain runs where its data lies, as in Alpa), unless it may
  add partial values unreduced (`search.partials`): whether to is its own decision.

Repeated layers are found by `repeats.find_repeats`; the k-th op of every layer shares the
decision variables of the k-th op of the first, with its costs added in (the ILP solves one
layer, however deep the model). Sharing only asks that copies have the same candidates (same
rule, same shapes); the costs are still those of each op's own edges, so the signature need not
pin the wiring: a causal mask computed once and read by every layer is fine.

Who decides what is kept (`Grouping.ties`): each decision that follows another says which one
and why (`Tie`), so a plan can be explained (`autoshard explain`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from autoshard.analysis.repeats import NONE, Repeats, find_repeats
from autoshard.ir.graph import Graph, Op
from autoshard.rules import OpRule
from autoshard.rules.elementwise import ELEMENTWISE
from autoshard.rules.gradient import TRAIN, TrainOp, computed_with
from autoshard.search.candidates import option_reads, option_writes
from autoshard.sharding import Sharding, ShardingOption

# ---- decisions and groups ---------------------------------------------------------------------


@dataclass(frozen=True)
class OpDecision:
    """Which candidate option op `name` computes in (an op without a rule has one choice, None:
    it runs unsharded). Grouped, choice k of its `group` is its choice `pick[k]`."""

    name: str
    choices: tuple[ShardingOption | None, ...]
    group: int = -1
    pick: tuple[int, ...] = ()

    @property
    def options(self) -> tuple[ShardingOption, ...]:
        """The choices that are sharding options: all of them for an op with a rule."""
        return tuple(c for c in self.choices if c is not None)

    @property
    def picked(self) -> tuple[ShardingOption | None, ...]:
        """Its choice under each choice of its group."""
        return tuple(self.choices[p] for p in self.pick)

    def chosen(self, choice: Sequence[int]) -> ShardingOption | None:
        """Its choice when each group g makes choice `choice[g]`."""
        return self.choices[self.pick[choice[self.group]]]


@dataclass(frozen=True)
class ValueDecision:
    """Which sharding the producer-less value `name` (a graph input, a weight) is held in;
    grouped as an op is."""

    name: str
    choices: tuple[Sharding, ...]
    group: int = -1
    pick: tuple[int, ...] = ()

    @property
    def picked(self) -> tuple[Sharding, ...]:
        """Its sharding under each choice of its group."""
        return tuple(self.choices[p] for p in self.pick)

    def chosen(self, choice: Sequence[int]) -> Sharding:
        """Its sharding when each group g makes choice `choice[g]`."""
        return self.choices[self.pick[choice[self.group]]]


Decision = OpDecision | ValueDecision
_D = TypeVar("_D", OpDecision, ValueDecision)


class Tie(enum.StrEnum):
    """Why a decision follows another instead of being the search's own."""

    COPY = "copy"  # an op or weight of a repeated layer, decided as its copy in the first
    ELEMENTWISE = "elementwise"  # computes in the sharding the producer of its operand gives
    GRADIENT = "gradient"  # a gradient or recomputed op, computed with its forward op's option


class Kind(enum.StrEnum):
    """What a decision decides: an op's option, or how a producer-less value is held. ONNX
    names ops and values in two namespaces, so a decision is known by both (`Key`)."""

    OP = "op"
    VALUE = "value"


@dataclass(frozen=True)
class Key:
    """A decision: op `name` or value `name`."""

    kind: Kind
    name: str

    def __str__(self) -> str:
        return self.name


Reader = tuple[Op, int]
"""An op reading a value, and the operand it reads it as."""


@dataclass(frozen=True)
class Grouping:
    """The decisions of a graph tied into groups: those of the ops (in graph order) and of the
    producer-less values they read (in value order), the decision leading each group (in group
    order; its choices are the group's), and each op's copy in the first repeated layer (itself
    outside the repeats)."""

    repeats: Repeats
    ops: Mapping[str, OpDecision]
    values: Mapping[str, ValueDecision]
    groups: tuple[Decision, ...]
    copies: Mapping[str, str]
    representatives: Mapping[str, tuple]  # of the values with a key of their own (not "value")
    ties: Mapping[Key, tuple[Key, Tie]] = dataclasses.field(default_factory=dict)
    """The decision each follower follows directly, and why (a leader has no entry)."""

    def decision(self, key: Key) -> Decision:
        return self.ops[key.name] if key.kind is Kind.OP else self.values[key.name]

    def representative(self, value: str) -> tuple:
        """The same key for a value and its copies in the other repeated layers: the copy in
        the first layer of its producer (for a producer-less value: the copies of its readers,
        so a weight read by a layer's forward, backward and update is tied across layers)."""
        key = self.representatives.get(value)
        return key if key is not None else ("value", value)


def group_decisions(
    graph: Graph,
    rules: Mapping[str, OpRule | None],
    op_choices: Callable[[Op], tuple[ShardingOption | None, ...]],
    source_choices: Callable[[str, Sequence[Reader]], tuple[Sharding, ...]],
    annotated: Collection[str],
    coarsen: bool = True,
    pinned: Collection[str] = (),
) -> Grouping:
    """The decisions of `graph`, with the choices `op_choices` and `source_choices` give them,
    tied into groups (see the module docstring); `annotated` values and `pinned` ops (those
    required annotations restrict) are never decided as another's copy, nor another's as theirs.
    Without `coarsen`, every decision is a group of its own."""
    return _Grouper(graph, rules, coarsen, pinned).group(op_choices, source_choices, annotated)


Leader = tuple[str, tuple[int, ...]]
"""The decision a decision follows (itself when it leads its group), and the choice it makes
under each of the leader's group choices."""


class _Grouper:
    def __init__(
        self,
        graph: Graph,
        rules: Mapping[str, OpRule | None],
        coarsen: bool,
        pinned: Collection[str] = (),
    ) -> None:
        self.graph, self.rules, self.coarsen = graph, rules, coarsen
        self.pinned = _with_their_gradients(graph, pinned)
        self.repeats = find_repeats(graph) if coarsen else NONE
        ops = graph.ops
        # A pinned op is its own; the other copies of its layer position follow the first
        # copy that is not pinned (its choices are not narrowed by the pin).
        first_free: dict[int, str] = {}
        self.copies = {}
        for i, op in enumerate(ops):
            if op.name in self.pinned:
                self.copies[op.name] = op.name
            else:
                self.copies[op.name] = first_free.setdefault(self.repeats.first(i), op.name)
            # An op computed with another is a copy only where that one is a copy of the
            # first's (the backward's run of layers may pair ops the forward's does not).
            mine, first = computed_with(op), computed_with(graph.op_by_name[self.copies[op.name]])
            if mine and first and self.copies[mine] != self.copies[first]:
                self.copies[op.name] = op.name
        # The producer-less values decided, and who reads them.
        self.readers: dict[str, list[Reader]] = {}
        for op in ops:
            for i, name in enumerate(op.inputs):
                if name and graph.producer(name) is None and name not in graph.constants:
                    self.readers.setdefault(name, []).append((op, i))
        # A value's key, shared with its copies in the other layers (see `Grouping`).
        keys: dict[str, tuple] = {}
        for op in ops:
            for name in op.outputs:
                if name and graph.producer(name) is op:
                    keys[name] = ("op", self.copies[op.name], op.outputs.index(name))
        for name, readers in self.readers.items():  # a weight before its optimizer state
            keys[name] = ("source", tuple(self.reading(op, i, keys) for op, i in readers))
        self.representatives = keys
        self.ops: dict[str, OpDecision] = {}
        self.values: dict[str, ValueDecision] = {}
        # Who each decision follows; ops and values apart, as an op may be named like a value
        # (ONNX names nodes and values in two namespaces).
        self.leader: dict[str, Leader] = {}
        self.value_leader: dict[str, Leader] = {}
        self.ties: dict[Key, tuple[Key, Tie]] = {}

    def reading(self, op: Op, i: int, keys: Mapping[str, tuple]) -> tuple:
        """How `op` reads a producer-less value as operand i, alike for its copies in the
        other layers: a gradient or recomputation as one of its forward op's copy (whether or
        not the backward's layers were found: a weight shared by every layer, as the dynamo
        exporter writes equal initializers, adds its gradients up in the first layer's only),
        an optimizer's update of a weight's state as one of the weight's copy."""
        forward = computed_with(op)
        if forward:
            return (self.copies[forward], op.type, op.attr("operand", -1), i)
        if op.domain == TRAIN and op.type == TrainOp.UPDATE:
            return ("update", keys.get(op.inputs[1]) if i != 1 else "", i)
        return (self.copies[op.name], i)

    def group(
        self,
        op_choices: Callable[[Op], tuple[ShardingOption | None, ...]],
        source_choices: Callable[[str, Sequence[Reader]], tuple[Sharding, ...]],
        annotated: Collection[str],
    ) -> Grouping:
        graph, copies = self.graph, self.copies
        position = {name: i for i, name in enumerate(graph.values)}
        sources = sorted(self.readers, key=position.__getitem__)
        # A weight of a repeated layer is decided as its first copy is (unless annotated).
        by_key: dict[tuple, str] = {}
        first_copy: dict[str, str] = {}
        for name in sources:
            key = self.representatives.get(name, ("value", name))
            alike = key[0] == "source" and name not in annotated
            first_copy[name] = by_key.setdefault(key, name) if alike else name
            if name in annotated:  # held as annotated, unlike its copies: a key of its own
                self.representatives.pop(name, None)
            if first_copy[name] != name:
                self.ties[Key(Kind.VALUE, name)] = (Key(Kind.VALUE, first_copy[name]), Tie.COPY)
            if first_copy[name] == name:
                shardings = source_choices(name, self.readers[name])
            else:
                shardings = self.values[first_copy[name]].choices
            self.values[name] = ValueDecision(name, shardings)
        if self.coarsen:
            self.copy_weight_steps(first_copy)
        for op in graph.ops:
            first = copies[op.name]
            forward = computed_with(op)
            if forward:  # a gradient computes with its forward op's option
                choices = self.ops[forward].choices
            else:
                choices = self.ops[first].choices if first != op.name else op_choices(op)
            self.ops[op.name] = OpDecision(op.name, choices)
        # Leaders: who each decision follows (a follower's producer comes before it); a value
        # leads its own group, shared by its copies.
        leader = self.leader
        for op in graph.ops:
            leader[op.name] = self.follow(op)
        value_leader = self.value_leader
        for name in sources:
            own = (name, tuple(range(len(self.values[name].choices))))
            value_leader[name] = value_leader[first_copy[name]] if first_copy[name] != name else own
        groups: list[Decision] = []
        index_of: dict[tuple[bool, str], int] = {}

        def grouped(decision: _D, leaders: Mapping[str, Leader]) -> _D:
            head, pick = leaders[decision.name]
            key = (isinstance(decision, OpDecision), head)
            if head == decision.name:
                index_of[key] = len(groups)
                groups.append(decision)
            return dataclasses.replace(decision, group=index_of[key], pick=pick)

        ops = {name: grouped(d, leader) for name, d in self.ops.items()}
        values = {name: grouped(d, value_leader) for name, d in self.values.items()}
        return Grouping(
            self.repeats, ops, values, tuple(groups), copies, self.representatives, self.ties
        )

    def copy_weight_steps(self, first_copy: Mapping[str, str]) -> None:
        """Weights held alike (`first_copy`) have their gradients synchronized and their
        updates computed alike: each such step copies the first of them in graph order, unless
        it is a copy already (found in the optimizer's layers) or pinned. The backward's
        layers need not be found: a weight shared by every layer (the dynamo exporter merges
        equal initializers) adds its gradients up in one layer only, and they are not."""
        graph, copies = self.graph, self.copies
        index = {op.name: i for i, op in enumerate(graph.ops)}
        alike: dict[str, list[list[Op]]] = {}  # a leading weight -> its updates, its syncs
        for op in graph.ops:
            if op.domain == TRAIN and op.type == TrainOp.UPDATE:
                steps = alike.setdefault(first_copy.get(op.inputs[1], op.inputs[1]), [[], []])
                steps[0].append(op)
                sync = graph.producer(op.inputs[0])
                if sync is not None and sync.type == TrainOp.GRAD_SYNC:
                    steps[1].append(sync)
        for updates, syncs in alike.values():
            for ops in (updates, syncs) if len(syncs) == len(updates) else (updates,):
                first, *others = sorted(ops, key=lambda op: index[op.name])
                for op in others:
                    if copies[op.name] == op.name and op.name not in self.pinned:
                        copies[op.name] = copies[first.name]

    def follow(self, op: Op) -> Leader:
        """An elementwise op follows the producer of its first operand when, under each choice
        of the producer's group, it can compute in the sharding the producer gives (partial
        sums reduced first); a copy in a repeated layer follows what its first copy follows."""
        me = self.ops[op.name]
        identity = (op.name, tuple(range(len(me.choices))))
        forward = computed_with(op)
        if forward:
            self.ties[Key(Kind.OP, op.name)] = (Key(Kind.OP, forward), Tie.GRADIENT)
            return self.leader[forward]
        if not self.coarsen:
            return identity
        if self.copies[op.name] != op.name:
            self.ties[Key(Kind.OP, op.name)] = (Key(Kind.OP, self.copies[op.name]), Tie.COPY)
            return self.leader[self.copies[op.name]]
        source = self.graph.producer(op.inputs[0]) if op.inputs else None
        rule, source_rule = self.rules[op.name], self.rules[source.name] if source else None
        values = self.graph.values
        if (
            op.type not in ELEMENTWISE
            or any(c.partial_axes for c in me.options)  # its own choice: add partials or not
            or source is None
            or rule is None
            or source_rule is None
            or values[op.inputs[0]].shape != values[op.outputs[0]].shape
        ):
            return identity
        head, head_pick = self.leader[source.name]
        position = {option_reads(rule, c, 0): k for k, c in enumerate(me.options)}
        out = source.outputs.index(op.inputs[0])
        source_options = self.ops[source.name].options
        pick = []
        for k in head_pick:
            produced = option_writes(source_rule, source_options[k], out)
            k_me = position.get(Sharding(produced.split_axes))
            if k_me is None:
                return identity
            pick.append(k_me)
        self.ties[Key(Kind.OP, op.name)] = (Key(Kind.OP, source.name), Tie.ELEMENTWISE)
        return head, tuple(pick)


def _with_their_gradients(graph: Graph, pinned: Collection[str]) -> frozenset[str]:
    """The pinned ops and those computed with one (`computed_with`: a pinned op's gradient or
    recomputed copy decides with the pinned op, so it is no copy of another layer's either).
    In graph order, a forward op comes before the ops computed with it."""
    found = set(pinned)
    for op in graph.ops:
        if computed_with(op) in found:
            found.add(op.name)
    return frozenset(found)

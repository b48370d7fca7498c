"""Coarsening: tie the search's decisions into groups, so the ILP solves far fewer of them.

Decisions are the ops (which sharding option) and the producer-less values the ops read (graph
inputs and weights: which sharding they are held in). `group_decisions` ties them into *groups*
sharing one one-hot variable vector, each member mapping the group's choice to one of its own:

- ops of repeated layers share the variables of the first layer (`find_repeats`: a training
  step has several periodic runs, its forward layers, their backward and their updates), and a
  weight of a repeated layer is held as its copy in the first layer is; an op or weight a
  required annotation restricts is decided on its own (annotating layer 5 pins layer 5 only);
- a gradient op computes with its forward op's option, a recomputed op with its original's
  (`rules.gradient.computed_with`): they share its variables, coarsened or not;
- how a weight or input is held is a decision of its own, apart from how its readers read it
  (held split further and gathered before use: FSDP, ZeRO-3);
- an elementwise op follows the producer of its first operand when it can compute in the
  sharding that producer gives (the chain runs where its data lies, as in Alpa).

Repeated layers. Each op gets a structural signature: its type, attributes, the shapes and
dtypes of its inputs and outputs, and for each input where it comes from (a weight, a constant
of some value, a graph input, or an op). Ops of identical layers have identical signatures at
the same offsets, so the layers are a periodic run of the signature sequence:

    signatures   E E | a b c d | a b c d | a b c d | h     period 4, three repeats from op 2

`find_repeats` returns the run covering the most ops (period x repeats, the period a whole
block); the k-th op of every repeat then shares the decision variables of the k-th op of the
first, with its costs added in (the ILP solves one layer, however deep the model).

Sharing only asks that copies have the same candidates (same rule, same shapes); the costs are
still those of each op's own edges, so the signature need not pin the wiring: a causal mask
computed once and read by every layer is fine.

Who decides what is kept (`Grouping.ties`): each decision that follows another says which one
and why (`Tie`), so a plan can be explained (`autoshard explain`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from autoshard.ir import dtypes
from autoshard.ir.fold import FOLD_LIMIT
from autoshard.ir.graph import Attrs, Graph, Op
from autoshard.plan import ShardingOption
from autoshard.rules import OpRule
from autoshard.rules.elementwise import ELEMENTWISE
from autoshard.rules.gradient import RECOMPUTE_OF, computed_with
from autoshard.search.candidates import option_reads, option_writes
from autoshard.sharding import Sharding


@dataclass(frozen=True)
class Run:
    """Repeated layers: op `layers[j][k]` (an index in graph order) is a copy of op
    `layers[0][k]`. A layer lists the ops computing on data in graph order, then those computed
    from parameters alone that every layer has (`find_repeats`); the layers follow one another,
    and an op between a layer's first and last op may be in none (computed from parameters
    alone and not in every layer: T5's position bias, which its first block computes for
    all)."""

    layers: tuple[tuple[int, ...], ...]

    @property
    def start(self) -> int:
        return self.layers[0][0]

    @property
    def period(self) -> int:
        """The ops of each layer."""
        return len(self.layers[0])

    @property
    def count(self) -> int:
        return len(self.layers)

    @property
    def ops(self) -> int:
        return self.period * self.count

    def span(self, j: int) -> range:
        """The ops from layer `j`'s first to its last, in graph order."""
        return range(min(self.layers[j]), max(self.layers[j]) + 1)

    @functools.cached_property
    def _where(self) -> dict[int, tuple[int, int]]:
        return {i: (j, k) for j, layer in enumerate(self.layers) for k, i in enumerate(layer)}

    def layer(self, index: int) -> int | None:
        """The layer op `index` is in (None: in no layer)."""
        where = self._where.get(index)
        return where[0] if where is not None else None

    def first(self, index: int) -> int | None:
        """The op of the first layer that op `index` copies (None: in no layer)."""
        where = self._where.get(index)
        return self.layers[0][where[1]] if where is not None else None

    def __contains__(self, index: int) -> bool:
        return index in self._where


@dataclass(frozen=True)
class Repeats:
    """The periodic runs of a graph's ops, largest first (a training step has three: the
    forward layers, their backward, their updates). `start`, `period` and `count` describe
    the largest."""

    runs: tuple[Run, ...] = ()

    def first(self, index: int) -> int:
        """The op of the first repeat that op `index` copies (itself outside the runs)."""
        for run in self.runs:
            first = run.first(index)
            if first is not None:
                return first
        return index

    @property
    def start(self) -> int:
        return self.runs[0].start if self.runs else 0

    @property
    def period(self) -> int:
        return self.runs[0].period if self.runs else 1

    @property
    def count(self) -> int:
        return self.runs[0].count if self.runs else 1

    @property
    def ops(self) -> int:
        return sum(run.ops for run in self.runs)


NONE = Repeats()


def signatures(graph: Graph) -> list[int]:
    """Each op's structural signature (see the module docstring). A gradient op is known by
    its forward op's signature, not its name."""
    produced = {out for op in graph.ops for out in op.outputs if out}
    table: dict[tuple, int] = {}
    result = []
    of_op: dict[str, int] = {}
    for op in graph.ops:
        forward = computed_with(op)
        attrs = (
            Attrs({k: v for k, v in op.attrs.items() if k not in ("op", RECOMPUTE_OF)})
            if forward
            else op.attrs
        )
        key = (
            op.type,
            op.domain,
            hash(attrs),
            of_op.get(forward, -1) if forward else -1,
            tuple(_origin(graph, name, produced) for name in op.inputs),
            tuple(_type(graph, name) for name in op.outputs),
        )
        of_op[op.name] = table.setdefault(key, len(table))
        result.append(of_op[op.name])
    return result


def _type(graph: Graph, name: str) -> tuple:
    if not name:
        return ()
    value = graph.values[name]
    return (value.shape, value.dtype)


def _origin(graph: Graph, name: str, produced: set[str]) -> tuple:
    if not name:
        return ("absent",)
    if name in produced:
        return ("op", _type(graph, name))
    array = _content(graph, name)
    if array is not None:
        array = np.ascontiguousarray(array)
        return ("constant", array.dtype.str, array.shape, hashlib.sha1(array.tobytes()).digest())
    kind = "weight" if name in graph.weights else "input"
    return (kind, _type(graph, name))


def _content(graph: Graph, name: str) -> np.ndarray | None:
    """A constant's value; or a small initializer's of no floating type, which no training
    changes (a Reshape target, an axes list): one exporter writes it as an initializer, another
    (or another layer) as a Constant node, and by value they are alike."""
    if name in graph.constants:
        return graph.constants[name]
    weight = graph.weights.get(name)
    if weight is None or not weight.has_data or weight.dtype in dtypes.FLOAT_DTYPES:
        return None
    return weight.load() if weight.size <= FOLD_LIMIT else None


def find_repeats(graph: Graph, min_period: int = 2) -> Repeats:
    """The repeated layers: the periodic runs of the signatures of the ops that compute on the
    model's data (`_free` says which do not), the run covering the most ops first (ties: the
    shortest period, then the earliest start), then the same in what is left before and after
    it. The ops computed from parameters alone then join their layers (`_joined`)."""
    sigs = signatures(graph)
    free = _free(graph)
    bound = [i for i in range(len(graph.ops)) if i not in free]
    seq = np.array([sigs[i] for i in bound], dtype=np.int64)
    found: list[list[list[int]]] = []
    segments = [(0, len(seq))]
    while segments:
        lo, hi = segments.pop()
        best = _best_run(seq[lo:hi], min_period)
        if best is not None:
            start, period, count = lo + best[0], best[1], best[2]
            found.append([bound[start + j * period : start + (j + 1) * period]
                          for j in range(count)])  # fmt: skip
            segments += [(lo, start), (start + period * count, hi)]
    runs = _joined(graph, sigs, free, found)
    return Repeats(tuple(sorted(runs, key=lambda r: (-r.ops, r.start))))


def _free(graph: Graph) -> set[int]:
    """The ops computed from parameters alone (the indices): those reading no data input (a
    graph input the forward reads, not an optimizer's state) nor any result of an op that does,
    and the gradients and recomputations of such ops. An exporter places them where the
    model computes them, inside a layer (a weight's Cast, T5's position bias in its first
    block only), so they do not take part in finding the layers."""
    forward = {name for op in graph.ops if graph.phase(op.name) == "forward" for name in op.inputs}
    computed = set(forward & set(graph.inputs))
    free: set[int] = set()
    free_ops: set[str] = set()
    for i, op in enumerate(graph.ops):
        of = computed_with(op)
        if of in free_ops if of else not any(name in computed for name in op.inputs):
            free.add(i)
            free_ops.add(op.name)
        else:
            computed.update(op.outputs)
    return free


def _joined(
    graph: Graph, sigs: Sequence[int], free: Collection[int], found: list[list[list[int]]]
) -> list[Run]:
    """The runs `found` (each a list of layers of op indices), with the free ops that every
    layer of a run has. A free op sits next to the first op reading its results, or if no op
    of a layer reads them, the last op it reads (a weight's Cast next to its MatMul, the
    weight's gradient sync next to the gradient); it joins that op's layer when every layer
    has a free op of its signature at the same place. T5's position bias, computed in the
    first block only, joins none; nor does anything that would make layers overlap."""
    where = {i: (r, j, k) for r, layers in enumerate(found) for j, layer in enumerate(layers)
             for k, i in enumerate(layer)}  # fmt: skip
    index = {op.name: i for i, op in enumerate(graph.ops)}
    place: dict[int, tuple[int, int, int]] = {}

    def placed(i: int) -> tuple[int, int, int] | None:
        return place.get(i) if i in free else where.get(i)

    for i in sorted(free, reverse=True):  # a free op's readers come after it
        readers = sorted(index[c.name] for out in graph.ops[i].outputs if out
                         for c in graph.consumers(out))  # fmt: skip
        if readers and (at := placed(readers[0])) is not None:
            place[i] = at
    for i in sorted(set(free) - place.keys()):
        producers = sorted(index[p.name] for n in graph.ops[i].inputs if (p := graph.producer(n)))
        near = [at for at in map(placed, producers) if at is not None]
        if near:
            place[i] = near[-1]
    # Each layer's free ops by place: (next to member k, signature, how many such before).
    keyed: dict[tuple[int, int], dict[tuple[int, int, int], int]] = {}
    for i in sorted(place):
        r, j, k = place[i]
        mine = keyed.setdefault((r, j), {})
        same = sum(1 for key in mine if key[:2] == (k, sigs[i]))
        mine[(k, sigs[i], same)] = i
    runs = []
    for r, layers in enumerate(found):
        each = [keyed.get((r, j), {}) for j in range(len(layers))]
        common = sorted(set(each[0]).intersection(*each[1:]))
        joined = [(*layer, *(mine[key] for key in common))
                  for layer, mine in zip(layers, each, strict=True)]  # fmt: skip
        apart = all(max(a) < min(b) for a, b in itertools.pairwise(joined))
        runs.append(Run(tuple(joined) if apart else tuple(map(tuple, layers))))
    return runs


def _best_run(seq: np.ndarray, min_period: int) -> tuple[int, int, int] | None:
    """(start, period, count) of the periodic run of `seq` covering the most entries."""
    n = len(seq)
    best, covered = None, 0
    for period in range(min_period, n // 2 + 1):
        same = seq[:-period] == seq[period:]
        # Runs of `same`: a run of length r starting at s makes ops s .. s+r+period-1 periodic.
        edges = np.flatnonzero(np.diff(np.concatenate(([0], same.astype(np.int8), [0]))))
        for s, e in zip(edges[::2], edges[1::2], strict=True):
            count = (e - s + period) // period
            if count >= 2 and count * period > covered:
                best, covered = (int(s), period, int(count)), count * period
    return best


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
        self.repeats = find_repeats(graph) if coarsen else NONE
        ops = graph.ops
        # A pinned op is its own; the other copies of its layer position follow the first
        # copy that is not pinned (its choices are not narrowed by the pin).
        first_free: dict[int, str] = {}
        self.copies = {}
        for i, op in enumerate(ops):
            if op.name in pinned:
                self.copies[op.name] = op.name
            else:
                self.copies[op.name] = first_free.setdefault(self.repeats.first(i), op.name)
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
        for name, readers in self.readers.items():
            keys[name] = ("source", tuple((self.copies[op.name], i) for op, i in readers))
        self.representatives = keys
        self.ops: dict[str, OpDecision] = {}
        self.values: dict[str, ValueDecision] = {}
        # Who each decision follows; ops and values apart, as an op may be named like a value
        # (ONNX names nodes and values in two namespaces).
        self.leader: dict[str, Leader] = {}
        self.value_leader: dict[str, Leader] = {}
        self.ties: dict[Key, tuple[Key, Tie]] = {}

    def group(
        self,
        op_choices: Callable[[Op], tuple[ShardingOption | None, ...]],
        source_choices: Callable[[str, Sequence[Reader]], tuple[Sharding, ...]],
        annotated: Collection[str],
    ) -> Grouping:
        graph, copies = self.graph, self.copies
        for op in graph.ops:
            first = copies[op.name]
            forward = computed_with(op)
            if forward:  # a gradient computes with its forward op's option
                choices = self.ops[forward].choices
            else:
                choices = self.ops[first].choices if first != op.name else op_choices(op)
            self.ops[op.name] = OpDecision(op.name, choices)
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

"""The search problem: decisions, their candidates, and integer costs, ready for the ILP.

Decisions are the ops (which sharding option) and the producer-less values the ops read (graph
inputs and weights: which sharding they are held in). Their candidates are built here (the
required annotations remove some); `coarsen.group_decisions` ties them into *groups* sharing
one one-hot variable vector (repeated layers, elementwise ops following their producer).
A weight's or input's candidates include shardings split further than any reader reads it:
held so, it is gathered before each use.

Costs, all per device:
- node: the compute time of each member op under the group's choice (`cost.compute`), plus the
  reshards between members of the same group (a constant per choice);
- edge: for a value produced in one group and read in another, the time (or bytes) of
  `plan_reshard` from the sharding produced to the sharding read, as a matrix over the two
  groups' choices (all priced at once from the planner's tables, `ReshardPrices`); copies of
  an edge in repeated layers add up.
- memory: at each step of the program, the bytes live there (`search.memory`: held shards,
  activations, reshard buffers), linear in the choices and in indicator variables; identical
  rows are kept once.

Of plans costing the same, the one resharding least wins: each reshard adds one unit to the
scaled costs. Costs are scaled once to integers for CP-SAT: the largest becomes `SCALE`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from autoshard.annotations import Annotation, binds, bound_readers, unread
from autoshard.collectives import Collective
from autoshard.cost.cluster import Cluster
from autoshard.cost.compute import compute_time
from autoshard.cost.price import collective_time
from autoshard.deadline import NEVER, Deadline
from autoshard.errors import AutoshardError
from autoshard.ir import dtypes
from autoshard.ir.graph import FORWARD, Graph, Op
from autoshard.mesh import Mesh
from autoshard.passes.materialize import reshards_again
from autoshard.plan import Plan, plan_from_options, returned
from autoshard.reshard import ReshardPrices
from autoshard.rules import OpRule, rule_for
from autoshard.search.candidates import candidates, option_reads, option_writes
from autoshard.search.coarsen import (
    Decision,
    Grouping,
    OpDecision,
    Reader,
    Repeats,
    group_decisions,
)
from autoshard.search.memory.build import Chain, memory_model
from autoshard.search.memory.rows import (
    ZERO_ROW,
    Chosen,
    Indicator,
    IndicatorTable,
    Literal,
    MemoryModel,
    MemoryRows,
)
from autoshard.search.memory.slots import Read
from autoshard.search.memory.tensors import Held
from autoshard.search.options import Objective
from autoshard.search.partials import Partials, bar, readable_matrix, unreadable
from autoshard.search.prices import Prices
from autoshard.search.reads import Reading, ValueReads, price_reads
from autoshard.search.traffic import Traffic
from autoshard.sharding import Sharding, ShardingOption

SCALE = 10**9
"""The largest cost coefficient after scaling: fine enough to separate plans, small enough to
keep CP-SAT's arithmetic exact."""


@functools.lru_cache(maxsize=1024)
def _candidates(rule: OpRule, mesh: Mesh) -> tuple[ShardingOption, ...]:
    return candidates(rule, mesh)


def _split_further(sharding: Sharding, shape: tuple[int, ...], mesh: Mesh) -> list[Sharding]:
    """Storage that splits a value further than a reader reads it (then gathers it before the
    read): the mesh axes `sharding` leaves unused, all of them (FSDP, ZeRO-3) or each alone,
    added to one dim they divide exactly."""
    used = {a for axes in sharding.split_axes for a in axes}
    unused = tuple(a for a in range(mesh.ndim) if a not in used)
    found = []
    for extra in dict.fromkeys([unused, *((a,) for a in unused)]):
        for dim, size in enumerate(shape):
            axes = (*sharding.axes_of(dim), *extra)
            if extra and size % mesh.group_size(axes) == 0:
                split = [sharding.axes_of(d) for d in range(len(shape))]
                split[dim] = axes
                found.append(Sharding(tuple(split)))
    return found


class SearchError(AutoshardError):
    """The annotations leave no candidate, or the problem cannot be built."""


@dataclass(frozen=True)
class Problem:
    """Groups with `sizes[g]` candidates; `node_costs[g][k]`; `edges` (a, b, matrix[ka][kb]);
    `memory` rows (`search.memory`: bytes live at a program step, over the choices and the
    `indicators`), each row <= `budget`."""

    sizes: tuple[int, ...]
    node_costs: tuple[tuple[int, ...], ...]
    edges: tuple[tuple[int, int, tuple[tuple[int, ...], ...]], ...]
    memory: MemoryRows
    budget: int
    unit: float  # seconds (or bytes) per integer cost unit
    indicators: tuple[Indicator, ...] = ()
    memory_base: MemoryRows = ZERO_ROW  # one row: live at every step, added to each row

    @property
    def variables(self) -> int:
        return sum(self.sizes)

    def objective(self, choice: Sequence[int]) -> int:
        """The integer objective of one choice per group (what the ILP minimizes)."""
        total = sum(costs[k] for costs, k in zip(self.node_costs, choice, strict=True))
        return total + sum(m[choice[a]][choice[b]] for a, b, m in self.edges)

    def live(self, choice: Sequence[int]) -> np.ndarray:
        """The bytes of each memory row under this choice, the base row's added."""
        base, rows = self._bytes(choice)
        return rows + base

    def peak(self, choice: Sequence[int]) -> int:
        """The most bytes live at one step of the program of this choice."""
        base, rows = self._bytes(choice)
        return base + (int(rows.max()) if len(rows) else 0)

    def _bytes(self, choice: Sequence[int]) -> tuple[int, np.ndarray]:
        """The base row's bytes under this choice, and each other row's."""
        indicated = self.indicator_table.values(choice)
        base = int(self.memory_base.bytes(choice, indicated)[0])
        return base, self.memory.bytes(choice, indicated)

    @functools.cached_property
    def indicator_table(self) -> IndicatorTable:
        return IndicatorTable(self.indicators)

    def most(self) -> np.ndarray:
        """An upper bound of each row's bytes under any choice, the base row's added
        (`MemoryRows.most`)."""
        return self.memory.most() + int(self.memory_base.most()[0])

    def restricted(self, kept: Sequence[Sequence[int]]) -> Problem:
        """The problem over the choices `kept[g]` of each group g (ascending, none empty),
        numbered anew from 0: what the memory-bound solve hands CP-SAT once the relaxation
        rules the others out (`solver.marginals.still_possible`). A plan of it is the plan
        `kept[g][k]` per group of this one, at the same objective and peak."""
        renumber = [[-1] * n for n in self.sizes]  # each choice's new number, -1 if left out
        for g, choices in enumerate(kept):
            for i, k in enumerate(choices):
                renumber[g][k] = i

        @functools.cache
        def literal(lit: Literal) -> Literal:
            if isinstance(lit, int):
                return lit
            new = renumber[lit.group]
            return Chosen(lit.group, frozenset(new[k] for k in lit.choices if new[k] >= 0))

        return Problem(
            sizes=tuple(len(choices) for choices in kept),
            node_costs=tuple(tuple(costs[k] for k in choices)
                             for costs, choices in zip(self.node_costs, kept, strict=True)),
            edges=tuple((a, b, tuple(tuple(matrix[i][j] for j in kept[b]) for i in kept[a]))
                        for a, b, matrix in self.edges),
            memory=self.memory.restricted(renumber),
            budget=self.budget,
            unit=self.unit,
            indicators=tuple(Indicator(ind.every, tuple(literal(lit) for lit in ind.literals))
                             for ind in self.indicators),
            memory_base=self.memory_base.restricted(renumber),
        )  # fmt: skip


@dataclass(frozen=True)
class Priced:
    """The search's costs before scaling (seconds, or bytes): per group and choice, and per
    edge, with the edges' `forbidden` cells (a shared reshard's pairs no plan takes)."""

    node: tuple[np.ndarray, ...] = ()
    edges: Mapping[tuple[int, int], np.ndarray] = field(default_factory=dict)
    forbidden: Mapping[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def objective(self, choice: Sequence[int]) -> float:
        """What a choice per group costs, unscaled: the program's cost of its plan."""
        total = sum(float(costs[k]) for costs, k in zip(self.node, choice, strict=True))
        return total + sum(float(m[choice[a], choice[b]]) for (a, b), m in self.edges.items())


def _forbidding(node_costs: Sequence[Sequence[int]], edges: Iterable[np.ndarray]) -> int:
    """An integer cost above any plan's: what a forbidden cell costs."""
    most = sum(max(row, default=0) for row in node_costs)
    return 1 + most + sum(int(m.max()) for m in edges if m.size)


@dataclass(frozen=True)
class Search:
    """A problem and how to read its solution (a choice per group) back as a plan."""

    problem: Problem
    grouping: Grouping
    memory_with: Callable[[frozenset[Chain]], MemoryModel] = field(compare=False, repr=False)
    chains: frozenset[Chain] = frozenset()  # reshards whose intermediates the rows count
    returns: Mapping[str, Sharding] = field(default_factory=dict)  # outputs returned so
    priced: Priced = field(default_factory=Priced, compare=False, repr=False)
    prices: Prices | None = field(default=None, compare=False, repr=False)

    def counting(self, chains: frozenset[Chain]) -> Search:
        """The same search, its memory rows counting the intermediates of `chains` too."""
        memory = self.memory_with(chains)
        problem = dataclasses.replace(
            self.problem, memory=memory.rows, indicators=memory.indicators,
            memory_base=memory.base,
        )  # fmt: skip
        return dataclasses.replace(self, problem=problem, chains=chains)

    @property
    def repeats(self) -> Repeats:
        return self.grouping.repeats

    def program_cost(self, choice: Sequence[int]) -> tuple[float, float, frozenset[Chain]]:
        """The compute and the communication seconds of one choice per group's program, as
        `cost.price` prices it once materialized (`prices`), and the reshards of several
        collectives it makes."""
        if self.prices is None:
            raise ValueError("this search keeps no prices")
        return self.prices.of(choice)

    def plan(self, graph: Graph, cluster: Cluster, choice: Sequence[int]) -> Plan:
        options = {name: d.chosen(choice) for name, d in self.grouping.ops.items()}
        held = {name: d.chosen(choice) for name, d in self.grouping.values.items()}
        return plan_from_options(graph, cluster.mesh, options, held, self.returns)


# ---- building -----------------------------------------------------------------------------------


class _Builder:
    def __init__(
        self,
        graph: Graph,
        cluster: Cluster,
        annotations: Sequence[Annotation],
        objective: Objective,
        coarsen: bool,
        deadline: Deadline = NEVER,
    ) -> None:
        self.graph, self.cluster, self.mesh = graph, cluster, cluster.mesh
        self.objective, self.deadline = objective, deadline
        self.rules: dict[str, OpRule | None] = {op.name: rule_for(op, graph) for op in graph.ops}
        self.required = [a for a in annotations if a.required]
        self.hints = [a for a in annotations if not a.required]
        # Graph outputs returned as a required annotation for users asks (the return reads them).
        self.returns = {
            a.value: a.sharding for a in self.required if a.for_users and a.value in graph.outputs
        }
        self.check_unruled_readers()
        self.producer = {o: op for op in graph.ops for o in op.outputs if o}
        self.matrices: dict[tuple, np.ndarray] = {}
        self.prices = ReshardPrices(self.mesh, self.price)
        self.held_cache: dict[tuple, tuple[Sharding, ...]] = {}
        self.need_cache: dict[tuple[str, int], tuple[Sharding, ...]] = {}
        self.compute_cache: dict[str, list[float]] = {}
        self.partial = Partials.of(graph, self.rules)
        annotated = {a.value for a in self.required}
        self.grouping = group_decisions(
            graph, self.rules, self.op_choices, self.source_choices, annotated, coarsen,
            self.pinned(annotated),
        )  # fmt: skip

    # -- candidates, restricted by required annotations --

    def pinned(self, annotated: set[str]) -> set[str]:
        """The ops whose candidates the required annotations restrict."""
        return {
            op.name
            for op in self.graph.ops
            if annotated & {*op.inputs, *op.outputs}
            and (rule := self.rules[op.name]) is not None
            and not all(self.allowed(op, rule, c) for c in _candidates(rule, self.mesh))
        }

    def check_unruled_readers(self) -> None:
        """An op without a rule reads its operands whole: it cannot read a value split as a
        required annotation for users asks."""
        for a in self.required:
            if not a.for_users or a.sharding == Sharding():
                continue
            for op in bound_readers(self.graph, a.value):
                if self.rules[op.name] is None:
                    raise SearchError(unread(op.name, op.type, a.value, a.sharding, "no rule"))

    def returned(self, name: str, held: Sharding) -> Sharding:
        """How graph output `name`, held so, is returned."""
        return self.returns.get(name, returned(held))

    def op_choices(self, op: Op) -> tuple[ShardingOption | None, ...]:
        rule = self.rules[op.name]
        return (None,) if rule is None else self.options(op, rule)

    def options(self, op: Op, rule: OpRule) -> tuple[ShardingOption, ...]:
        kept = (c for c in _candidates(rule, self.mesh) if self.partial.may_take(op, rule, c))
        found = [c for c in kept if self.allowed(op, rule, c)]
        if not found:
            raise SearchError(
                f"the required annotations leave op '{op.name}' ({op.type}) no sharding option"
            )
        return tuple(found)

    def allowed(self, op: Op, rule: OpRule, option: ShardingOption) -> bool:
        for a in self.required:
            if a.for_users:
                if not binds(op):
                    continue
                for i, name in enumerate(op.inputs):
                    if name == a.value and option_reads(rule, option, i) != a.sharding:
                        return False
            else:
                for j, name in enumerate(op.outputs):
                    if name == a.value and option_writes(rule, option, j) != a.sharding:
                        return False
        return True

    def source_choices(self, name: str, readers: Iterable[Reader]) -> tuple[Sharding, ...]:
        fixed = [a.sharding for a in self.required if a.value == name and not a.for_users]
        if fixed:
            return (fixed[0],)
        found: dict[Sharding, None] = {Sharding(): None}
        for op, i in readers:
            rule = self.rules[op.name]
            if rule is None:
                continue
            for option in self.options(op, rule):
                found[option_reads(rule, option, i)] = None
        shape = self.graph.values[name].shape
        for read in list(found):
            found |= dict.fromkeys(_split_further(read, shape, self.mesh))
        return tuple(found)

    # -- costs --

    def price(self, collective: Collective) -> float:
        if self.objective is Objective.BYTES:
            return float(collective.bytes_per_device)
        return collective_time(collective, self.cluster)

    def reshard_cost(self, value: str, src: Sharding, dst: Sharding) -> float:
        return float(self.matrix(value, (src,), (dst,))[0, 0])

    def matrix(
        self, value: str, held: tuple[Sharding, ...], need: tuple[Sharding, ...]
    ) -> np.ndarray:
        """Reshard costs from each held to each needed sharding; repeated layers ask for the
        same matrix again."""
        info = self.graph.values[value]
        key = (info.shape, info.dtype, held, need)
        if key not in self.matrices:
            size = dtypes.nbytes(info.dtype, 1)
            self.matrices[key] = readable_matrix(self.prices, held, need, info.shape, size)
        return self.matrices[key]

    def compute_cost(self, op: Op, option: ShardingOption | None) -> float:
        if self.objective is Objective.BYTES:
            return 0.0
        rule = self.rules[op.name]
        return compute_time(op, rule, option, self.graph, self.cluster)

    def held(self, name: str, decision: Decision) -> tuple[Sharding, ...]:
        """How `name` is held under each choice of its deciding group; copies of a value in
        repeated layers share the answer."""
        key = self.grouping.representative(name)
        if key not in self.held_cache:
            if isinstance(decision, OpDecision):
                op = self.producer[name]
                rule, out = self.rules[op.name], op.outputs.index(name)
                self.held_cache[key] = tuple(
                    option_writes(rule, c, out) if rule and c is not None else Sharding()
                    for c in decision.picked
                )
            else:
                self.held_cache[key] = decision.picked
        return self.held_cache[key]

    def needs(self, op: Op, i: int, decision: OpDecision) -> tuple[Sharding, ...]:
        """The sharding `op` reads operand i in, under each choice of its group."""
        key = (self.grouping.copies[op.name], i)
        if key not in self.need_cache:
            rule = self.rules[op.name]
            self.need_cache[key] = tuple(
                option_reads(rule, c, i)
                if rule is not None and c is not None and i < len(rule.operands)
                else Sharding()
                for c in decision.picked
            )
        return self.need_cache[key]

    def computes(self, op: Op, decision: OpDecision) -> list[float]:
        key = self.grouping.copies[op.name]
        if key not in self.compute_cache:
            self.compute_cache[key] = [self.compute_cost(op, c) for c in decision.picked]
        return self.compute_cache[key]

    def build(self) -> Search:
        grouping = self.grouping
        sizes = [len(leader.choices) for leader in grouping.groups]
        compute = [np.zeros(n) for n in sizes]
        priced = price_reads(self.reads(compute), sizes, self.matrix, self.deadline)
        for g, seconds in enumerate(compute):
            priced.node[g] += seconds
        barred = unreadable(priced)
        unit = self.unit(priced.node, priced.edges)
        node_costs = [
            (np.rint(c / unit).astype(np.int64) + moves).tolist()
            for c, moves in zip(priced.node, priced.node_moves, strict=True)
        ]
        self.add_hints(node_costs)
        edges = {
            # np.rint rounds half to even, as round does.
            (a, b): np.rint(m / unit).astype(np.int64) + priced.edge_moves[(a, b)]
            for (a, b), m in sorted(priced.edges.items())
        }
        forbid = _forbidding(node_costs, edges.values())
        for (a, b), cells in priced.forbidden.items():
            edges[(a, b)][cells] = forbid
        bar(node_costs, barred, forbid)
        memory = self.memory_model(priced.sizes, frozenset())
        problem = Problem(
            tuple(priced.sizes),
            tuple(tuple(r) for r in node_costs),
            tuple((a, b, tuple(map(tuple, m.tolist()))) for (a, b), m in edges.items()),
            memory.rows,
            self.cluster.memory,
            unit,
            memory.indicators,
            memory.base,
        )
        priced_costs = Priced(
            tuple(priced.node), {k: m for k, m in priced.edges.items()}, priced.forbidden
        )
        traffic = Traffic(self.graph, self.cluster, *self.value_reads)
        return Search(
            problem, grouping, functools.partial(self.memory_model, priced.sizes),
            returns=self.returns, priced=priced_costs,
            prices=Prices(tuple(np.array(row) for row in compute), traffic),
        )  # fmt: skip

    def reads(self, compute: list[np.ndarray]) -> list[tuple[ValueReads, int]]:
        """Adds each op's compute to `compute`; returns each value's reads in each stretch of
        the program where its reshards are kept (a training step's backward reshards a weight,
        input or recomputed layer's input again: `reshards_again`), with the copies of
        repeated layers each read stands for."""
        graph, again = self.graph, reshards_again(self.graph)
        found: dict[tuple[str, int], list[Reading]] = {}
        stretch = 0
        for position, op in enumerate(graph.ops):
            self.deadline.check(
                "building the problem", f"{position} of {len(graph.ops)} ops priced"
            )
            if position and graph.phase(op.name) != FORWARD == graph.phase(
                graph.ops[position - 1].name
            ):
                stretch += 1
            d, runs = self.grouping.ops[op.name], graph.runs(op.name)
            compute[d.group] += runs * np.asarray(self.computes(op, d))
            for i, name in enumerate(op.inputs):
                if name and name not in graph.constants:
                    key = (self.grouping.copies[op.name], i)
                    read = Reading(d.group, self.needs(op, i, d), runs, key)
                    found.setdefault((name, stretch if name in again else 0), []).append(read)
        runs = graph.runs(graph.ops[-1].name) if graph.ops else 1
        for name in graph.outputs:
            returned = self.returning(name, runs)
            if returned is not None:
                at = stretch if name in again else 0
                found.setdefault((name, at), []).append(returned)
        counted: Counter[tuple] = Counter()
        first: dict[tuple, ValueReads] = {}
        for (name, at), value_reads in found.items():
            src = self.deciding(name)
            signature = tuple((r.group, r.key, r.runs) for r in value_reads)
            same = (src.group, self.grouping.representative(name), at, signature)
            counted[same] += 1
            held = self.held(name, src)
            first.setdefault(same, ValueReads(name, src.group, held, tuple(value_reads)))
        return [(first[same], count) for same, count in counted.items()]

    def returning(self, name: str, runs: int) -> Reading | None:
        """The read of graph output `name` by the return (None: a value no decision holds): a
        next weight or optimizer state goes back where the old one is held (a ZeRO-1 update
        gathers the updated shards), any other as `returned`."""
        if name in self.graph.updates:
            old = self.graph.updates[name]
            reader = self.deciding(old)
            return Reading(reader.group, self.held(old, reader), runs, ("update", name))
        if name not in self.producer:
            return None
        d = self.grouping.ops[self.producer[name].name]
        key = ("return", self.grouping.representative(name))
        if key not in self.held_cache:
            self.held_cache[key] = tuple(self.returned(name, h) for h in self.held(name, d))
        return Reading(d.group, self.held_cache[key], runs, key)

    def add_hints(self, node_costs: list[list[int]]) -> None:
        """A small penalty on every choice that holds a hinted value otherwise (a tie-breaker,
        not a constraint)."""
        penalty = max(1, SCALE // 1000)
        for hint in self.hints:
            value = hint.value
            if value not in self.producer and value not in self.grouping.values:
                continue  # a constant, or a value no op reads: nothing decides it
            hinted = self.deciding(value)
            for k, held_k in enumerate(self.held(value, hinted)):
                if held_k != hint.sharding:
                    node_costs[hinted.group][k] += penalty

    def deciding(self, name: str) -> Decision:
        """The decision that says how `name` is held: its producer's, or its own."""
        op = self.producer.get(name)
        return self.grouping.ops[op.name] if op is not None else self.grouping.values[name]

    @staticmethod
    def unit(node: Sequence[np.ndarray], edges: Mapping[tuple[int, int], np.ndarray]) -> float:
        biggest = max(
            [float(row.max()) for row in node if row.size]
            + [float(m.max()) for m in edges.values() if m.size],
            default=0.0,
        )
        return biggest / SCALE if biggest > 0 else 1.0

    def memory_model(self, sizes: Sequence[int], chains: frozenset[Chain]) -> MemoryModel:
        """The bytes live at each step of the program, as `search.memory` models them."""
        held, reads = self.value_reads
        return memory_model(graph=self.graph, mesh=self.mesh, sizes=sizes, held=held.__getitem__,
                            reads=reads.__getitem__, chains=chains,
                            deadline=self.deadline)  # fmt: skip

    @functools.cached_property
    def value_reads(self) -> tuple[dict[str, Held], dict[str, list[Read]]]:
        """How each value is held and read under the choices (what the memory rows and the
        program's communication, `traffic`, are built from)."""
        graph, grouping = self.graph, self.grouping
        replicated: Held = (None, (Sharding(),))
        held: dict[str, Held] = {}
        reads: dict[str, list[Read]] = {name: [] for name in graph.values}
        for p, op in enumerate(graph.ops):
            d = grouping.ops[op.name]
            for i, name in enumerate(op.inputs):
                if name:
                    reads[name].append((p, i, d.group, self.needs(op, i, d)))
        for name in graph.values:
            if name in self.producer or name in grouping.values:
                decision = self.deciding(name)
                held[name] = (decision.group, self.held(name, decision))
            else:  # constants, and inputs no op reads: replicated
                held[name] = replicated
        end = len(graph.ops)
        for i, name in enumerate(graph.outputs):
            if name in graph.updates:
                reads[name].append((end, i, *held[graph.updates[name]]))
            else:
                group, shardings = held[name]
                returns = tuple(self.returned(name, s) for s in shardings)
                reads[name].append((end, i, group, returns))
        return held, reads


def decision_groups(
    graph: Graph, cluster: Cluster, annotations: Sequence[Annotation] = ()
) -> Grouping:
    """How `build_search` ties the decisions into groups, and who follows whom, without
    pricing anything: what a plan's explanation needs of its search."""
    return _Builder(graph, cluster, annotations, Objective.TIME, coarsen=True).grouping


def build_search(
    graph: Graph,
    cluster: Cluster,
    annotations: Sequence[Annotation] = (),
    objective: Objective = Objective.TIME,
    coarsen: bool = True,
    deadline: Deadline = NEVER,
) -> Search:
    """The search problem of a graph on a cluster; `TimeUp` (naming how far it got) where
    `deadline` passes first."""
    return _Builder(graph, cluster, annotations, objective, coarsen, deadline).build()

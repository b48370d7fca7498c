"""The plan: a sharding for every value and a sharding option for every op.

Propagation completes one from annotations; search picks one by cost; materialization turns one
into a sharded program. `RETURN` is the pseudo-op reading the graph outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from autoshard.ir.graph import Graph
from autoshard.mesh import Mesh
from autoshard.rules import OpRule, rule_for
from autoshard.sharding import Sharding, ShardingOption

RETURN = "<return>"
"""The pseudo-op that uses the graph outputs; its operand i is output i."""


@dataclass(frozen=True)
class Plan:
    """The completed shardings. `values[v]` is how v is held; `produced[v]` how its producer
    computes it (they differ where a required result annotation needs a reshard right after
    the producer); `needs[(op, i)]` the sharding op computes its operand i with (the `RETURN`
    pseudo-op's operands are the graph outputs)."""

    mesh: Mesh
    options: Mapping[str, ShardingOption | None]
    values: Mapping[str, Sharding]
    produced: Mapping[str, Sharding]
    needs: Mapping[tuple[str, int], Sharding]
    unruled: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        """A mesh axis of one device splits and reduces nothing: it is dropped from every
        sharding and option, so that no collective (of zero bytes) is made over it."""
        trivial = frozenset(a for a, size in enumerate(self.mesh.shape) if size == 1)
        if not trivial:
            return

        def drop(axes: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(a for a in axes if a not in trivial)

        def canonical(sharding: Sharding) -> Sharding:
            if sharding.halo_sizes or sharding.sharded_dims_offsets:
                return sharding  # their counts follow the split dims: kept as given
            return Sharding(
                tuple(drop(axes) for axes in sharding.split_axes),
                drop(sharding.partial_axes),
                sharding.partial_type,
            )

        options = {
            op: None
            if option is None
            else ShardingOption(
                tuple(map(drop, option.loops)), drop(option.partial_axes), option.partial_type
            )
            for op, option in self.options.items()
        }
        object.__setattr__(self, "options", options)
        for name in ("values", "produced", "needs"):
            table: Mapping[object, Sharding] = getattr(self, name)
            object.__setattr__(self, name, {k: canonical(v) for k, v in table.items()})


def plan_from_options(
    graph: Graph,
    mesh: Mesh,
    options: Mapping[str, ShardingOption | None],
    held: Mapping[str, Sharding],
    returns: Mapping[str, Sharding] | None = None,
) -> Plan:
    """The plan of an option per op (a saved plan's, the search's): values held as produced;
    producer-less values as `held`, replicated by default; constants replicated; graph outputs
    as `returns` says (a required annotation for users), else `returned`."""
    rules = {op.name: rule_for(op, graph) for op in graph.ops}
    produced, needs, unruled = computed_shardings(graph, options, rules)
    values = dict(produced)
    for name in graph.values:
        values.setdefault(name, held.get(name, Sharding()))
    returns = returns or {}
    for i, name in enumerate(graph.outputs):
        needs[(RETURN, i)] = returns[name] if name in returns else returned_as(graph, values, name)
    return Plan(mesh, options, values, dict(values), needs, unruled)


def returned_as(graph: Graph, values: Mapping[str, Sharding], output: str) -> Sharding:
    """How graph output `output` is returned: a training step's next weight or optimizer
    state where the old is held, any other `returned`."""
    old = graph.updates.get(output)
    return values[old] if old is not None else returned(values[output])


def returned(sharding: Sharding) -> Sharding:
    """How a graph output held in `sharding` is returned: complete (a partial result reduced,
    its split kept)."""
    return Sharding(sharding.split_axes)


def computed_shardings(
    graph: Graph,
    options: Mapping[str, ShardingOption | None],
    rules: Mapping[str, OpRule | None],
) -> tuple[dict[str, Sharding], dict[tuple[str, int], Sharding], tuple[str, ...]]:
    """How each op computes with its option (replicated without a rule or an option): its
    results as produced, its operands as needed; and the ops without a rule."""
    produced: dict[str, Sharding] = {}
    needs: dict[tuple[str, int], Sharding] = {}
    unruled = []
    for op in graph.ops:
        rule, option = rules[op.name], options.get(op.name)
        if rule is None or option is None:
            unruled += [op.name] if rule is None else []
            produced |= {name: Sharding() for name in op.outputs if name}
            needs |= {(op.name, i): Sharding() for i, name in enumerate(op.inputs) if name}
            continue
        produced |= {
            name: rule.result_sharding(option, j) for j, name in enumerate(op.outputs) if name
        }
        needs |= {
            (op.name, i): rule.operand_sharding(option, i) if i < len(rule.operands) else Sharding()
            for i, name in enumerate(op.inputs)
            if name
        }
    return produced, needs, tuple(unruled)

"""What a training plan does with each weight, by the keys of `autoshard.holding`:

- `ddp`: held whole on every device, its gradient all-reduced (data parallel); `replicated`
  where no gradient is synchronized (no batch split: every device computes the same one);
- `zero`: held as it is used, its optimizer state (and synchronized gradient) split further:
  the update runs on a shard and the updated weight is gathered back (ZeRO-1/2);
- `fsdp`: held split further than any op reads it, gathered before each use and its
  gradient reduce-scattered (FSDP, ZeRO-3);
- `tp`: used split (tensor parallel: Megatron's column and row splits, a vocabulary split),
  held and updated as used; `tp+zero` and `tp+fsdp` combine the two.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from autoshard.holding import Holding, holding
from autoshard.ir.graph import Graph
from autoshard.plan import Plan
from autoshard.rules.gradient import TRAIN, TrainOp
from autoshard.sharding import Sharding


def _axes(sharding: Sharding) -> frozenset[int]:
    return frozenset(a for axes in sharding.split_axes for a in axes)


def weight_strategies(
    graph: Graph, plan: Plan, batch: Iterable[int] = ()
) -> dict[str, dict[str, str]]:
    """Per trained weight: how it is held (`stored`), how its forward reads it (`used`), how
    its optimizer state is split (`state`, over the weight's dims) and the `strategy`. A
    replicated weight's gradient is synchronized (`ddp`) where it reaches its GradSync partial,
    or where the plan splits the `batch` over some mesh axes (`document.story.batch_axes`):
    the plan may then sum it over the batch before the weight's own gradient (GPT-2's position
    embedding, added to every example, has its [1, seq, hidden] gradient all-reduced)."""
    data = bool(frozenset(batch))
    found: dict[str, dict[str, str]] = {}
    for op in graph.ops:
        if op.domain != TRAIN or op.type != TrainOp.UPDATE:
            continue
        weight, state = op.inputs[1], op.inputs[2]
        rank = len(graph.values[weight].shape)
        stored = plan.values[weight]
        used = [
            plan.needs[(reader.name, i)]
            for reader in graph.consumers(weight)
            if graph.phase(reader.name) == "forward"
            for i, name in enumerate(reader.inputs)
            if name == weight
        ]
        state_split = Sharding(plan.values[state].split_axes[1:])
        read = frozenset().union(*map(_axes, used)) if used else frozenset()
        sync = graph.producer(op.inputs[0])  # the GradSync of the gradient it sums
        synced = data or (sync is not None and bool(plan.values[sync.inputs[0]].partial_axes))
        kind = holding(_axes(stored), read, _axes(state_split), synced)
        found[weight] = {
            "stored": stored.text(rank),
            "used": used[0].text(rank) if used else stored.text(rank),
            "state": state_split.text(rank),
            "strategy": str(kind),
        }
    return found


def held_as(graph: Graph, plan: Plan, weight: str) -> Holding:
    """How a weight is held by a plan's forward (`autoshard.holding`): its held sharding against
    how its forward readers read it (a training plan adds its state and gradient sync:
    `weight_strategies`)."""
    reads = [
        plan.needs[(op.name, i)]
        for op in graph.consumers(weight)
        if graph.phase(op.name) == "forward"
        for i, x in enumerate(op.inputs)
        if x == weight
    ]
    read = frozenset().union(*map(_axes, reads)) if reads else frozenset()
    return holding(_axes(plan.values[weight]), read)


def strategy_counts(strategies: Mapping[str, Mapping[str, str]]) -> dict[str, int]:
    """How many weights follow each strategy, most first."""
    counts = Counter(s["strategy"] for s in strategies.values())
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

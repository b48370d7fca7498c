"""What a training plan does with each weight, in the words users know:

- `ddp`: held whole on every device, its gradient all-reduced (data parallel);
- `zero`: held as it is used, its optimizer state (and synchronized gradient) split further:
  the update runs on a shard and the updated weight is gathered back (ZeRO-1/2);
- `fsdp`: held split further than any op reads it, gathered before each use and its
  gradient reduce-scattered (FSDP, ZeRO-3);
- `tp`: used split (tensor parallel: Megatron's column and row splits, a vocabulary split),
  held and updated as used; `tp+zero` and `tp+fsdp` combine the two.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from autoshard.ir.graph import Graph
from autoshard.plan import Plan
from autoshard.rules.gradient import TRAIN, TrainOp
from autoshard.sharding import Sharding


def _axes(sharding: Sharding) -> frozenset[int]:
    return frozenset(a for axes in sharding.split_axes for a in axes)


def weight_strategies(graph: Graph, plan: Plan) -> dict[str, dict[str, str]]:
    """Per trained weight: how it is held (`stored`), how its forward reads it (`used`), how
    its optimizer state is split (`state`, over the weight's dims) and the `strategy`."""
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
        held, read = _axes(stored), frozenset().union(*map(_axes, used)) if used else frozenset()
        split_state = _axes(state_split) - held
        kind = ("tp" if read else "") + ("+fsdp" if held - read else "+zero" if split_state else "")
        found[weight] = {
            "stored": stored.text(rank),
            "used": used[0].text(rank) if used else stored.text(rank),
            "state": state_split.text(rank),
            "strategy": kind.strip("+") or "ddp",
        }
    return found


def strategy_counts(strategies: Mapping[str, Mapping[str, str]]) -> dict[str, int]:
    """How many weights follow each strategy, most first."""
    counts = Counter(s["strategy"] for s in strategies.values())
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

"""Resharding: the collectives that turn a tensor of one sharding into another (`planner`),
found on the graph of exact one-collective steps (`basis`)."""

from autoshard.reshard.planner import ReshardPrices, plan_reshard, reachable

__all__ = ["ReshardPrices", "plan_reshard", "reachable"]

"""The registry: op type -> rule function, filled by the `register` decorator of each family
module (einsum, elementwise, reduce, shape, nn), imported here once."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from autoshard.ir.graph import Graph, Op
from autoshard.rules.base import OpRule

Rule = Callable[[Op, Graph], OpRule | None]
_RULES: dict[str, Rule] = {}
_FAMILIES = ("einsum", "elementwise", "reduce", "shape", "nn")
_loaded = False


def register(*op_types: str) -> Callable[[Rule], Rule]:
    """Register a rule for ONNX op types of the default domain."""

    def add(rule: Rule) -> Rule:
        for op_type in op_types:
            if op_type in _RULES:
                raise ValueError(f"two rules for {op_type}")
            _RULES[op_type] = rule
        return rule

    return add


def _load() -> None:
    # A flag, not "is the table empty": importing one family first must not hide the others.
    global _loaded
    if not _loaded:
        for family in _FAMILIES:
            importlib.import_module(f"autoshard.rules.{family}")
        _loaded = True


def rule_for(op: Op, graph: Graph) -> OpRule | None:
    """The op's rule, or None when no rule covers it (it is then computed replicated)."""
    _load()
    if op.domain not in ("", "ai.onnx"):
        return None
    rule = _RULES.get(op.type)
    return rule(op, graph) if rule is not None else None


def supported_op_types() -> frozenset[str]:
    _load()
    return frozenset(_RULES)

"""The registry: op type -> rule function, filled by the `register` decorator of each family
module (einsum, elementwise, reduce, shape, nn, attention), imported here once."""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable

from autoshard.ir.graph import Graph, Op
from autoshard.rules.base import OpRule

Rule = Callable[[Op, Graph], OpRule | None]
_RULES: dict[tuple[str, str], Rule] = {}
_FAMILIES = ("einsum", "elementwise", "reduce", "shape", "nn", "attention", "gradient")
_ONNX = ("", "ai.onnx")
_loaded = False
_KNOWN: weakref.WeakKeyDictionary[Graph, dict[int, tuple[Op, OpRule | None]]] = (
    weakref.WeakKeyDictionary()
)


def register(*op_types: str, domain: str = "") -> Callable[[Rule], Rule]:
    """Register a rule for op types of `domain` (the default ONNX domain unless told)."""

    def add(rule: Rule) -> Rule:
        for op_type in op_types:
            if (domain, op_type) in _RULES:
                raise ValueError(f"two rules for {domain}.{op_type}")
            _RULES[(domain, op_type)] = rule
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
    """The op's rule, or None when no rule covers it (it is then computed replicated). Made
    once per op object and graph: search, lowering and pricing all ask for it (ops may not be
    hashable: their attributes can hold tensors)."""
    known = _KNOWN.setdefault(graph, {})
    entry = known.get(id(op))
    if entry is None or entry[0] is not op:  # the entry holds its op: ids are not reused
        _load()
        rule = _RULES.get(("" if op.domain in _ONNX else op.domain, op.type))
        entry = known[id(op)] = (op, rule(op, graph) if rule is not None else None)
    return entry[1]


def supported_op_types(domain: str = "") -> frozenset[str]:
    """The op types of `domain` (the default ONNX domain unless told) that have a rule."""
    _load()
    wanted = "" if domain in _ONNX else domain
    return frozenset(op_type for known, op_type in _RULES if known == wanted)

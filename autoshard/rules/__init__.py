"""Operator sharding rules (the ShardingInterface of docs/design/propagation.md): a registry
from ONNX op type to a
pure function `(op, graph) -> OpRule`. Rules see shapes and attributes, never the mesh."""

from autoshard.rules.base import IndexingMap, IteratorType, Loop, Note, OpRule
from autoshard.rules.registry import register, rule_for, supported_op_types

__all__ = [
    "IndexingMap",
    "IteratorType",
    "Loop",
    "Note",
    "OpRule",
    "register",
    "rule_for",
    "supported_op_types",
]

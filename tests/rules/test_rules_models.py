"""Every op of the test models has a rule, and every rule keeps the invariants of base.py."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
from rules_oracle import check_rule

from autoshard.ir.onnx_import import import_onnx, unbound_dims
from autoshard.rules import rule_for

MODELS = sorted((Path(__file__).parents[2] / "models").glob("*.onnx"))
DIMS = {"batch": 2, "seq": 16}

WITHOUT_RULE: dict[str, str] = {}
"""Op types allowed to have no rule in the models, with the reason. None today."""


@pytest.fixture(scope="module", params=MODELS, ids=lambda p: p.stem)
def graph(request):
    path = request.param
    return import_onnx(path, {k: v for k, v in DIMS.items() if k in unbound_dims(path)})


def test_models_found() -> None:
    assert {p.stem for p in MODELS} >= {"mlp", "gpt2", "gpt2_dynamo", "bert", "cnn"}


def test_every_op_has_a_rule(graph) -> None:
    missing = collections.Counter(
        op.type for op in graph.ops if op.type not in WITHOUT_RULE and rule_for(op, graph) is None
    )
    assert dict(missing) == {}


def test_every_rule_keeps_the_invariants(graph) -> None:
    for op in graph.ops:
        rule = rule_for(op, graph)
        if rule is not None:
            check_rule(rule, op, graph)


def test_embedding_is_vocabulary_splittable() -> None:
    """gpt2's token embedding: wte [512, 64] by the ids [2, 16] -> [2, 16, 64]."""
    graph = import_onnx(Path(__file__).parents[2] / "models" / "gpt2.onnx", DIMS)
    (op,) = [
        op
        for op in graph.ops
        if op.type == "Gather" and graph.values[op.inputs[0]].shape == (512, 64)
    ]
    rule = rule_for(op, graph)
    assert rule is not None
    assert str(rule) == (
        "loops [d0: parallel(2), d1: parallel(16), d2: parallel(64), d3: reduction_sum(512)] "
        "operands ['(d3, d2)', '(d0, d1)'] results ['(d0, d1, d2)']"
    )
    assert rule.note == "masked_lookup"

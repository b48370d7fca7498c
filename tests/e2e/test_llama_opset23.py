"""A tiny Hugging Face Llama (grouped-query attention, 4 query heads over 2 key-value heads)
exported by torch's dynamo exporter at opset 23, where `scaled_dot_product_attention` becomes
the ONNX Attention op and the norms RMSNormalization: planned on 2x2 under a memory budget that
makes it split weights, every op has a rule and the attention splits its heads; the plan's
partition runs on the 4 devices and equals onnxruntime on the whole model; the training step
plans with every op ruled too (the attention's gradients derived from its rule)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from autoshard.cli.main import main
from autoshard.ir.onnx_import import import_onnx
from autoshard.rules import rule_for

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxscript")


@pytest.fixture(scope="module")
def llama23(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
    from make_models import export_tiny_llama

    return export_tiny_llama(tmp_path_factory.mktemp("llama23") / "llama23.onnx", 128, 64, 2, 16)


def test_the_export_uses_the_fused_ops_and_every_op_has_a_rule(llama23):
    graph = import_onnx(llama23)
    types = {op.type for op in graph.ops}
    assert {"Attention", "RMSNormalization"} <= types
    assert [op.name for op in graph.ops if rule_for(op, graph) is None] == []


def test_plan_splits_the_attention_heads_and_the_partition_verifies(llama23, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    args = ["plan", str(llama23), "--mesh", "2x2", "--memory", "200KB", "-o", str(plan)]
    assert main(args) == 0
    assert "no rule" not in capsys.readouterr().out
    document = json.loads(plan.read_text())
    assert document["unruled"] == []
    graph = import_onnx(llama23)
    heads = {}
    for op in graph.ops:
        if op.type == "Attention":
            option = document["ops"][op.name]["sharding_option"]
            heads[op.name] = json.loads(option)[1] if option.count("[") > 2 else []
    assert heads and all(heads.values()), heads  # loop d1, the heads, on some mesh axis
    out = tmp_path / "out"
    args = ["partition", str(llama23), "--mesh", "2x2", "--plan", str(plan), "-o", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    assert main(["verify", str(out), "--model", str(llama23), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["devices"] == 4


def test_training_plan_rules_the_attention_and_its_gradients(llama23, tmp_path, capsys):
    plan = tmp_path / "train.json"
    args = ["plan", str(llama23), "--mesh", "2x2", "--mode", "training", "-o", str(plan)]
    assert main(args) == 0
    assert "no rule" not in capsys.readouterr().out
    assert json.loads(plan.read_text())["unruled"] == []

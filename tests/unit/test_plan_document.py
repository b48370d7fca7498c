"""The typed plan document (document.plan_document.PlanDocument): saved plans read back and
written again byte for byte, read by attribute, and a malformed one refused naming the plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoshard.document.blocks import DocumentError
from autoshard.document.plan_document import SCHEMA, PlanDocument, document_text, read_document
from autoshard.mesh import Mesh
from autoshard.sharding import Sharding

BASELINES = sorted((Path(__file__).resolve().parents[2] / "bench" / "baselines").glob("*.json"))


@pytest.mark.parametrize("path", BASELINES, ids=[p.stem for p in BASELINES])
def test_a_saved_plan_is_written_back_byte_for_byte(path: Path) -> None:
    assert document_text(read_document(path)) == path.read_text()


def test_a_saved_plan_is_read_by_attribute() -> None:
    (path,) = [p for p in BASELINES if p.stem == "gpt2-2x4-training"]
    document = read_document(path)
    assert document.mesh == Mesh.parse("2x4") and document.model.label.startswith("gpt2.onnx")
    assert document.mode == "training" and document.training is not None
    held = document.values["lm.transformer.wte.weight"]
    assert held.held_sharding == Sharding.parse(held.held)
    assert document.search is not None and document.search.asked is not None
    assert document.solver is not None and document.cost is not None
    assert document.strategy is not None and document.cost.phases


def test_a_plan_of_few_blocks_reads_the_rest_as_none() -> None:
    """What `autoshard report` needs of a plan: its model, mesh and cost."""
    document = PlanDocument.from_json({
        "schema": SCHEMA, "model": {"file": "mlp.onnx", "dims": {"batch": 8}}, "mesh": "2x2",
        "cost": {"objective": 1.0, "comm_bytes_per_device": 0, "comm_time_s": 0.0,
                 "compute_time_s": 1.0, "memory_bytes_per_device": 64},
    })  # fmt: skip
    assert document.model.label == "mlp.onnx batch=8" and document.cost is not None
    assert (document.solver, document.search, document.timing, document.cluster) == (None,) * 4


def test_a_malformed_plan_is_refused_naming_it() -> None:
    data = json.loads(BASELINES[0].read_text())
    del data["cost"]["objective"]
    with pytest.raises(DocumentError, match=r"^plan p\.json is malformed: KeyError\('objective'\)"):
        PlanDocument.from_json(data, "plan p.json")
    with pytest.raises(DocumentError, match="is not an autoshard plan"):
        PlanDocument.from_json({"schema": "other/1"}, "plan p.json")

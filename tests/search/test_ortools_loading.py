"""OR-Tools is loaded where CP-SAT is called, never on a plan that does not reach it: a free
plan answered by exact elimination imports no `ortools` (its import is a fixed cost of every
plan otherwise), nor networkx, and a plan whose budget binds still solves with CP-SAT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# One fresh interpreter: the free plan first (nothing has imported OR-Tools yet), then the
# same model under a budget that binds (the memory-bound search, CP-SAT's tries).
SCRIPT = """
import json, sys
from autoshard.cli.main import main

def plan(memory, out):
    code = main(["plan", "models/mlp.onnx", "--mesh", "2x2", "--dim", "batch=8",
                 "--memory", memory, "-q", "-o", out])
    document = json.load(open(out))
    return {"code": code, "solver": document["solver"],
            "peak": document["cost"]["memory_bytes_per_device"],
            "ortools": "ortools.sat.python.cp_model" in sys.modules,
            "networkx": "networkx" in sys.modules}

print(json.dumps([plan("1TB", sys.argv[1]), plan("100KB", sys.argv[2])]))
"""


def test_a_free_plan_imports_no_ortools_and_a_binding_one_solves_with_cp_sat(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "free.json"), str(tmp_path / "bound.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    free, bound = json.loads(done.stdout.strip().splitlines()[-1])
    assert free["code"] == 0 and free["solver"]["status"] == "OPTIMAL"
    assert free["solver"]["variables"] == 0  # elimination answered: no CP-SAT model was built
    assert not free["ortools"]
    assert not free["networkx"]  # (only `Graph.to_networkx` needs it)
    # 100 KB binds: the free plan holds 99.06 KiB = 101,440 B > 100,000 B.
    assert free["peak"] > 100_000
    assert bound["code"] == 0 and bound["solver"]["status"] == "OPTIMAL"
    assert bound["solver"]["variables"] > 0  # CP-SAT's model
    assert bound["peak"] <= 100_000
    assert bound["ortools"]

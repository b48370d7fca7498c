"""Golden MLIR text after each stage of lowering (materialize, the CCL passes, partition), as
`autoshard propagate --dump-after STAGE` prints it, for the bundled MLP and one GPT-2 block: a
change to a pass shows up here as a text diff to review, as Shardy's per-pass lit tests do.

The texts live in tests/golden/stages/, one file per model and stage. After a deliberate change,
rewrite them and review the diff:

    AUTOSHARD_UPDATE_GOLDEN=1 pytest tests/golden/test_stages.py

Each case is a fixed plan (annotations propagated, no search), chosen so that every stage has
something to show: the MLP's CCL passes move an all_gather below the ReLU; the GPT-2 block's
move one below the attention's residual add, and its partition rewrites the reshapes' shapes.
"""

from __future__ import annotations

import difflib
import io
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from autoshard.annotations import Annotation
from autoshard.mesh import Mesh
from autoshard.passes import Stage
from autoshard.passes.partition import Partitioned
from autoshard.pipeline import dump_after, propagated
from autoshard.program import Program
from autoshard.sharding import Sharding

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
GOLDEN = Path(__file__).resolve().parent / "stages"
UPDATE = "AUTOSHARD_UPDATE_GOLDEN"


def gpt2_block(folder: Path) -> Path:
    """The first transformer block of models/gpt2_dynamo.onnx (GPT-2 as the dynamo exporter
    writes it: the TorchScript export's folded shape arithmetic would bury the block under
    constants), cut out between the embeddings' sum `add_20` and the block's output `add_285`.
    The causal mask `where` becomes an input, and so does `input_ids`, whose shape the block's
    reshapes read. Nodes and weights keep the model's order."""
    model = onnx.load(MODELS / "gpt2_dynamo.onnx")
    hidden, mask = ["batch", "seq", 64], ["batch", 1, "seq", "seq"]
    inputs = [
        next(i for i in model.graph.input if i.name == "input_ids"),
        helper.make_tensor_value_info("add_20", TensorProto.FLOAT, hidden),
        helper.make_tensor_value_info("where", TensorProto.FLOAT, mask),
    ]
    producers = {name: node for node in model.graph.node for name in node.output}
    given = {i.name for i in inputs}
    read, kept, wanted = set(), set(), ["add_285"]
    while wanted:
        name = wanted.pop()
        if name and name not in read and name not in given:
            read.add(name)
            if name in producers:
                kept.add(id(producers[name]))
                wanted.extend(producers[name].input)
    graph = helper.make_graph(
        [node for node in model.graph.node if id(node) in kept], "gpt2_block", inputs,
        [helper.make_tensor_value_info("add_285", TensorProto.FLOAT, hidden)],
        [weight for weight in model.graph.initializer if weight.name in read],
    )  # fmt: skip
    block = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    path = folder / "gpt2_block.onnx"
    onnx.save(block, path)
    return path


@dataclass(frozen=True)
class Case:
    model: Callable[[Path], Path]
    dims: dict[str, int]
    mesh: str
    annotations: tuple[tuple[str, str], ...]
    """(value, sharding) held as a result; `users:` before the value: as its users read it."""

    def annotated(self) -> list[Annotation]:
        return [
            Annotation(value.removeprefix("users:"), Sharding.parse(sharding),
                       for_users=value.startswith("users:"))
            for value, sharding in self.annotations
        ]  # fmt: skip


# The weights are annotated for their users (how the Gemms read them): a weight merely held
# split would lose to the projection's `users:` annotation on its result, which propagation
# reads first, as upstream does (issue 47); read so, the projections' sums are reduce-scattered.
MEGATRON = tuple(
    (f"users:lm.transformer.h.0.{weight}.weight", sharding)
    for weight, sharding in [
        ("attn.c_attn", "[[], [1]]"),
        ("attn.c_proj", "[[1]]"),
        ("mlp.c_fc", "[[], [1]]"),
        ("mlp.c_proj", "[[1]]"),
    ]
)

CASES = {
    # Batch over axis 0, the hidden layer's columns over axis 1, gathered for the ReLU.
    "mlp": Case(
        model=lambda _: MODELS / "mlp.onnx",
        dims={"batch": 8},
        mesh="2x2",
        annotations=(("x", "[[0]]"), ("0.weight", "[[1]]"), ("users:/0/Gemm_output_0", "[[0]]")),
    ),
    # Batch over axis 0, Megatron's tensor parallelism over axis 1, the projections' sums
    # reduce-scattered over the hidden dim.
    "gpt2_block": Case(
        model=gpt2_block,
        dims={"batch": 4, "seq": 8},
        mesh="2x2",
        annotations=(
            ("input_ids", "[[0]]"), ("add_20", "[[0]]"), ("where", "[[0]]"), *MEGATRON,
            ("users:addmm_1", "[[0], [1]]"), ("users:addmm_3", "[[0], [1]]"),
        ),
    ),
}  # fmt: skip


def stage_texts(name: str, folder: Path) -> dict[Stage, str]:
    """What `--dump-after STAGE` prints for each stage of case `name`, through the pipeline's
    own dump points."""
    case = CASES[name]
    texts = {stage: io.StringIO() for stage in Stage}

    def after(stage: Stage, result: Program | Partitioned) -> None:
        dump_after({stage}, "mesh", texts[stage])(stage, result)

    propagated(
        case.model(folder), case.dims, Mesh.parse(case.mesh), case.annotated(), after,
        partition=True,
    )  # fmt: skip
    return {stage: text.getvalue() for stage, text in texts.items()}


@cache
def _texts(name: str) -> dict[Stage, str]:
    with tempfile.TemporaryDirectory() as folder:
        return stage_texts(name, Path(folder))


def golden(name: str, stage: Stage) -> Path:
    return GOLDEN / f"{name}.{stage}.mlir"


@pytest.mark.parametrize("stage", list(Stage), ids=str)
@pytest.mark.parametrize("name", CASES)
def test_stage_text_is_the_golden_one(name, stage):
    text, path = _texts(name)[stage], golden(name, stage)
    if os.environ.get(UPDATE) == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    expected = path.read_text() if path.exists() else ""
    diff = "".join(
        difflib.unified_diff(
            expected.splitlines(keepends=True), text.splitlines(keepends=True),
            f"{path.relative_to(ROOT)} (golden)", "now",
        )
    )  # fmt: skip
    assert not diff, f"the program after {stage} changed ({UPDATE}=1 rewrites):\n{diff}"


def test_every_golden_file_is_a_case():
    expected = {golden(name, stage).name for name in CASES for stage in Stage}
    assert {p.name for p in GOLDEN.glob("*.mlir")} == expected


def test_stage_texts_are_the_same_in_every_process():
    """Two fresh processes, with different hash seeds, print the same bytes (set and dict
    orders that leaked into the text would show here first)."""
    script = (
        "import sys, tempfile, pathlib\n"
        "from tests.golden.test_stages import CASES, stage_texts\n"
        "with tempfile.TemporaryDirectory() as d:\n"
        "    for name in CASES:\n"
        "        sys.stdout.write(''.join(stage_texts(name, pathlib.Path(d)).values()))\n"
    )
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        run = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        outputs.append(run.stdout)
    assert outputs[0] == outputs[1]
    assert outputs[0] == "".join(text for name in CASES for text in _texts(name).values())

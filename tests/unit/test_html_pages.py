"""Pages that scale (issue 48): the weights table one row per role of a repeated layer, with
the copies held differently one row per variant, and a 70B-shaped decoder's report a few
screens tall in a real headless Chromium (tests/browser.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from autoshard.cli.main import main
from autoshard.html.charts import Band, memory_chart
from autoshard.html.weights import pattern

MODELS = Path(__file__).resolve().parents[2] / "models"
GPT2 = MODELS / "gpt2.onnx"
DECODER = MODELS / "decoder_32l_shape_only.onnx"


@pytest.mark.parametrize(
    ("names", "told"),
    [
        (["layers.0.attn.q_proj.weight"], "layers.0.attn.q_proj.weight"),
        (["h.0.mlp.c1.weight", "h.1.mlp.c1.weight", "h.11.mlp.c1.weight"], "h.*.mlp.c1.weight"),
        (["val_12", "val_40"], "val_*"),
        (["a.0.x", "b.1.x"], "a.0.x \u2026 b.1.x"),
    ],
    ids=["one", "layers", "numbered", "unlike"],
)
def test_pattern(names: list[str], told: str) -> None:
    assert pattern(names) == told


def _rows(html: str) -> list[tuple[str, str]]:
    """(name, copies) of each row of the weights table."""
    section = html[html.index('id="weights"') : html.index('id="layout"')]
    found = re.findall(r'<tr data-copies="\d+"><td><code class="name">([^<]*)</code>'
                       r"(?:<span[^>]*>[^<]*</span>)?</td><td>([^<]*)</td>", section)  # fmt: skip
    return [(name, copies) for name, copies in found]


def test_weights_one_row_per_role_of_a_layer(tmp_path: Path) -> None:
    """GPT-2's two layers of 12 weights each: 12 rows of 2 copies, between the embeddings and
    the final norm (and the tied head's transpose)."""
    out = tmp_path / "r.html"
    flags = ["--mesh", "2x4", "--dim", "batch=8", "--dim", "seq=128"]
    assert (
        main(["plan", str(GPT2), *flags, "-o", str(tmp_path / "p.json"), "--html", str(out)]) == 0
    )
    rows = _rows(out.read_text())
    assert rows[:3] == [
        ("lm.transformer.wte.weight", "1"),
        ("lm.transformer.wpe.weight", "1"),
        ("lm.transformer.h.*.ln_1.weight", "2"),
    ]
    assert [c for _, c in rows].count("2") == 12 and len(rows) == 2 + 12 + 3


def test_copies_held_differently_are_variants(tmp_path: Path) -> None:
    """Layer 0's c_fc weight split on its columns, layer 1's left replicated: a row each, by
    name."""
    out = tmp_path / "r.html"
    weight = "lm.transformer.h.0.mlp.c_fc.weight"
    flags = ["propagate", str(GPT2), "--mesh", "2", "--dim", "batch=8", "--dim", "seq=128"]
    assert main([*flags, "--annotate", f"{weight}=[[],[0]]", "--html", str(out)]) == 0
    rows = _rows(out.read_text())
    assert ("lm.transformer.h.0.mlp.c_fc.weight", "1 of 2") in rows
    assert ("lm.transformer.h.1.mlp.c_fc.weight", "1 of 2") in rows
    assert ("lm.transformer.h.*.attn.c_proj.weight", "2") in rows


@pytest.mark.parametrize(
    ("extra", "bound"), [([], 5600), (["--mode", "training"], 6600)], ids=["inference", "training"]
)
def test_a_70b_shaped_report_is_a_few_screens(
    tmp_path: Path, page, extra: list[str], bound: int
) -> None:
    """The bundled 32-layer decoder (a Llama-shaped export, shapes only) on 4x8: its weights
    table one row per role (9 roles of the layers, 3 weights outside), one layer's picture (its
    7 projections and 2 attention matmuls, and the collectives between them) a screen at most,
    the page a few screens of 900 px (with a row a weight it was about 11,500 px for inference,
    18,200 for training)."""
    out = tmp_path / "r.html"
    flags = ["--mesh", "4x8", "--dim", "batch=8", "--dim", "seq=2048", *extra]
    args = ["plan", str(DECODER), *flags, "-o", str(tmp_path / "p.json"), "--html", str(out)]
    assert main(args) == 0
    opened, console = page
    opened.goto(out.as_uri())
    assert opened.locator("#weights table.weights tr").count() == 1 + 3 + 9
    layer = opened.locator("#layer table.layer")
    ops = layer.locator("tr.matmul td:first-child code.name").all_text_contents()
    assert [re.sub(r"_\d+$", "", op) for op in ops] == [
        f"layers.0.{op}" for op in ("attn.q_proj.out", "attn.k_proj.out", "attn.v_proj.out",
                                    "attn.scores", "attn.ctx", "attn.o_proj.out",
                                    "mlp.gate_proj.out", "mlp.up_proj.out", "mlp.down_proj.out")
    ]  # fmt: skip
    assert layer.locator("tr.collective").count() >= 1
    assert opened.locator("#layer").evaluate("e => e.offsetHeight") < 900
    assert opened.evaluate("document.body.scrollHeight") < bound
    assert console.errors == []


def _layer_rows(html: str) -> list[tuple[str, ...]]:
    """(class, cell texts...) of each row of the layer picture."""
    section = html[html.index('id="layer"') : html.index('id="time"')]
    rows = []
    for kind, cells in re.findall(r'<tr class="(\w+)">(.*?)</tr>', section):
        texts = [
            re.sub(r"<[^>]+>", " ", c).split() for c in re.findall(r"<td[^>]*>(.*?)</td>", cells)
        ]
        rows.append((kind, *(" ".join(t) for t in texts)))
    return rows


def test_one_layer_of_megatron_in_the_report(tmp_path: Path) -> None:
    """GPT-2 with dp_tp's annotations on dp=2,tp=2 (search.baselines): in each layer the QKV
    Gemm computed whole, the attention's output projection and the MLP's second Gemm split by
    row, each followed by the all_reduce of its partial sums over tp, and the MLP's first Gemm
    split by column. The all_reduce moves one device's [batch/2, seq, hidden] result:
    4 x 128 x 64 x 4 bytes = 128 KiB."""
    from autoshard.mesh import Mesh
    from autoshard.pipeline import load_graph
    from autoshard.search.baselines import dp_tp

    graph = load_graph(GPT2, {"batch": 8, "seq": 128}, None)
    annotations = dp_tp(graph, Mesh.parse("dp=2,tp=2"), 0, 1)
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"annotations": [a.to_json() for a in annotations]}))
    out = tmp_path / "r.html"
    flags = ["--mesh", "dp=2,tp=2", "--dim", "batch=8", "--dim", "seq=128"]
    assert (
        main(["propagate", str(GPT2), *flags, "--annotations", str(path), "--html", str(out)]) == 0
    )
    html = out.read_text()
    assert "Layer 0 of the 2 repeated layers (forward): all 2 are alike." in html
    rows = _layer_rows(html)
    layer, split = "/lm/transformer/h.0", "split (tensor parallel)"
    matmuls = [row[1:] for row in rows if row[0] == "matmul"]
    assert matmuls == [
        (f"{layer}/attn/c_attn/Gemm Gemm", "lm.transformer.h.0.attn.c_attn.weight 64x192",
         "weight not split", "replicated"),
        (f"{layer}/attn/MatMul MatMul", "activations", "result [[0], [1], [], []]", ""),
        (f"{layer}/attn/MatMul_1 MatMul", "activations", "result [[0], [1], [], []]", ""),
        (f"{layer}/attn/c_proj/Gemm Gemm", "lm.transformer.h.0.attn.c_proj.weight 64x64",
         "row over axis tp: partial sums", split),
        (f"{layer}/mlp/c_fc/Gemm Gemm", "lm.transformer.h.0.mlp.c_fc.weight 64x256",
         "column over axis tp", split),
        (f"{layer}/mlp/c_proj/Gemm Gemm", "lm.transformer.h.0.mlp.c_proj.weight 256x64",
         "row over axis tp: partial sums", split),
    ]  # fmt: skip
    # the weights table says how each is held in the same words
    weights = html[html.index('id="weights"') : html.index('id="layout"')]
    held = {}
    for cells in re.findall(r"<tr data-copies=\"\d+\">(.*?)</tr>", weights):
        texts = [re.sub(r"<[^>]+>", " ", t).split() for t in re.findall(r"<td>(.*?)</td>", cells)]
        held[texts[0][0]] = " ".join(texts[-1])
    assert held["lm.transformer.h.*.mlp.c_fc.weight"] == split
    assert held["lm.transformer.h.*.attn.c_attn.weight"] == "replicated"
    reduces = [i for i, row in enumerate(rows) if "all_reduce" in row[1]]
    for block, i in zip(("attn", "mlp"), reduces, strict=True):
        gemm = f"{layer}/{block}/c_proj/Gemm"
        assert rows[i - 1][1] == f"{gemm} Gemm"  # right after the row-split Gemm
        assert rows[i][1] == (
            f"\u2192 all_reduce of {gemm}_output_0 over axis tp, 128.00 KiB per device: after "
            f"{gemm}, before {gemm.replace('Gemm', 'Reshape_1')}"
        )


def test_backward_op_types_are_named_by_their_forward_op(tmp_path: Path) -> None:
    """GPT-2's training step: the report's compute by op type names gradients by their forward
    op (Gemm backward, ...), while the plan document keeps the graph's one `Grad` type."""
    plan, out = tmp_path / "p.json", tmp_path / "r.html"
    flags = ["--mesh", "2x4", "--dim", "batch=8", "--dim", "seq=128", "--mode", "training"]
    assert main(["plan", str(GPT2), *flags, "-o", str(plan), "--html", str(out)]) == 0
    html = out.read_text()
    table = html[html.index("Compute by op type") :]
    table = table[: table.index("</table>")]
    types = re.findall(r"<tr><td>([^<]*)</td>", table)
    assert "Grad" not in types and "Gemm backward" in types and "Update" in types
    assert all(t.split()[0] != "Grad" for t in types)
    assert "Grad" in json.loads(plan.read_text())["breakdown"]["compute_s_by_op_type"]


def _texts(svg: str) -> list[tuple[str, tuple[float, float, float, float]]]:
    """Each text of an SVG, its words and box (left, top, right, bottom) from the x, y and
    anchor written, at 7 px a character of an 11 px font (a little wider than drawn)."""
    boxes = []
    for attrs, words in re.findall(r"<text ([^>]*)>([^<]*)</text>", svg):
        got = dict(re.findall(r'([\w-]+)="([^"]*)"', attrs))
        x, y, width = float(got["x"]), float(got["y"]), 7.0 * len(words)
        anchor = got.get("text-anchor") or ("end" if "label" in got["class"].split() else "start")
        x0 = {"start": x, "middle": x - width / 2, "end": x - width}[anchor]
        boxes.append((words, (x0, y - 11, x0 + width, y + 3)))
    return boxes


@pytest.mark.parametrize("budget", [100, 120, 160], ids=["at-peak", "above", "far-above"])
def test_the_budget_label_misses_the_phase_names(budget: int) -> None:
    """A training step's last phase (the optimizer) ends the chart at its right, where the
    budget line's label was drawn over its name when the budget sits near the top."""
    timeline = [10] * 40 + [95] * 20 + [60] * 33 + [40] * 8
    bands = [Band("forward", 0, 40), Band("backward", 40, 90), Band("optimizer", 92, 100)]
    svg = memory_chart(timeline, budget, 45, "peak 95 B", bands)
    boxes = _texts(svg)
    label = next(b for w, b in boxes if w.startswith("budget "))
    others = [b for w, b in boxes if w in ("forward", "backward", "optimizer", "peak 95 B")]
    assert len(others) == 3 + 3 + 1  # the phases named on the plot and in the legend
    for box in others:
        apart = label[2] <= box[0] or box[2] <= label[0] or label[3] <= box[1] or box[3] <= label[1]
        assert apart, (box, label)


def test_a_model_without_layers_is_drawn_whole(tmp_path: Path) -> None:
    """The MLP split Megatron-style by hand: the first Gemm by column, the second by row, and
    the all_reduce of its partial sums (the model's output y, [8, 64] float32: 2 KiB) after it,
    read by no op."""
    out = tmp_path / "r.html"
    weights = ["--annotate", "0.weight=[[0],[]]", "--annotate", "2.weight=[[],[0]]"]
    mlp = str(MODELS / "mlp.onnx")
    args = ["propagate", mlp, "--mesh", "tp=2", "--dim", "batch=8", *weights, "--html", str(out)]
    assert main(args) == 0
    html = out.read_text()
    assert '<h2>The forward pass</h2><p class="note">The model has no repeated layers' in html
    split = "split (tensor parallel)"
    assert _layer_rows(html) == [
        ("matmul", "/0/Gemm Gemm", "0.weight 256x64", "column over axis tp", split),
        ("matmul", "/2/Gemm Gemm", "2.weight 64x256", "row over axis tp: partial sums", split),
        ("collective", "\u2192 all_reduce of y over axis tp, 2.00 KiB per device: after /2/Gemm"),
    ]


def test_the_layer_drawn_says_which_layers_it_stands_for(tmp_path: Path) -> None:
    """Layer 0's c_fc weight split on its columns, layer 1's left replicated: the layers
    differ, the first is drawn, and the picture says it stands for itself alone."""
    out = tmp_path / "r.html"
    weight = "lm.transformer.h.0.mlp.c_fc.weight"
    flags = ["propagate", str(GPT2), "--mesh", "2", "--dim", "batch=8", "--dim", "seq=128"]
    assert main([*flags, "--annotate", f"{weight}=[[],[0]]", "--html", str(out)]) == 0
    html = out.read_text()
    assert "Layer 0 of the 2 repeated layers (forward): it stands for 1 of them (0); 1 other " \
        "differs." in html  # fmt: skip
    fc = next(row for row in _layer_rows(html) if row[1].startswith("/lm/transformer/h.0/mlp/c_fc"))
    assert fc[3:] == ("column over axis 0", "split (tensor parallel)")


@pytest.mark.parametrize(
    ("layers", "told"), [([0], "0"), ([0, 1, 2, 5, 7, 8], "0-2, 5, 7-8")], ids=["one", "spans"]
)
def test_layers_alike_are_told_as_spans(layers: list[int], told: str) -> None:
    from autoshard.html.layer import _spans

    assert _spans(layers) == told

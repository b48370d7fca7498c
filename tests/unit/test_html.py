"""The HTML report (autoshard.html): the memory curve it draws (hand-computed), the mesh and
tensor pictures, escaping of hostile names, determinism, and the reports of the bundled GPT-2's
inference and training plans on 2x4 opened in a real headless Chromium (tests/browser.py):
every section rendered with the plan's figures, no console errors, the full-page screenshot's
size."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
from onnx import helper
from onnx_factory import F32, matmul_chain, model, rng_weight, save, tensor

from autoshard.annotations import Annotation
from autoshard.cli.main import main
from autoshard.cost.liveness import memory, memory_timeline
from autoshard.document.story import Role, recognise
from autoshard.holding import Holding
from autoshard.html.markup import ms
from autoshard.html.mesh import Cell, mesh_svg
from autoshard.html.tensor import tensor_figure
from autoshard.mesh import Mesh
from autoshard.pipeline import load_graph, propagated
from autoshard.propagate import propagate
from autoshard.search.baselines import dp_tp
from autoshard.sharding import Sharding
from autoshard.units import format_bytes

MODELS = Path(__file__).resolve().parents[2] / "models"
GPT2 = MODELS / "gpt2.onnx"
FLAGS = ["--mesh", "2x4", "--dim", "batch=8", "--dim", "seq=128"]
SECTIONS = ("strategy", "mesh", "time", "memory", "weights", "layout")


def test_memory_timeline_by_hand(tmp_path: Path) -> None:
    """x[8, 8] @ W0[8, 16] -> Relu -> @ W1[16, 4] + b, batch split over 2 devices, float32:
    held throughout x 4x8 (128 B), W0 512, W1 256, b 16 = 912 B; then h (4x16: 256) at step
    1, r (256) at step 2 while h is still read, h freed; o (4x4: 64), r freed; y (64)."""
    path = save(matmul_chain(), tmp_path)
    program = propagated(path, {"batch": 8}, Mesh.parse("2"), [Annotation("x", Sharding(((0,),)))])
    timeline = memory_timeline(program.program)
    assert timeline == (912, 912 + 256, 912 + 512, 912 + 256 + 64, 912 + 64 + 64)
    peak = memory(program.program)
    assert (peak.peak, peak.step, timeline[peak.step + 1]) == (1424, 1, 1424)


def test_axis_roles_of_dp_tp() -> None:
    graph = load_graph(GPT2, {"batch": 4, "seq": 8}, None)
    mesh = Mesh.parse("dp=2,tp=2")
    roles = recognise(graph, propagate(graph, mesh, dp_tp(graph, mesh, 0, 1))).roles
    assert roles == {0: (Role.DATA,), 1: (Role.TENSOR, Role.VOCABULARY)}


def _cells(svg: str) -> list[str]:
    return re.findall(r'<rect [^>]*class="cell"', svg)


def test_mesh_drawing_per_device_and_compact() -> None:
    mesh = Mesh.parse("4x8")

    def cell(device):
        return Cell("#fff", str(mesh.linear_index(device)), f"d{device}")

    drawn = mesh_svg(mesh, cell, [False, True])
    assert len(_cells(drawn)) == 32
    assert drawn.count('class="node"') == 4  # one node per row: axis 1 on the scale-up link
    assert "<title>d(3, 7)</title>" in drawn
    big = Mesh.parse("16x16x8")  # 2048 devices: one row of at most 8 cells per axis
    compact = mesh_svg(big, cell, [False, False, True])
    assert len(_cells(compact)) == 24 and "axis 0: 16 devices" in compact
    assert "\u00d716, across nodes" in compact and "in a node" in compact


def test_tensor_figure_blocks() -> None:
    """4x8 split [[], [0, 1]] on 2x2: four column blocks of 4x2, device i holds block i+1;
    4x6 so split: blocks of ceil(6 / 4) = 2 columns, the last device's empty (not drawn);
    [[0]]: two row blocks, each replicated over axis 1."""
    mesh = Mesh.parse("2x2")
    figure = tensor_figure(
        mesh, "w", (4, 8), "float32", Sharding(((), (0, 1))), [True, True], "held as"
    )
    blocks = re.findall(r"<title>(B\d+: [^<]*)</title>", figure)
    assert blocks == [
        f"B{i + 1}: dim 0 0:4, dim 1 {2 * i}:{2 * i + 2}; devices {i}" for i in range(4)
    ]
    held = re.findall(r"<title>device \((\d), (\d)\) #\d holds (B\d)</title>", figure)
    assert held == [("0", "0", "B1"), ("0", "1", "B2"), ("1", "0", "B3"), ("1", "1", "B4")]
    assert "each device holds at most 4x2 (32 B)" in figure
    uneven = tensor_figure(
        mesh, "w", (4, 6), "float32", Sharding(((), (0, 1))), [True, True], "held as"
    )
    assert len(re.findall(r"<title>B\d+: ", uneven)) == 3
    assert "<title>device (1, 1) #3 holds B4</title>" in uneven
    rows = tensor_figure(mesh, "w", (4, 6), "float32", Sharding(((0,),)), [True, True], "held as")
    assert re.findall(r"<title>(B\d+: [^<]*)</title>", rows) == [
        "B1: dim 0 0:2, dim 1 0:6; devices 0, 1",
        "B2: dim 0 2:4, dim 1 0:6; devices 2, 3",
    ]
    assert "Replicated over axis 1." in rows


HOSTILE = '<script>alert("x")</script>'


def _hostile_model(tmp_path: Path) -> Path:
    """A two-matmul model whose graph, weight and op names are markup."""
    w0, w1 = HOSTILE, "W1 & \"q\" 'a' <b>"
    nodes = [
        helper.make_node("MatMul", ["x", w0], ["h"], name="<img src=x onerror=alert(1)>"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", w1], ["y"], name="mm1"),
    ]
    inits = {w0: rng_weight((8, 16), 1), w1: rng_weight((16, 4), 2)}
    proto = model(nodes, [tensor("x", F32, [8, 8])], [tensor("y", F32, [8, 4])], inits,
                  name=HOSTILE)  # fmt: skip
    return save(proto, tmp_path)


def test_names_are_escaped_and_a_report_is_deterministic(tmp_path: Path, page) -> None:
    path = _hostile_model(tmp_path)
    flags = ["propagate", str(path), "--mesh", "2", "--annotate", "x=[[0]]"]
    out, again = tmp_path / "a.html", tmp_path / "b.html"
    assert main([*flags, "--html", str(out), "--html-tensor", "W1 & \"q\" 'a' <b>"]) == 0
    assert main([*flags, "--html", str(again), "--html-tensor", "W1 & \"q\" 'a' <b>"]) == 0
    text = out.read_text()
    assert out.read_bytes() == again.read_bytes()
    assert "<script" not in text.lower() and "<img" not in text.lower()
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in text
    opened, console = page
    dialogs: list[str] = []
    opened.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    opened.goto(out.as_uri())
    assert opened.title() == f"autoshard plan: {HOSTILE} on mesh 2"
    assert opened.locator("#weights td code.name").all_inner_texts() == [
        HOSTILE, "W1 & \"q\" 'a' <b>",
    ]  # fmt: skip
    figures = opened.locator("#layout .tensor-layout")
    assert (
        figures.count() == 2 and figures.nth(1).get_attribute("data-tensor") == "W1 & \"q\" 'a' <b>"
    )
    assert dialogs == [] and console.errors == []


def test_an_unknown_tensor_is_one_line(tmp_path: Path, capsys) -> None:
    path = save(matmul_chain(), tmp_path)
    flags = ["propagate", str(path), "--mesh", "2", "--dim", "batch=8"]
    assert main([*flags, "--html", str(tmp_path / "r.html"), "--html-tensor", "nope"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "autoshard: error: no tensor 'nope' in model 'g': name a value of the model "
        "(weights: W0, W1, b)\n"
    )
    assert not (tmp_path / "r.html").exists()


# ---- the bundled GPT-2's reports in a real browser --------------------------------------------


@pytest.fixture(scope="module")
def gpt2_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, Path]]:
    """GPT-2 on 2x4: the inference plan (with an activation's layout asked for) and the
    training plan, each written by `autoshard plan --html` and checked to be the bytes
    `autoshard html PLAN.json` writes from the saved plan."""
    folder = tmp_path_factory.mktemp("html")
    found = {}
    activation = "/lm/transformer/h.0/attn/MatMul_output_0"
    for mode, extra in (("inference", ["--html-tensor", activation]),
                        ("training", ["--mode", "training"])):  # fmt: skip
        plan, report = folder / f"{mode}.json", folder / f"{mode}.html"
        assert (
            main(["plan", str(GPT2), *FLAGS, "-o", str(plan), "--html", str(report), *extra]) == 0
        )
        again = folder / f"{mode}-again.html"
        tensors = extra[1:] if mode == "inference" else []
        args = ["html", str(plan), "--model", str(GPT2), "-o", str(again)]
        assert main([*args, *(f"--tensor={t}" for t in tensors)]) == 0
        assert again.read_bytes() == report.read_bytes()
        found[mode] = (json.loads(plan.read_text()), report)
    return found


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    return width, height


def _render(page, report: Path):
    opened, console = page
    opened.goto(report.as_uri())
    for section in SECTIONS:
        assert opened.locator(f"section#{section}").is_visible(), section
        assert opened.locator(f"section#{section} h2").count() == 1
    width, height = _png_size(opened.screenshot(full_page=True))
    scrolled = opened.evaluate("document.documentElement.scrollHeight")
    assert width == 1280 and height == scrolled and 2500 < height < 12000
    assert opened.evaluate("document.documentElement.scrollWidth") == 1280  # nothing overflows
    assert console.errors == []
    return opened


def test_gpt2_inference_report_in_the_browser(gpt2_reports, page) -> None:
    document, report = gpt2_reports["inference"]
    opened = _render(page, report)
    assert opened.locator("p.story").inner_text() == document["story"]
    # the standard recipes beside the plan: the line, then the plan's row and each recipe's
    recipes = document["recipes"]
    assert opened.locator("#recipes p.difference").inner_text() == recipes["difference"]
    shown = opened.locator("#recipes table.recipes tr").all_inner_texts()
    assert [row.split("\t")[0] for row in shown] == [
        "layout", "plan (chosen)", "dp (DDP)", "tp-dp (Megatron TP x DP)",
    ]  # fmt: skip
    assert opened.locator("#mesh svg rect.cell").count() == 8
    axes = opened.locator("#mesh table.axes tr[data-axis]")
    assert axes.all_inner_texts() == [
        "axis 0\t2\tdata parallel\tin a node (scale-up link)\t450 GB/s\t1 us\tnone",
        "axis 1\t4\tdata parallel\tin a node (scale-up link)\t450 GB/s\t1 us\tnone",
    ]
    run = document["breakdown"]["repeated_layers"][0]
    layers = opened.locator("#time .layers svg text").all_text_contents()
    one = run["one_layer"]["compute_s"] + sum(run["one_layer"]["comm_s_by_mesh_axes"].values())
    assert layers[layers.index("forward: one layer (of 2)") + 1] == ms(one)
    assert "the rest" in layers and "forward: all 2 layers" in layers
    peak = opened.locator("#memory strong.peak")
    assert int(peak.get_attribute("data-bytes")) == document["cost"]["memory_bytes_per_device"]
    # 80 GB less the 2.41 GB reserve
    assert opened.locator("#memory strong.budget").inner_text() == "72.26 GiB"
    assert opened.locator("#memory svg path.area").count() == 1
    # 29 weights: 12 roles of the 2 layers a row each, 5 outside them.
    assert opened.locator("#weights table.weights tr").count() == 1 + 12 + 5
    drawn = opened.locator("#layout .tensor-layout")
    assert [drawn.nth(i).get_attribute("data-tensor") for i in range(drawn.count())] == [
        "lm.transformer.wte.weight", "/lm/transformer/h.0/attn/MatMul_output_0",
    ]  # fmt: skip
    # The activation [8, 4, 128, 128] is split on its batch over both axes: 8 blocks.
    assert drawn.nth(1).locator("svg").first.locator("rect.block").count() == 8


def test_gpt2_training_report_in_the_browser(gpt2_reports, page) -> None:
    document, report = gpt2_reports["training"]
    opened = _render(page, report)
    phases = opened.locator("#time .phases svg text").all_text_contents()
    for name, phase in document["cost"]["phases"].items():
        assert phases[phases.index(name) + 1] == ms(phase["time_s"])
    kinds = {
        row.get_attribute("data-kind"): row.locator("td").nth(1).inner_text()
        for row in opened.locator("#memory table.live tr[data-kind]").all()
    }
    expected = {k: format_bytes(v) for k, v in document["cost"]["memory_by_kind"].items() if v}
    assert kinds == expected
    rows = opened.locator("#recipes table.recipes tr").all_inner_texts()
    assert [row.split("\t")[0] for row in rows][2:] == [
        "dp (DDP)", "zero (ZeRO-1/2)", "fsdp (FSDP, ZeRO-3)", "tp-dp (Megatron TP x DP)",
        "tp-fsdp (TP x FSDP)",
    ]  # fmt: skip
    assert opened.locator("#memory svg rect.band-backward").count() >= 1
    rows = opened.locator("#weights table.weights tr[data-copies]")
    told = [r.locator("td").nth(7).inner_text() for r in rows.all()]
    copies = [int(r.get_attribute("data-copies")) for r in rows.all()]
    weights = document["strategy"]["weights"]
    assert sum(copies) == len(weights)
    assert sorted(set(told)) == sorted({Holding(w["strategy"]).words for w in weights.values()})

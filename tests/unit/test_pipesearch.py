"""The search's pipelines: a stage's model cut from the whole, the layers split so the slowest
stage is fastest, the hand layout pinned with annotations, and `--pipeline auto` choosing a
pipeline exactly when it is the fastest plan that fits (against each candidate planned on its
own)."""

from pathlib import Path

import pytest

from autoshard.analysis.shorten import shortened
from autoshard.annotations import Annotation
from autoshard.cli.main import main
from autoshard.cost.cluster import make_cluster
from autoshard.errors import PipelineError
from autoshard.ir.graph import verify
from autoshard.pipeline import PlanRequest, load_graph, plan_request
from autoshard.search.pipelined import balanced_split, pipeline_ask, stage_annotations
from autoshard.sharding import Sharding
from autoshard.training import Training

MODELS = Path(__file__).resolve().parents[2] / "models"
GPT2 = MODELS / "gpt2.onnx"
DIMS = {"batch": 2, "seq": 16}


def test_a_cut_model_is_the_model_built_shorter(tmp_path):
    import sys

    import onnx

    sys.path.insert(0, str(MODELS))
    from make_models import build_decoder_shape_only

    graphs = {}
    for layers in (2, 5):
        built = build_decoder_shape_only(layers, hidden=64, heads=4, kv_heads=2, ffn=128,
                                         vocab=100)  # fmt: skip
        onnx.save(built.proto, tmp_path / f"d{layers}.onnx")
        graphs[layers] = load_graph(tmp_path / f"d{layers}.onnx", {"batch": 2, "seq": 8}, None)
    cut = shortened(graphs[5], 2)
    verify(cut)
    assert [op.type for op in cut.ops] == [op.type for op in graphs[2].ops]
    shapes = [[g.values[v].shape for op in g.ops for v in op.outputs] for g in (cut, graphs[2])]
    assert shapes[0] == shapes[1]
    assert set(cut.weights) == set(graphs[2].weights) and cut.outputs == graphs[2].outputs
    assert shortened(graphs[5], 5) is graphs[5]


@pytest.mark.parametrize(
    ("layers", "stages", "ends", "counts"),
    [
        (10, 4, (0.0, 1.5), [3, 3, 3, 1]),  # the head costs 1.5 layers: the last stage gives
        (10, 4, (0.0, 0.0), [3, 3, 2, 2]),  # as even as can be
        (8, 2, (2.0, 2.0), [4, 4]),
        (
            12,
            3,
            (2.0, 0.0),
            [3, 5, 4],
        ),  # the embedding (2 layers' worth): 5 s, the surplus from the last
        (3, 3, (5.0, 5.0), [1, 1, 1]),  # one layer each at least
    ],
)
def test_balanced_split(layers, stages, ends, counts):
    split = balanced_split(layers, stages, 1.0, *ends)
    assert [len(r) for r in split] == counts
    assert split[0].start == 0 and split[-1].stop == layers


def test_annotations_name_the_whole_mesh():
    mesh = make_cluster("pp=4,dp=2,tp=2").mesh
    w = Annotation("w", Sharding(((2,), (1,))))
    assert stage_annotations([w], 0, mesh) == (Annotation("w", Sharding(((1,), (0,)))),)
    assert stage_annotations([w], 0, mesh, 2) == (w,)  # the axis split: numbers kept
    with pytest.raises(PipelineError, match="uses the pipeline axis 0 of mesh"):
        stage_annotations([Annotation("x", Sharding(((0,),)))], 0, mesh)


def _planned(mesh: str, bandwidth: str, micro_batches: int, pipeline: object = None):
    cluster = make_cluster(mesh, bandwidth=bandwidth)
    ask = pipeline if pipeline is not None else pipeline_ask(cluster.mesh, None, None)
    request = PlanRequest(model_path=GPT2, cluster=cluster, dims=DIMS, pipeline=ask,
                          training=Training(micro_batches=micro_batches))  # fmt: skip
    return cluster, plan_request(request)


def _step(requested) -> float:
    block = requested.document.pipeline
    return block["step_time_s"] if block else requested.planned.cost.objective


@pytest.mark.parametrize(
    ("bandwidth", "micro_batches", "pipelined"),
    # Fast links, 4 micro-batches: each stage runs half the layers' kernels (tiny, priced at
    # their launch) and updates half the weights, in parallel: the pipeline pays. Slow links
    # on axis 0 and a single micro-batch: the stages run one after the other and the
    # boundary's sends over 10 MB/s cost more than that saves.
    [("450GB/s,450GB/s", 4, True), ("10MB/s,450GB/s", 1, False)],
)
def test_auto_pipelines_exactly_when_it_is_fastest(bandwidth, micro_batches, pipelined):
    cluster, none = _planned("2x2", bandwidth, micro_batches)
    _, staged = _planned("pp=2,dp=2", bandwidth, micro_batches)
    auto = pipeline_ask(cluster.mesh, None, None, auto=True)
    _, chosen = _planned("2x2", bandwidth, micro_batches, auto)
    block = chosen.document.pipeline
    assert (block is not None) == pipelined
    assert (_step(staged) < _step(none)) == pipelined
    assert _step(chosen) == pytest.approx(min(_step(staged), _step(none)), rel=1e-9)
    story = chosen.document.story
    assert ("chosen over no pipeline: " in story) == pipelined
    assert ("chosen over 2 stages (" in story) != pipelined
    considered = block["considered"] if block else None
    if considered:
        assert [c["stages"] for c in considered] == [1, 2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--mesh", "pp=4,dp=1"],
            "pipeline axis 0 has 4 stages but the model has 2 repeated "
            "layers; choose a pipeline axis of at most 2",
        ),
        (
            ["--mesh", "pp=2,dp=1", "--schedule", "zigzag"],
            "unknown schedule 'zigzag'; choose one of: gpipe, 1f1b, interleaved[:V], zb-h1",
        ),
        (
            ["--mesh", "pp=2,dp=1", "--micro-batches", "3", "--schedule", "interleaved"],
            "interleaved schedule needs micro-batches divisible by the 2 stages, got 3",
        ),
        (
            ["--mesh", "pp=2,dp=2", "--annotate", "input_ids=[[0]]"],
            "annotation input_ids=[[0]] (required, for result) uses the pipeline axis 0",
        ),
    ],
)
def test_refusals_are_one_line(argv, message, capsys):
    base = ["plan", str(GPT2), "--mode", "training", "--dim", "batch=2", "--dim", "seq=16",
            "-q"]  # fmt: skip
    assert main(base + argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_report_explain_and_diff_show_the_stages(tmp_path, page, capsys):
    plan, html = tmp_path / "p.json", tmp_path / "r.html"
    flags = ["--mode", "training", "--dim", "batch=2", "--dim", "seq=16", "--micro-batches",
             "4", "--schedule", "gpipe", "-q"]  # fmt: skip
    argv = ["plan", str(GPT2), "--mesh", "pp=2,dp=2", *flags, "-o", str(plan), "--html", str(html)]
    assert main(argv) == 0
    other = tmp_path / "none.json"
    assert main(["plan", str(GPT2), "--mesh", "2x2", *flags[:-3], "-q", "-o", str(other)]) == 0
    capsys.readouterr()
    opened, console = page
    opened.goto(html.as_uri())
    stages = opened.locator("#stages")
    assert stages.locator("table.stages tr").count() == 1 + 2
    # GPipe, 2 stages, 4 micro-batches: 8 passes a stage, and each stage's update after them.
    assert stages.locator("figure.timeline svg rect").count() == 2 * 8 + 2
    assert "stages over mesh pp=2,dp=2 (axis 0), schedule gpipe, 4 micro-batches" in (
        stages.inner_text()
    )
    assert console.errors == []
    # explain reads the plan back on the stage's model; its op stands for every stage's copy.
    assert main(["explain", str(plan), "/lm/lm_head/MatMul", "--model", str(GPT2)]) == 0
    out = capsys.readouterr().out
    assert "  pipeline: 2 stages (layers 0..0 1..1) on mesh pp=2,dp=2, gpipe, 4 micro-batches" in (
        out
    )
    assert main(["diff", str(other), str(plan)]) == 0
    out = capsys.readouterr().out
    assert "pipeline A: none\npipeline B: 2 stages (layers 0..0 1..1) on mesh pp=2,dp=2" in out


def test_a_hand_layout_is_pinned_with_a_pipeline():
    # Mesh pp=2,dp=2,tp=2: the MLP's first weight split by column over tp (axis 2 of the whole
    # mesh) is held so in each stage's plan, where tp is axis 1 of the stage's dp=2,tp=2.
    cluster = make_cluster("pp=2,dp=2,tp=2")
    weight = "lm.transformer.h.0.mlp.c_fc.weight"
    pinned = Annotation(weight, Sharding(((), (2,))))
    request = PlanRequest(model_path=GPT2, cluster=cluster, dims=DIMS, annotations=(pinned,),
                          pipeline=pipeline_ask(cluster.mesh, None, None),
                          training=Training(micro_batches=4))  # fmt: skip
    requested = plan_request(request)
    assert str(requested.planned.plan.mesh) == "dp=2,tp=2"
    assert requested.planned.plan.values[weight] == Sharding(((), (1,)))
    assert requested.document.pipeline is not None

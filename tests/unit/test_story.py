"""The strategy in words (document.story) of hand plans whose strategy is known (the baselines
and annotations pin it), on the bundled GPT-2 and BERT, for forward and training plans; and
`autoshard diff` of two plans (autoshard.explain.diff), with the report's link to it."""

import dataclasses
import functools
import json
from pathlib import Path

import pytest

from autoshard.analysis.repeats import find_repeats
from autoshard.annotations import Annotation
from autoshard.cli.main import main
from autoshard.cost.cluster import make_cluster
from autoshard.cost.price import price
from autoshard.document.blocks import RepeatedLayers, SearchFigures
from autoshard.document.plan_document import model_info, plan_document, write_document
from autoshard.document.story import Role, strategy_story
from autoshard.explain.diff import diff_plans, diff_text
from autoshard.mesh import Mesh
from autoshard.passes.materialize import materialize
from autoshard.pipeline import load_graph
from autoshard.plan import plan_from_options
from autoshard.propagate import propagate
from autoshard.search.baselines import data_parallel, dp_tp, megatron
from autoshard.sharding import Sharding
from autoshard.training import Training

MODELS = Path(__file__).resolve().parents[2] / "models"
DIMS = {"batch": 4, "seq": 8}
TRAINING = Training.parse("adam", "bf16-mixed", 1, "none")
DP, TP, DPTP = Mesh.parse("dp=2"), Mesh.parse("tp=2"), Mesh.parse("dp=2,tp=2")


@functools.cache
def graph(name, training=None):
    return load_graph(MODELS / f"{name}.onnx", DIMS, training)


def story(name, mesh, annotations, training=None):
    g = graph(name, training)
    plan = propagate(g, mesh, annotations)
    return strategy_story(g, plan, materialize(g, plan).collectives_json())


def sequence_parallel(name, mesh):
    """dp_tp with every LayerNormalization's result split on the sequence over tp."""
    g = graph(name)
    norms = [op.outputs[0] for op in g.ops if op.type == "LayerNormalization"]
    return dp_tp(g, mesh, 0, 1) + [Annotation(v, Sharding(((0,), (1,)))) for v in norms]


LAYERS_TP = (
    "In each of the 2 repeated layers: Megatron column->row split of the MLP{mlp} over axis tp; "
    "Megatron column->row split of the attention{attention} over axis tp. Outside the layers: "
    "the embedding table ({table}) split by vocabulary over axis tp."
)
WEIGHTS = {
    "gpt2": "Weights: 19 replicated, 20% of the weight bytes; 10 split (tensor parallel), 80% of "
    "the weight bytes.",
    "bert": "Weights: 21 split (tensor parallel), 91% of the weight bytes; 16 replicated, 9% of "
    "the weight bytes.",
}
# The story names blocks and tables by parameter names, here the initializers' (BERT's
# projections read `onnx::MatMul_*` initializers: no module is named for them).
NAMED = {
    "gpt2": {"mlp": " (lm.transformer.h.*.mlp)",
             "attention": " (lm.transformer.h.*.attn, fused QKV computed whole)",
             "table": "lm.transformer.wte.weight"},
    "bert": {"mlp": "", "attention": "", "table": "bert.embeddings.word_embeddings.weight"},
}  # fmt: skip
BATCH = "Batch split over mesh axis dp (data parallel)."


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_data_parallel(name):
    replicated = {"gpt2": 29, "bert": 37}[name]
    assert story(name, DP, data_parallel(graph(name), DP)) == (
        f"{BATCH} Weights: {replicated} replicated, 100% of the weight bytes."
    )


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_megatron(name):
    assert story(name, TP, megatron(graph(name), TP, 0)) == (
        LAYERS_TP.format(**NAMED[name]) + " " + WEIGHTS[name]
    )


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_dp_tp(name):
    assert story(name, DPTP, dp_tp(graph(name), DPTP, 0, 1)) == (
        f"{BATCH} {LAYERS_TP.format(**NAMED[name])} {WEIGHTS[name]}"
    )


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_sequence_parallel(name):
    text = story(name, DPTP, sequence_parallel(name, DPTP))
    seq = "norms and elementwise ops split on the sequence over axis tp (sequence parallel)"
    attention = NAMED[name]["attention"]
    # in the layers and outside them: told once
    assert (
        f"Megatron column->row split of the attention{attention} over axis tp; {seq}, also "
        "outside the layers. Outside the layers: the embedding table"
    ) in text
    assert text.count("sequence") == 2  # "split on the sequence", "(sequence parallel)"
    # dp_tp alone splits no sequence
    assert "sequence" not in story(name, DPTP, dp_tp(graph(name), DPTP, 0, 1))


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_fsdp(name):
    """Data parallel with every weight whose rows divide held split over dp: gathered before
    use. The embedding is read whole, so it is no vocabulary split."""
    g = graph(name)
    plan = propagate(g, DP, data_parallel(g, DP))
    rows = {w: g.values[w].shape[:1] for w in g.weights if w not in g.constants}
    held = {w: Sharding(((0,),)) for w, dim in rows.items() if dim and dim[0] % 2 == 0}
    plan = plan_from_options(g, DP, plan.options, held)
    held_split = {"gpt2": 29, "bert": 37}[name]
    assert strategy_story(g, plan) == (
        f"{BATCH} Weights: {held_split} sharded, gathered for use (FSDP/ZeRO-3), 100% of the "
        "weight bytes."
    )


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_training(name):
    """A training step: patterns on its forward (the backward reads the activations too), the
    weights by strategy; a replicated weight's gradient is all-reduced only with a batch split,
    and only then do the words (and the recorded key, `ddp`) say so."""
    g = graph(name)
    dp = story(name, DP, data_parallel(g, DP), TRAINING)
    tp = story(name, TP, megatron(g, TP, 0), TRAINING)
    both = story(name, DPTP, dp_tp(g, DPTP, 0, 1), TRAINING)
    replicated, split = {"gpt2": (29, 10), "bert": (37, 21)}[name]
    exported = (
        "Attention: 2 cores priced op by op as exported, their SxS scores kept for the backward."
    )
    assert dp == (
        f"{BATCH} Weights: {replicated} replicated, gradients all-reduced (DDP). {exported}"
    )
    assert tp.startswith(LAYERS_TP.format(**NAMED[name]))
    # GPT-2's row-parallel Gemms add their bias to the partial sums: the bias's gradient is
    # partial over tp and all-reduced, the one replicated gradient synchronized without a batch
    synced = "replicated, gradients all-reduced (DDP)"
    told = {"gpt2": f"15 replicated; 10 split (tensor parallel); 4 {synced}",
            "bert": "21 split (tensor parallel); 16 replicated"}[name]  # fmt: skip
    assert tp.endswith(f" Weights: {told}. {exported}")
    assert both.startswith(f"{BATCH} {LAYERS_TP.format(**NAMED[name])}")
    told = {"gpt2": f"19 {synced}; 10 split (tensor parallel)",
            "bert": f"21 split (tensor parallel); 16 {synced}"}[name]  # fmt: skip
    assert both.endswith(f" Weights: {told}. {exported}")


def test_nothing_split():
    assert story("gpt2", DP, []) == (
        "Nothing is split: every device computes everything. "
        "Weights: 29 replicated, 100% of the weight bytes."
    )


def test_nothing_split_in_training_syncs_no_gradient():
    """No batch split: every device computes the same gradient, so none is all-reduced and
    the weights are `replicated`, in the words and in the recorded key."""
    from autoshard.training.strategy import weight_strategies

    g = graph("gpt2", TRAINING)
    plan = propagate(g, DP, [])
    assert strategy_story(g, plan) == (
        "Nothing is split: every device computes everything. Weights: 29 replicated. "
        "Attention: 2 cores priced op by op as exported, their SxS scores kept for the backward."
    )
    assert {s["strategy"] for s in weight_strategies(g, plan).values()} == {"replicated"}


# ---- diff ---------------------------------------------------------------------------------------


def document(name, mesh, annotations):
    g = graph(name)
    plan = propagate(g, mesh, annotations)
    program = materialize(g, plan)
    cluster = make_cluster(str(mesh), "h100", None, None, None, None)
    doc = plan_document(g, cluster, plan, program, price(program, g, cluster),
                        model_info(MODELS / f"{name}.onnx", g, DIMS))  # fmt: skip
    repeats = find_repeats(g)
    layers = RepeatedLayers(repeats.start, repeats.period, repeats.count)
    return dataclasses.replace(doc, search=SearchFigures(0, 0, 0, 0, layers))


def test_diff_of_a_plan_with_itself_is_empty():
    doc = document("gpt2", DPTP, dp_tp(graph("gpt2"), DPTP, 0, 1))
    diff = diff_plans(doc, doc)
    assert diff["changed"] == []
    assert diff["collectives"] == {"added": [], "removed": []}
    assert all(c["delta"] == 0 for c in diff["cost"].values())
    assert "no op or weight changed its sharding" in diff_text(diff)


def test_diff_data_parallel_to_dp_tp():
    """Adding Megatron over tp to data parallel: per layer, the same ops and weights change
    (told once for both layers); the all_reduces Megatron needs are added (one for the
    embedding, two per layer, see test_baselines)."""
    g = graph("gpt2")
    a = document("gpt2", DPTP, data_parallel(g, DPTP, (0,)))
    b = document("gpt2", DPTP, dp_tp(g, DPTP, 0, 1))
    diff = diff_plans(a, b)
    wheres = [group["where"] for group in diff["changed"]]
    assert wheres == ["layers 0-1 (each alike; names of layer 0)", "outside the layers"]
    layer = diff["changed"][0]["changes"]
    held = {e["name"]: (e["a"], e["b"]) for e in layer if e["kind"] == "held"}
    assert held["lm.transformer.h.0.mlp.c_fc.weight"] == ("[[], []]", "[[], [1]]")
    assert held["lm.transformer.h.0.mlp.c_proj.weight"] == ("[[], []]", "[[1], []]")
    assert all("h.0" in e["name"] for e in layer)
    added = [(c["kind"], c["value"], c["mesh_axes"]) for c in diff["collectives"]["added"]
             if c["kind"] == "all_reduce"]  # fmt: skip
    top = "/lm/transformer"
    assert sorted(added) == sorted(
        [("all_reduce", f"{top}/wte/Gather_output_0", [1])]
        + [("all_reduce", f"{top}/h.{i}/{m}/c_proj/Gemm_output_0", [1])
           for i in range(2) for m in ("attn", "mlp")]
    )  # fmt: skip
    assert diff["collectives"]["removed"] == []
    cost = diff["cost"]
    assert cost["memory_bytes_per_device"]["delta"] < 0  # weights split
    assert cost["comm_bytes_per_device"]["a"] == 0 < cost["comm_bytes_per_device"]["b"]
    assert cost["objective"]["delta"] == pytest.approx(
        cost["objective"]["b"] - cost["objective"]["a"]
    )


def test_cli_diff_and_report_link(tmp_path, capsys):
    g = graph("gpt2")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_document(a, document("gpt2", DPTP, data_parallel(g, DPTP, (0,))))
    write_document(b, document("gpt2", DPTP, dp_tp(g, DPTP, 0, 1)))
    assert main(["diff", str(a), str(b), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["changed"] and data["same_model"]
    assert main(["diff", str(a), str(a)]) == 0
    assert "collectives added: 0" in capsys.readouterr().out
    assert main(["diff", str(a), str(tmp_path / "none.json")]) == 2
    # b communicates where a did not: a regression, and the report names the diff to run
    assert main(["report", "--baseline", str(a), "--current", str(b)]) == 1
    out = capsys.readouterr().out
    assert f"`autoshard diff {a} {b}`" in out
    assert main(["report", "--baseline", str(a), "--current", str(b), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["diffs"][0]["command"] == f"autoshard diff {a} {b}"


def test_story_in_document_and_report():
    from autoshard.explain.report import plan_markdown

    doc = document("bert", DPTP, dp_tp(graph("bert"), DPTP, 0, 1))
    assert doc.story == f"{BATCH} {LAYERS_TP.format(**NAMED['bert'])} {WEIGHTS['bert']}"
    assert plan_markdown(doc).split("\n")[2] == doc.story


def test_ulysses():
    """Norms split on the sequence and attention on heads over one axis: the program turns
    sequence into heads and back with all_to_alls around each attention (Ulysses)."""
    from autoshard.analysis.patterns import _head_reshapes, find_projections

    g, mesh = graph("bert"), Mesh.parse("sp=2")
    norms = [op.outputs[0] for op in g.ops if op.type == "LayerNormalization"]
    heads = [g.op_by_name[r].outputs[0] for p in find_projections(g).values()
             for r, _ in _head_reshapes(g, p)[0]]  # fmt: skip
    annotations = [Annotation(v, Sharding(((), (0,)))) for v in norms]
    annotations += [Annotation(v, Sharding(((), (), (0,)))) for v in heads]
    text = story("bert", mesh, annotations)
    assert text.startswith(
        "In each of the 2 repeated layers: norms and elementwise ops split on the sequence over "
        "axis sp (sequence parallel), also outside the layers; heads<->sequence all_to_all "
        "around the attention over axis sp (Ulysses). Weights: "
    )
    assert text.count("split on the sequence") == 1
    assert "Ulysses" not in story("bert", mesh, annotations[: len(norms)])


# ---- breakdown ----------------------------------------------------------------------------------


@pytest.mark.parametrize("training", [None, TRAINING], ids=["forward", "training"])
def test_breakdown_adds_up(training):
    """The breakdown regroups the cost: the layers and the rest add up to the plan's compute
    and communication time; one layer is the count's share of all layers (the layers are
    alike); the top collectives are the costliest, most first."""
    from autoshard.document.breakdown import breakdown

    g = graph("gpt2", training)
    plan = propagate(g, DPTP, dp_tp(graph("gpt2"), DPTP, 0, 1))
    program = materialize(g, plan)
    cost = price(program, g, make_cluster(str(DPTP), "h100", None, None, None, None))
    block = breakdown(g, program, cost)
    runs = block["repeated_layers"]
    phases = [run["phase"] for run in runs]
    assert phases == (["forward"] if training is None else sorted(phases, key=phases.index))
    assert "forward" in phases and all(run["layers"] == 2 for run in runs)
    parts = [run["all_layers"] for run in runs] + [block["rest"]]
    assert sum(p["compute_s"] for p in parts) == pytest.approx(cost.compute_time_s)
    comm = sum(t for p in parts for t in p["comm_s_by_mesh_axes"].values())
    assert comm == pytest.approx(cost.comm_time_s)
    forward = runs[phases.index("forward")]
    assert 2 * forward["one_layer"]["compute_s"] == pytest.approx(
        forward["all_layers"]["compute_s"]
    )
    times = [c["time_s"] for c in block["top_collectives"]]
    assert times == sorted(times, reverse=True) and len(times) == min(5, len(cost.collectives))
    assert times[0] == max(c.seconds for c in cost.collectives)
    assert sum(block["compute_s_by_op_type"].values()) == pytest.approx(cost.compute_time_s)
    # The memory at the peak: the layers and the rest hold it all, exactly (bytes).
    held = [run["memory_at_peak"]["all_layers"] for run in runs]
    held.append(block["rest"]["memory_at_peak"])
    assert sum(sum(h.values()) for h in held) == cost.memory_bytes_per_device
    by_kind = block["memory_peak"]["by_kind"]
    assert sum(by_kind.values()) == block["memory_peak"]["bytes_per_device"]
    if training is not None:
        assert by_kind == cost.memory_by_kind


def test_story_names_blocks_by_parameter_names():
    """BERT's projections read `onnx::MatMul_*` initializers; the source model's parameter
    names (recovered from the nodes' module scopes) name their blocks, a layer's index `*`."""
    from autoshard.names import parameter_names

    g = graph("bert")
    plan = propagate(g, DPTP, dp_tp(g, DPTP, 0, 1))
    names = parameter_names(MODELS / "bert.onnx")
    text = strategy_story(g, plan, materialize(g, plan).collectives_json(), names)
    assert text == (
        f"{BATCH} "
        + LAYERS_TP.format(
            mlp=" (bert.encoder.layer.*)", attention=" (bert.encoder.layer.*.attention)",
            table="bert.embeddings.word_embeddings.weight",
        )
        + f" {WEIGHTS['bert']}"
    )  # fmt: skip


def test_variants_of_one_idea_are_told_once():
    """Norms split on the sequence over axis a in layer 0 and over b in layer 1: propagation
    carries both splits through the elementwise ops of both layers, and the story names the
    idea once with its two variants, where each is found (each layer's attention computes its
    query rows split as its norm's sequence is: context parallel)."""
    g, mesh = graph("bert"), Mesh.parse("a=2,b=2")
    norms = [op for op in g.ops if op.type == "LayerNormalization"]
    annotations = [Annotation(op.outputs[0], Sharding(((), (1 if "layer.0" in op.name else 0,))))
                   for op in norms]  # fmt: skip
    assert story("bert", mesh, annotations) == (
        "In each of the 2 repeated layers: norms and elementwise ops split on the sequence "
        "(sequence parallel) over axis a (every layer and outside), axis b (every layer); "
        "context parallel attention (all-gather K/V) over axis a (1 layer), axis b (1 layer). "
        "Weights: 37 replicated, 100% of the weight bytes."
    )


def test_variants_found_in_some_layers():
    """The words of findings in some of the layers (as a tight budget's plan makes them: other
    axes in other layers), checked on findings set by hand on the 2-layer GPT-2."""
    from autoshard.document.story import _Findings

    g = graph("gpt2")
    findings = _Findings(g, DPTP, {}, None)
    first, second = (next(op.name for op in g.ops if f"/h.{i}/" in op.name) for i in (0, 1))
    outside = "/lm/transformer/wte/Gather"
    sequence = ("elementwise ops split on the sequence", "sequence parallel")
    mlp = ("Megatron column->row split of the MLP (h.*.mlp)", "")
    table = ("the embedding table (wte) split by vocabulary", "")
    findings.add(sequence, frozenset({1}), [first, outside], Role.SEQUENCE)
    findings.add(sequence, frozenset({0, 1}), [second], Role.SEQUENCE)
    findings.add(mlp, frozenset({1}), [second], Role.TENSOR)
    findings.add(table, frozenset({1}), [outside], Role.VOCABULARY)
    assert (findings.layer(first), findings.layer(second), findings.layer(outside)) == (0, 1, None)
    assert findings.sentences() == [
        "In each of the 2 repeated layers: elementwise ops split on the sequence (sequence "
        "parallel) over axis tp (1 layer and outside), axes dp, tp (1 layer).",
        "In 1 of the 2 repeated layers: Megatron column->row split of the MLP (h.*.mlp) over "
        "axis tp.",
        "Outside the layers: the embedding table (wte) split by vocabulary over axis tp.",
    ]


def test_variants_without_repeated_layers_count_their_ops():
    """With no repeated layers, an idea's variants say how many ops each was found in."""
    from autoshard.document.story import _Findings

    g = graph("gpt2")
    findings = _Findings(g, DPTP, {}, None)
    findings.run = None  # as in a model with no repeated layers
    sequence = ("elementwise ops split on the sequence", "sequence parallel")
    ops = [op.name for op in g.ops[:3]]
    findings.add(sequence, frozenset({1}), ops[:2], Role.SEQUENCE)
    findings.add(sequence, frozenset({0}), ops[2:], Role.SEQUENCE)
    assert findings.sentences() == [
        "Throughout: elementwise ops split on the sequence (sequence parallel) over axis tp "
        "(2 ops), axis dp (1 op)."
    ]
    assert findings.roles == {0: {Role.SEQUENCE}, 1: {Role.SEQUENCE}}


def test_a_loss_gradient_split_alone_is_no_data_parallelism(tmp_path):
    """models/mlp.onnx trained Megatron-wise over tp, its batch whole: the row-parallel Gemm's
    partial output is reduce-scattered over tp into the loss gradient (split on the batch
    there alone), then gathered again. The forward splits no batch: no data parallelism told."""
    (tmp_path / "mlp.onnx").write_bytes((MODELS / "mlp.onnx").read_bytes())
    pins = [
        ("0.weight", "[[1], []]", "result"),
        ("/0/Gemm_output_0", "[[], [1]]", "result"),
        ("/1/Relu_output_0", "[[], [1]]", "users"),
        ("x", "[[], []]", "result"),
    ]
    notes = tmp_path / "annotations.json"
    notes.write_text(json.dumps({"annotations": [
        {"value": v, "sharding": s, "required": True, "for": f} for v, s, f in pins
    ]}))  # fmt: skip
    path = tmp_path / "plan.json"
    argv = ["plan", str(tmp_path / "mlp.onnx"), "--mesh", "dp=2,tp=2", "--dim", "batch=8",
            "--mode", "training", "--annotations", str(notes), "-o", str(path)]  # fmt: skip
    assert main(argv) == 0
    document = json.loads(path.read_text())
    found = {(c["value"], c["user"], c["kind"], tuple(c["mesh_axes"]))
             for c in document["collectives"]}  # fmt: skip
    assert ("y", "y@loss_grad", "reduce_scatter", (1,)) in found
    assert document["story"].startswith(
        "Throughout: Megatron column->row split of the MLP over axis tp. Weights:"
    )

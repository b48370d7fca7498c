"""`autoshard explain`: who decided a value's or op's sharding (annotation, search, the chain a
follower follows), what it costs, and `--why-not` (the plan's search asked again with one more
sharding pinned); the memory at the peak per repeated layer (breakdown); the story's batch
split found through Reshapes."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from onnx import helper

from autoshard.annotations import Annotation
from autoshard.cli.main import main
from autoshard.cost.cluster import make_cluster, recorded_flags
from autoshard.cost.price import price
from autoshard.document.breakdown import breakdown
from autoshard.document.plan_document import write_document
from autoshard.document.story import strategy_story
from autoshard.explain.saved import ExplainError, decided_by, explain, explain_text, load_saved
from autoshard.explain.whynot import Verdict, why_not
from autoshard.holding import Holding
from autoshard.mesh import Mesh
from autoshard.passes.materialize import materialize
from autoshard.pipeline import PlanRequest, load_graph, plan_request
from autoshard.propagate import propagate
from autoshard.sharding import Sharding
from autoshard.training.options import Optimizer, Training
from tests.unit.onnx_factory import F32, model, reshapes, rng_weight, save, tensor

MODELS = Path(__file__).resolve().parents[2] / "models"
GPT2 = MODELS / "gpt2.onnx"
MLP = MODELS / "mlp.onnx"
H1 = "/lm/transformer/h.1"


def on_memory(memory):
    """`autoshard explain --memory MEMORY`'s cluster on a plan's mesh (None: no flag)."""
    return None if memory is None else (lambda mesh: make_cluster(str(mesh), memory=memory))


def saved_plan(directory: Path, path: Path, mesh: str, dims: dict, memory=None, annotations=()):
    request = PlanRequest(model_path=path, cluster=make_cluster(mesh, memory=memory), dims=dims,
                          annotations=tuple(annotations))  # fmt: skip
    out = directory / f"{path.stem}.json"
    write_document(out, plan_request(request).document)
    return load_saved(str(out), path, on_memory(memory))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """GPT-2 on 2x4 (2 repeated layers), as `autoshard plan` finds it, planned once for the
    module."""
    return saved_plan(tmp_path_factory.mktemp("gpt2"), GPT2, "2x4", {"batch": 8, "seq": 128})


@pytest.fixture(scope="module")
def gpt2_why_not(gpt2):
    """Why not the MLP's first projection of layer 1 split on its output features over axis 0
    (Megatron's column split): the plan splits it on the batch (a solve, made once)."""
    return why_not(gpt2, f"{H1}/mlp/c_fc/Gemm_output_0=[[], [0]]")


def test_why_not_gpt2_value(gpt2, gpt2_why_not):
    answer, target = gpt2_why_not
    assert answer["verdict"] in (Verdict.CHOSEN_CHEAPER, Verdict.SAME_COST)
    objective = answer["objective"]
    assert objective["target"] >= objective["chosen"] == gpt2.document.cost.objective
    assert objective["target"] == target.cost.objective
    assert objective["delta"] == objective["target"] - objective["chosen"]
    # The pin holds in layer 1 only: an annotated op of a repeated layer is decided on its own.
    assert target.values[f"{H1}/mlp/c_fc/Gemm_output_0"].sharding == "[[], [0]]"
    assert target.ops[f"{H1}/mlp/c_fc/Gemm"].sharding_option == "[[], [0]]"
    changed = {e["name"]: (e["a"], e["b"]) for group in answer["changed"]
               for e in group["changes"]}  # fmt: skip
    assert changed[f"{H1}/mlp/c_fc/Gemm"] == ("[[0, 1]]", "[[], [0]]")
    assert "layer 1" in [group["where"] for group in answer["changed"]]
    for key in ("memory_bytes_per_device", "comm_bytes_per_device", "objective"):
        cost = answer["cost"][key]
        assert cost["a"] == getattr(gpt2.document.cost, key) and cost["b"] == getattr(
            target.cost, key
        )


def test_why_not_op_equals_value(gpt2, gpt2_why_not):
    """Pinning the op to the option that writes that sharding is the same question."""
    answer, _ = why_not(gpt2, f"{H1}/mlp/c_fc/Gemm=[[], [0]]")
    assert answer["kind"] == "op"
    assert answer["annotations"] == [{"value": f"{H1}/mlp/c_fc/Gemm_output_0",
                                      "sharding": "[[], [0]]", "required": True,
                                      "for": "result"}]  # fmt: skip
    assert answer["objective"] == gpt2_why_not[0]["objective"]


def test_why_not_weight_of_a_later_layer(gpt2):
    """A weight of layer 1 pinned alone (its copy in layer 0 stays the search's; this crashed
    the search's build when the annotated weight shared its copies' key)."""
    answer, target = why_not(gpt2, "lm.transformer.h.1.mlp.c_fc.weight=[[], [1]]")
    assert answer["verdict"] in (Verdict.CHOSEN_CHEAPER, Verdict.SAME_COST)
    values = target.values
    assert values["lm.transformer.h.1.mlp.c_fc.weight"].sharding == "[[], [1]]"
    before = gpt2.document.values["lm.transformer.h.0.mlp.c_fc.weight"]
    assert values["lm.transformer.h.0.mlp.c_fc.weight"] == before


def test_why_not_no_rule_option(gpt2):
    """Softmax's axis is no loop to split: refused before any solve, naming what it can do."""
    softmax = "/lm/transformer/h.0/attn/Softmax"
    answer, target = why_not(gpt2, f"{softmax}_output_0=[[], [], [], [0]]")
    assert target is None and answer["verdict"] == Verdict.INFEASIBLE
    assert answer["reason"].startswith(
        f"no rule option: no option of op {softmax} (Softmax) writes {softmax}_output_0 as "
        "[[], [], [], [0]]; it can write [[], [], [], []], [[1], [], [], []]"
    )
    answer, _ = why_not(gpt2, f"{softmax}=[[], [], [], [0]]")
    assert answer["reason"] == (
        f"no rule option: loop d3 of op {softmax} (Softmax) (invalid(128)) cannot be split"
    )


def test_why_not_infeasible_memory(tmp_path):
    """On 80 KB per device the MLP's first weight must be split; held whole (64 KiB) no plan
    fits, and the answer gives the lowest budget that does."""
    saved = saved_plan(tmp_path, MLP, "2x2", {"batch": 8}, memory="80KB")
    answer, target = why_not(saved, "0.weight=[[], []]")
    assert target is None and answer["verdict"] == Verdict.INFEASIBLE
    assert answer["reason"].startswith(
        "memory: infeasible budget: no plan fits 80000 bytes (78.12 KiB) per device; the lowest "
        "feasible budget is 87040 bytes"
    )
    # 64 KiB of 0.weight, 16 KiB of 2.weight split over one axis, the activations of the peak
    assert answer["reason"].endswith(
        "0.weight (64.00 KiB), 2.weight (16.00 KiB), /0/Gemm_output_0 (2.00 KiB), "
        "/1/Relu_output_0 (2.00 KiB), x (512 B)"
    )


def test_explain_reads_the_plans_cluster(tmp_path, capsys):
    """A plan made with --memory 80KB is explained, and --why-not solved again, on 80 KB
    without repeating the flag: its device is a preset, so its cluster block says it all."""
    saved = saved_plan(tmp_path, MLP, "2x2", {"batch": 8}, memory="80KB")
    again = load_saved(saved.path, MLP)
    assert again.cluster.to_json() == saved.cluster.to_json()
    assert again.request.cluster.memory == 80000
    answer, _ = why_not(again, "0.weight=[[], []]")
    assert answer["reason"].startswith(
        "memory: infeasible budget: no plan fits 80000 bytes (78.12 KiB) per device"
    )
    assert main(["explain", saved.path, "--model", str(MLP), "0.weight"]) == 0
    assert capsys.readouterr().out.startswith("value 0.weight (")


def test_recorded_flags_make_the_cluster_again():
    made = make_cluster("2x4", "a100", "25GB/s,450GB/s", None, "2GiB").to_json()
    flags = recorded_flags(made)
    assert flags == {"device": "a100", "bandwidth": "25000000000.0B/s,450000000000.0B/s",
                     "memory": "2147483648"}  # fmt: skip
    assert flags is not None and make_cluster("2x4", **flags).to_json() == made
    assert recorded_flags(make_cluster("4x8").to_json()) == {}
    # a calibrated device is no preset: its cluster file must be given again
    assert recorded_flags({**made, "device": "calibrated CPU"}) is None


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("/lm/transformer/h.0/attn/Softmx=[[0]]",
         "--why-not '/lm/transformer/h.0/attn/Softmx=[[0]]': the model has no value, op or "
         "parameter named '/lm/transformer/h.0/attn/Softmx'; closest: "
         "/lm/transformer/h.0/attn/Softmax, /lm/transformer/h.1/attn/Softmax, "
         "/lm/transformer/h.0/attn/Split"),
        ("input_ids=[[5]]",
         "annotation of 'input_ids': unknown mesh axis 5 in [[5]]; mesh @mesh0 has axes 0..1"),
        ("input_ids=[[0],",
         "--why-not input_ids: invalid sharding '[[0],': expected '[' at column 6; write e.g. "
         "[[0], [1, 2]] partial = sum[1]"),
        ("input_ids", "--why-not 'input_ids': unknown recipe 'input_ids'; choose one of: dp, "
         "tp-dp; or give NAME=SHARDING (e.g. 'x=[[0], []]')"),
        ("zero", "--why-not 'zero': recipe zero is a training layout and this plan is "
         "inference; choose one of: dp, tp-dp; or give NAME=SHARDING (e.g. 'x=[[0], []]')"),
        ("/lm/lm_head/MatMul=[[0], [0]]", "--why-not /lm/lm_head/MatMul: mesh axis 0 splits on "
         "dims 0 and 1 in [[0], [0]]"),
        ("/lm/lm_head/MatMul=[[2]]", "--why-not /lm/lm_head/MatMul: unknown mesh axis 2 in [[2]]; "
         "mesh 2x4 has axes 0..1"),
    ],
    ids=["unknown-name", "bad-axis", "bad-text", "no-spec", "training-recipe", "axis-twice",
         "op-bad-axis"],
)  # fmt: skip
def test_why_not_bad_input(gpt2, target, message):
    with pytest.raises(Exception) as error:
        why_not(gpt2, target)
    assert str(error.value) == message


def test_source_parameter_names(gpt2):
    """The LM head is exported as `onnx::MatMul_592`; its torch name explains the same weight,
    and names it in --why-not too."""
    assert gpt2.parameters["onnx::MatMul_592"] == "lm.lm_head.weight"
    assert explain(gpt2, "lm.lm_head.weight") == explain(gpt2, "onnx::MatMul_592")
    answer, _ = why_not(gpt2, "lm.lm_head.weight=[[], [0]]")
    assert (answer["name"], answer["kind"]) == ("onnx::MatMul_592", "value")
    text = explain_text(explain(gpt2, "onnx::MatMul_592")).splitlines()
    assert text[1] == "  source parameter: lm.lm_head.weight"


def test_weights_held_in_the_storys_words(gpt2):
    """explain says how each weight is held in the story's words: counted over the weights,
    explain's holdings are the story's weights sentence."""
    graph = gpt2.graph
    weights = [w for w in graph.weights if w not in graph.constants]
    counts = Counter(explain(gpt2, w)["holding"] for w in weights)
    told = [f"{n} {Holding(key).words}" for key, n in counts.most_common()]
    story = gpt2.document.story or ""
    assert story[story.index("Weights: ") :].count(";") == len(told) - 1
    assert all(t in story for t in told), (told, story)
    found = explain(gpt2, weights[0])
    words = Holding(found["holding"]).words
    assert f"  held as a weight: {words}" in explain_text(found).splitlines()
    assert explain(gpt2, "/lm/transformer/h.0/attn/MatMul_output_0")["holding"] is None


def test_training_weight_says_its_strategy(tmp_path):
    """A training plan's weight: the strategy the step gives it, as the plan's strategy block
    says (MLP on 2x2 under a budget that splits the optimizer state)."""
    request = PlanRequest(
        model_path=MLP, cluster=make_cluster("2x2", memory="200KB"), dims={"batch": 8},
        training=Training(optimizer=Optimizer.ADAM),
    )  # fmt: skip
    out = tmp_path / "mlp-training.json"
    write_document(out, plan_request(request).document)
    saved = load_saved(str(out), MLP, on_memory("200KB"))
    entry = saved.document.strategy.weights["0.weight"].to_json()
    found = explain(saved, "0.weight")
    assert found["training"] == entry and found["parameter"] == "0.weight"
    assert (entry["strategy"], found["holding"]) == ("tp+zero", "tp+zero")
    lines = explain_text(found).splitlines()
    assert "  held as a weight: split (tensor parallel), optimizer state split further " \
        "(TP+ZeRO-1/2)" in lines  # fmt: skip
    line = (f"  training: stored {entry['stored']}, used {entry['used']}, optimizer state "
            f"{entry['state']}")  # fmt: skip
    assert line in lines
    assert "source parameter" not in explain_text(found)  # the weight's own name


def test_provenance_copy_chain(gpt2):
    """An op of layer 1 follows its copy in layer 0, which follows its producer."""
    found = decided_by(gpt2, f"{H1}/mlp/act/Mul")
    h0 = "/lm/transformer/h.0/mlp"
    assert found["by"] == "follower" and found["leader_by"] == "search"
    assert found["chain"] == [
        {"name": f"{H1}/mlp/act/Mul", "follows": f"{h0}/act/Mul", "tie": "copy"},
        {"name": f"{h0}/act/Mul", "follows": f"{h0}/c_fc/Reshape_1", "tie": "elementwise"},
    ]
    assert found["leader"] == f"{h0}/c_fc/Reshape_1"
    assert found["text"] == (
        f"follower: copy of {h0}/act/Mul (repeated layer), which computes in the sharding of "
        f"its producer {h0}/c_fc/Reshape_1; {h0}/c_fc/Reshape_1: the search chose among "
        f"{found['candidates']} candidates"
    )


@pytest.fixture(scope="module")
def annotated(tmp_path_factory):
    """The MLP planned with its first Gemm's result pinned to [[0], [1]]."""
    pin = Annotation("/0/Gemm_output_0", Sharding.parse("[[0], [1]]"))
    return saved_plan(tmp_path_factory.mktemp("mlp"), MLP, "2x2", {"batch": 8}, None, [pin])


def test_provenance_annotation_and_follower(annotated):
    pin = "/0/Gemm_output_0=[[0], [1]] (required, for result)"
    gemm = decided_by(annotated, "/0/Gemm")
    assert (gemm["by"], gemm["chain"], gemm["candidates"]) == ("annotation", [], 1)
    assert gemm["text"] == f"pinned by {pin}"
    relu = decided_by(annotated, "/1/Relu")
    assert relu["by"] == "follower" and relu["leader"] == "/0/Gemm"
    assert relu["chain"] == [{"name": "/1/Relu", "follows": "/0/Gemm", "tie": "elementwise"}]
    assert relu["text"] == (
        f"follower: computes in the sharding of its producer /0/Gemm; /0/Gemm: pinned by {pin}"
    )
    last = decided_by(annotated, "/2/Gemm")
    assert last["by"] == "search" and last["annotations"] == []
    # A value is decided by its producer; the annotation is recorded in the plan document.
    value = explain(annotated, "/1/Relu_output_0")
    assert value["decided"]["text"] == f"its producer /1/Relu: {relu['text']}"
    assert value["held"] == "[[0], [1]]" and value["producer"] == "/1/Relu"
    assert list(annotated.document.search.asked.annotations) == [
        {"value": "/0/Gemm_output_0", "sharding": "[[0], [1]]", "required": True, "for": "result"}
    ]


def test_why_not_against_the_plans_annotation(annotated):
    answer, target = why_not(annotated, "/0/Gemm_output_0=[[1], [0]]")
    assert target is None and answer["verdict"] == Verdict.INFEASIBLE
    assert answer["reason"] == (
        "the plan's annotations contradict it: conflicting required annotations of "
        "'/0/Gemm_output_0': [[0], [1]] and [[1], [0]]"
    )


def test_why_not_against_the_plans_weight_annotation(tmp_path):
    """A weight pinned by the plan's annotation and asked otherwise: INFEASIBLE (the search
    kept the plan's pin and answered SAME COST, no change)."""
    pin = Annotation("0.weight", Sharding.parse("[[0], []]"))
    saved = saved_plan(tmp_path, MLP, "2x2", {"batch": 8}, None, [pin])
    answer, target = why_not(saved, "0.weight=[[], []]")
    assert target is None and answer["verdict"] == Verdict.INFEASIBLE
    assert answer["reason"] == (
        "the plan's annotations contradict it: conflicting required annotations of "
        "'0.weight': [[0]] and [[]]"
    )


def test_explain_costs(annotated):
    """The second Gemm reads the Relu's [[0], [1]] as [[0], []]: one all_gather over axis 1 of
    a [8, 256] float32 shard of [4, 128] -> [4, 256]: 4 KiB gathered, 2 KiB sent per device."""
    op = explain(annotated, "/2/Gemm")
    (gather,) = op["collectives"]["operands"]
    assert (gather["kind"], gather["value"], gather["mesh_axes"]) == (
        "all_gather",
        "/1/Relu_output_0",
        "[1]",
    )
    assert gather["bytes_per_device"] == 2048
    assert op["comm_by_mesh_axes"] == {"[1]": {"bytes_per_device": 2048,
                                               "time_s": gather["time_s"]}}  # fmt: skip
    entry = annotated.document.ops["/2/Gemm"]
    assert op["compute"] == {
        "flops": entry.flops,
        "bytes": entry.bytes,
        "compute_s": entry.compute_s,
    }
    assert op["compute"]["flops"] == 2 * 4 * 32 * 256  # [4, 256] @ [256, 64 / 2] per device
    value = explain(annotated, "/1/Relu_output_0")
    assert value["collectives"] == [gather]
    assert value["readers"] == [
        {"op": "/2/Gemm", "operand": 0, "reads": "[[0], []]", "resharded": True}
    ]
    assert value["memory"]["bytes_per_device"] == 4 * 128 * 4
    with pytest.raises(ExplainError) as error:
        explain(annotated, "/1/Relu_")
    assert str(error.value) == (
        "the model has no value, op or parameter named '/1/Relu_'; closest: /1/Relu, "
        "/1/Relu_output_0"
    )


def test_cli_explain(annotated, capsys, tmp_path):
    args = ["explain", annotated.path, "--model", str(MLP), "/1/Relu"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("op /1/Relu (Relu, forward): [[0], [1]]\n  decided by: follower")
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["explain"]["decided"]["leader"] == "/0/Gemm"
    target = tmp_path / "target.json"
    assert main([*args, "--why-not", "2.weight=[[], [0]]", "-o", str(target)]) == 0
    out = capsys.readouterr().out
    assert "why not 2.weight=[[], [0]]: CHOSEN CHEAPER" in out
    assert json.loads(target.read_text())["values"]["2.weight"]["sharding"] == "[[], [0]]"
    # another cluster than the plan's: one line naming the difference
    assert main([*args, "--memory", "1GiB"]) == 2
    assert capsys.readouterr().err == (
        f"autoshard: error: plan {annotated.path} was priced with cluster memory_bytes = "
        "77589387264, these flags give 1073741824: give the --device, --bandwidth, --latency, "
        "--memory and --cluster the plan was made with\n"
    )
    assert main(["explain", annotated.path, "--model", str(MLP)]) == 2


# ---- memory at the peak per layer ----------------------------------------------------------------


def two_layers(path: Path) -> Path:
    """x[4, 8] -> Relu -> (MatMul W_k[8, 8] -> Relu) x 2: two repeated layers after a Relu."""
    n = helper.make_node
    nodes = [n("Relu", ["x"], ["p"], name="pre")]
    for k in range(2):
        nodes += [n("MatMul", [["p", "a0"][k], f"W{k}"], [f"h{k}"], name=f"mm{k}"),
                  n("Relu", [f"h{k}"], [["a0", "y"][k]], name=f"relu{k}")]  # fmt: skip
    inits = {f"W{k}": rng_weight((8, 8), k) for k in range(2)}
    proto = model(nodes, [tensor("x", F32, [4, 8])], [tensor("y", F32, [4, 8])], inits)
    return save(proto, path)


def test_memory_per_layer_by_hand(tmp_path):
    """Data parallel on 2 devices: x, each activation 2x8 floats = 64 B per device, each weight
    replicated 256 B; x and the weights live throughout (576 B). Each op's result lives until
    its reader ran, so the peak, 704 B, is first reached at mm0: x, W0, W1, p and h0 live.
    W0 and h0 are layer 0's, W1 layer 1's (its first reader), x and p the rest's."""
    graph = load_graph(two_layers(tmp_path), {}, None)
    mesh = Mesh.parse("2")
    plan = propagate(graph, mesh, [Annotation("x", Sharding.parse("[[0]]"))])
    program = materialize(graph, plan)
    cost = price(program, graph, make_cluster("2", "h100", None, None, None, None))
    block = breakdown(graph, program, cost)
    zero = dict.fromkeys(("gradients", "optimizer_state", "buffers"), 0)
    (layers,) = block["repeated_layers"]
    assert (layers["first_op"], layers["ops_per_layer"], layers["layers"]) == ("mm0", 2, 2)
    assert layers["memory_at_peak"] == {
        "one_layer": {"weights": 256, "activations": 64, "inputs": 0, **zero},
        "one_layer_index": 0,
        "all_layers": {"weights": 512, "activations": 64, "inputs": 0, **zero},
    }
    assert block["rest"]["memory_at_peak"] == {"weights": 0, "activations": 64, "inputs": 64,
                                               **zero}  # fmt: skip
    assert block["memory_peak"]["bytes_per_device"] == cost.memory_bytes_per_device == 704
    assert block["memory_peak"]["at_op"] == "mm0"


# ---- the story's batch split through Reshapes ----------------------------------------------------


@pytest.mark.parametrize(
    ("output", "batch"),
    [("m=[[0]]", True), ("o=[[0]]", True), ("m=[[], [0]]", False), ("o=[[], [0]]", False)],
    ids=["batch-times-seq", "heads", "hidden", "heads-dim"],
)  # fmt: skip
def test_story_batch_after_reshape(tmp_path, output, batch):
    """x is held and read whole (required for its users: nothing splits a graph input); the
    MatMul splitting the rows of [batch*seq, hidden] (m), or the Relu dim 0 of [batch, heads,
    seq, d] (o), after the Reshapes is a batch split; splitting the hidden or heads dim is
    none. Propagated: the split comes after the Reshape that reads x."""
    graph = load_graph(save(reshapes(), tmp_path), {}, None)
    value, _, text = output.partition("=")
    annotations = [
        Annotation("x", Sharding(), for_users=True),
        Annotation(value, Sharding.parse(text)),
    ]
    plan = propagate(graph, Mesh.parse("dp=2"), annotations)
    assert all(not plan.needs[(op.name, 0)].split_axes for op in graph.consumers("x"))
    text = strategy_story(graph, plan)
    assert text.startswith("Batch split over mesh axis dp (data parallel).") == batch


def test_cli_explain_finds_the_model_beside_the_plan(tmp_path, capsys):
    """Without --model, explain finds the plan's model as `autoshard html` does: its
    model.file beside the plan; nowhere to be found, the error says to give --model."""
    model, plan = tmp_path / "mlp.onnx", tmp_path / "plan.json"
    shutil.copyfile(MLP, model)
    assert main(["plan", str(model), "--mesh", "2", "--dim", "batch=8", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["explain", str(plan), "0.weight"]) == 0
    assert capsys.readouterr().out.startswith("value 0.weight (")
    model.unlink()
    assert main(["explain", str(plan), "0.weight"]) == 2
    assert capsys.readouterr().err == (
        f"autoshard: error: plan {plan} was made from mlp.onnx, which is not beside it nor "
        "here: give it with --model\n"
    )

"""Context parallelism: attention's query rows split over a mesh axis, its keys and values
gathered whole (all-gather K/V, Llama 3's context parallelism), priced and chosen by the
search; and the ONNX Attention op priced as the fused kernel it runs as."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from autoshard.annotations import Annotation
from autoshard.cost.attention import attention_cost
from autoshard.cost.cluster import make_cluster
from autoshard.cost.compute import OpCost, op_cost
from autoshard.cost.devices import DEVICES
from autoshard.cost.price import price
from autoshard.errors import ShardingError
from autoshard.ir.onnx_import import import_onnx
from autoshard.passes.lower import lower
from autoshard.pipeline import PlanRequest, load_graph, plan_request
from autoshard.propagate import propagate
from autoshard.rules import rule_for
from autoshard.sharding import Sharding, ShardingOption
from autoshard.training import Attention, Training
from tests.unit.onnx_factory import model, save, tensor

MODELS = Path(__file__).resolve().parents[2] / "models"
H100 = DEVICES["h100"]
F16 = TensorProto.FLOAT16


def attention_op(batch=2, heads=8, kv_heads=2, seq=256, head_dim=64, causal=1, project=False):
    """One ONNX Attention (opset 23), [B, H, S, D] layout, float16; with `project` its query,
    key and value are inputs times one weight [D, D] (something to train)."""
    q, kv = [batch, heads, seq, head_dim], [batch, kv_heads, seq, head_dim]
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], "attention", is_causal=causal)
    given = [f"x{n}" if project else n for n in "qkv"]
    inputs = [tensor(n, F16, shape) for n, shape in zip(given, (q, kv, kv), strict=True)]
    nodes, weights = [node], {}
    if project:
        nodes[:0] = [helper.make_node("MatMul", [f"x{n}", "w"], [n], f"project_{n}") for n in "qkv"]
        weights["w"] = np.eye(head_dim, dtype=np.float16)
    return model(nodes, inputs, [tensor("y", F16, q)], weights, opset=23)


def test_the_attention_op_is_priced_as_a_flash_kernel(tmp_path):
    """B 2, 8 query heads over 2 kv heads, 256 tokens, head dim 64, causal, float16 on an H100,
    queries split over 2 devices: the last shard (rows 128..255) sees 128·128 keys below its
    block and its own 128·129/2 triangle; Q and O of 128 rows, K and V whole."""
    graph = import_onnx(save(attention_op(), tmp_path), {})
    op = graph.op_by_name["attention"]
    cluster = make_cluster(mesh="2", device="h100")
    option = ShardingOption(((), (), (), (0,), (), ()))
    cost = op_cost(op, rule_for(op, graph), option, graph, cluster)
    pairs = 128 * 128 + 128 * 129 // 2
    flops = 2 * 2 * 2 * 8 * pairs * 64
    assert cost.flops == flops == 100_925_440
    q, kv = 2 * 8 * 128 * 64, 2 * 2 * 256 * 64
    assert cost.bytes == 2 * (2 * q + 2 * kv) + 4 * 2 * 8 * 128 == 794_624
    # bound by its traffic: 794624 B at 3.35 TB/s x 0.85 (279 ns) against 170 ns of FLOPs
    seconds = max(flops / (989e12 * 0.6), cost.bytes / (3.35e12 * H100.memory_efficiency))
    assert cost.seconds == pytest.approx(seconds + H100.launch_s, rel=1e-12)
    assert cost == attention_cost(2, 8, 2, 128, 256, 64, True, "float16", H100)
    whole = op_cost(op, rule_for(op, graph), None, graph, cluster)
    assert whole == attention_cost(2, 8, 2, 256, 256, 64, True, "float16", H100)
    tpu = make_cluster(mesh="2", device="tpu-v5e")  # no flash kernel: the roofline of its loops
    assert op_cost(op, rule_for(op, graph), option, graph, tpu).flops == 4 * 2 * 8 * 128 * 256 * 64


def _lowered(tmp_path, mesh, sequence_axes, **shape):
    """The Attention op with Q, K, V and Y all split on the sequence (dim 2) over
    `sequence_axes`: propagated, lowered to its program."""
    graph = import_onnx(save(attention_op(**shape), tmp_path), {})
    cluster = make_cluster(mesh=mesh, device="h100", bandwidth="100GB/s", latency="1us")
    split = Sharding(((), (), tuple(sequence_axes), ()))
    marks = [Annotation(name, split) for name in ("q", "k", "v", "y")]
    plan = propagate(graph, cluster.mesh, marks)
    return graph, cluster, plan, lower(graph, plan)


def test_all_gather_kv_costs_by_hand(tmp_path):
    """B 1, 8 heads over 2 kv heads, 4096 tokens, head dim 64, float16, on 4 devices at
    100 GB/s and 1 us: the queries split 4 ways, K and V each all-gathered (1024 rows of
    2·64 halves a device: 262144 B, 3 of them sent, 3 ring steps), then the last shard's
    causal kernel (1024 rows over 4096 keys); K and V held whole, gathered."""
    graph, cluster, plan, program = _lowered(tmp_path, "4", (0,), batch=1, seq=4096)
    assert str(plan.options["attention"]) == "[[], [], [], [0]]"
    cost = price(program, graph, cluster)
    gathers = [(c.value, c.kind, c.bytes_per_device) for c in cost.collectives]
    local = 1 * 2 * 1024 * 64 * 2
    assert gathers == [("k", "all_gather", 3 * local), ("v", "all_gather", 3 * local)]
    assert cost.comm_time_s == pytest.approx(2 * (3 * 1e-6 + 3 * local / 100e9), rel=1e-9)
    kernel = attention_cost(1, 8, 2, 1024, 4096, 64, True, "float16", H100)
    pairs = 1024 * 3072 + 1024 * 1025 // 2
    assert kernel.flops == 2 * 2 * 8 * pairs * 64
    assert cost.ops["attention"] == kernel
    # Live at the op: Q, Y (a quarter each), K and V shards and their gathered copies.
    quarter, whole_kv = 8 * 1024 * 64 * 2, 2 * 4096 * 64 * 2
    assert cost.memory_bytes_per_device == 2 * quarter + 2 * local + 2 * whole_kv


def test_ring_attention_costs_by_hand(tmp_path):
    """The case above as ring attention, causal load-balanced: K and V stay split with the
    queries (the ring option: keys over the same axis), no collective in the program, no
    gathered K or V in memory (Q and Y a quarter each, K and V their own 262144 B blocks).

    Time, at 1 us and 100 GB/s:
    - the kernel over the device's two opposite chunks (512 rows each) of the 4096: 4096 ·
      4097 / 8 = 2,097,664 causal pairs, the triangle's quarter (the contiguous last block
      does 1024 · 3072 + 1024 · 1025 / 2 = 3,670,528);
    - a step: the kernel over half a full block's pairs (1024 · 1024 / 2: balanced, each
      step's block is half masked), with two blocks to hide, half a step each: the 3 steps
      of K and of V expose 3 · max(0, send - step / 2), send = 1 us + 262144 B / 100 GB/s;
    - each of the 3 steps a kernel launch (2 us) and the running output, 1024 rows x 8 heads
      x 64 in float32, read and written at 3.35 TB/s x 0.85 (the step overhead)."""
    graph, cluster, plan, _ = _lowered(tmp_path, "4", (0,), batch=1, seq=4096)
    option = ShardingOption(((), (), (), (0,), (0,), ()))
    plan = propagate(
        graph, cluster.mesh, [Annotation(n, Sharding(((), (), (0,), ()))) for n in "qkvy"],
        {"attention": option},
    )  # fmt: skip
    program = lower(graph, plan)
    cost = price(program, graph, cluster)
    assert cost.collectives == ()
    pairs = 4096 * 4097 // 8
    assert pairs == 2_097_664 < 1024 * 3072 + 1024 * 1025 // 2 == 3_670_528
    kernel = attention_cost(1, 8, 2, 1024, 4096, 64, True, "float16", H100, pairs=pairs)
    assert kernel.flops == 2 * 2 * 8 * pairs * 64
    step = attention_cost(1, 8, 2, 1024, 1024, 64, False, "float16", H100, pairs=1024 * 512)
    block, rows = 1 * 2 * 1024 * 64 * 2, 8 * 1024 * 64 * 2
    send = 1e-6 + block / 100e9
    exposed = 2 * 3 * max(0.0, send - step.seconds / 2)
    assert exposed > 0
    overhead = 3 * (2e-6 + 2 * 4 * 8 * 1024 * 64 / (3.35e12 * H100.memory_efficiency))
    assert cost.ops["attention"].seconds == pytest.approx(
        kernel.seconds + exposed + overhead, rel=1e-12
    )
    assert cost.ops["attention"].flops == kernel.flops
    assert cost.memory_bytes_per_device == 2 * rows + 2 * block
    # All-gather-K/V: its gathers (21.7 us) and the last block's kernel; 1.5 MiB more held.
    gathered = 2 * (3 * 1e-6 + 3 * block / 100e9)
    last = attention_cost(1, 8, 2, 1024, 4096, 64, True, "float16", H100)
    assert cost.ops["attention"].seconds < gathered + last.seconds


@pytest.fixture
def make_models(monkeypatch):
    spec = importlib.util.spec_from_file_location("make_models", MODELS / "make_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "make_models", module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


# At 2048 the context-parallel plan is the program's cheaper (597.5 us against 603.3 us) but
# the search prices each of a layer's two partial gradients of post_attn_norm.out with its own
# all_reduce, where the CCL pass adds them and reduces once: 15.5 us over, enough to pick the
# other plan (issue 41, the objective equal to the program's cost). Strict: fixed, it passes.
_OVERCOUNT = pytest.mark.xfail(
    strict=True, reason="the search over-prices partial gradients added before their all_reduce"
)


@pytest.mark.parametrize(
    ("seq", "context_parallel"), [(512, False), pytest.param(2048, True, marks=_OVERCOUNT)]
)
def test_the_search_splits_attention_by_context_where_memory_binds(
    tmp_path, make_models, seq, context_parallel
):
    """A 2-layer decoder with 2 heads (they cannot fill 4 devices), a training step of one
    sequence on 4 H100s given 20 MB each: at 512 tokens the replicated step fits (13 MB)
    and nothing is split; at 2048 it needs 33 MB whole, and the plan splits the attention's
    query rows over the axis, its keys and values gathered whole."""
    built = make_models.build_decoder_shape_only(2, hidden=128, heads=2, ffn=256, vocab=512)
    onnx.save(built.proto, tmp_path / "decoder.onnx")
    request = PlanRequest(
        model_path=tmp_path / "decoder.onnx", cluster=make_cluster("4", "h100", memory="20MB"),
        dims={"batch": 1, "seq": seq}, training=Training(),
    )  # fmt: skip
    requested = plan_request(request)
    plan, graph = requested.planned.plan, requested.graph
    split = [plan.produced[r.probabilities].split_axes for r in graph.fused.regions]
    assert len(split) == 2
    assert all(s[2:3] == (((0,),) if context_parallel else ()) for s in split)
    told = "context parallel attention over axis 0 (all-gather K/V)"
    assert (told in requested.document.story) == context_parallel
    assert requested.planned.cost.memory_bytes_per_device <= 20_000_000


def test_a_fused_core_split_by_context_costs_its_last_block(tmp_path):
    """The decomposed core of tests/unit/test_fused_attention.py (B 2, 4 heads over 2 kv
    heads, 8 tokens, head dim 4, causal), its training step fused, on 2 devices with x split
    on the sequence: the core computes its query rows split, the forward and backward kernels
    priced over the last 4 rows against all 8 keys (4·4 + 4·5/2 = 26 of the 36 pairs); K
    and V, as the core reads them (its heads repeated for GQA), all-gathered forward and
    their gradients reduce-scattered backward, the causal mask cut to the device's rows."""
    from tests.unit.test_fused_attention import HEADS, B, D, S, block

    graph = load_graph(save(block(kv_heads=2), tmp_path), {}, Training(attention=Attention.FUSED))
    cluster = make_cluster(mesh="2", device="h100")
    plan = propagate(graph, cluster.mesh, [Annotation("x", Sharding(((), (0,), ())))])
    assert plan.produced["probs"].split_axes[2] == (0,)
    program = lower(graph, plan)
    cost = price(program, graph, cluster)
    forward = attention_cost(B, HEADS, 2, S // 2, S, D, True, "bfloat16", H100)
    assert forward.flops == 2 * 2 * B * HEADS * 26 * D
    assert cost.ops["softmax"] == forward
    backward = attention_cost(B, HEADS, 2, S // 2, S, D, True, "bfloat16", H100, backward=True)
    assert cost.ops["softmax@grad0"] == backward
    moved = [(c["kind"], c["value"]) for c in program.collectives_json()]
    assert moved[:3] == [("all_gather", "kT"), ("all_slice", "mask"), ("all_gather", "v_r")]
    assert ("reduce_scatter", "kT@grad0") in moved and ("reduce_scatter", "v_r@grad0") in moved


def test_the_attention_ops_gradients_are_one_backward_kernel(tmp_path):
    """The training step of the Attention op: the gradient of its query is the flash
    backward kernel over the op's loops (5 matmuls over the causal pairs), the gradients of
    its key and value are inside that kernel and cost nothing of their own."""
    graph = load_graph(save(attention_op(project=True), tmp_path), {}, Training())
    cluster = make_cluster(mesh="2", device="h100")
    grads = {
        op.attr("operand"): op for op in graph.ops
        if op.type == "Grad" and op.attr("op") == "attention"
    }  # fmt: skip
    assert sorted(grads) == [0, 1, 2]
    dtype = graph.values[graph.op_by_name["attention"].inputs[0]].dtype
    costs = {k: op_cost(op, rule_for(op, graph), None, graph, cluster) for k, op in grads.items()}
    backward = attention_cost(2, 8, 2, 256, 256, 64, True, dtype, H100, backward=True)
    assert backward.flops == 5 * 2 * 2 * 8 * (256 * 257 // 2) * 64
    assert costs == {0: backward, 1: OpCost(0, 0, 0.0), 2: OpCost(0, 0, 0.0)}


def test_a_ring_option_splits_what_each_tensor_indexes():
    """`ring_loops`: the key loop split over the query loop's axes. Of Q·Kᵀ (loops b, h, m,
    n, k), Q and the scores split by the queries (m) alone, Kᵀ by the keys (n); of its
    gradient dKᵀ (m a sum there), dKᵀ split by the keys and not partial: the ring sums it. An
    option's text reads back, and a repeat that is not a loop's whole axes is refused."""
    from autoshard.rules.base import reduction, ring_loops
    from autoshard.rules.einsum import einsum_rule

    rule = einsum_rule("...mk,...kn->...mn", ((1, 2, 8, 4), (1, 2, 4, 8)))
    option = ShardingOption.parse("[[], [], [0], [0]]", 5)
    assert ring_loops(option) == ((2, 3),)
    assert str(rule.operand_sharding(option, 0)) == "[[], [], [0]]"
    assert str(rule.operand_sharding(option, 1)) == "[[], [], [], [0]]"
    assert str(rule.result_sharding(option, 0)) == "[[], [], [0]]"
    loops = (*rule.loops[:2], reduction(8), *rule.loops[3:])  # dKᵀ = Qᵀ·dS sums over m
    gradient = dataclasses.replace(rule, loops=loops, results=(rule.operands[1],))
    assert str(gradient.result_sharding(option, 0)) == "[[], [], [], [0]]"  # no partial
    assert ShardingOption.parse(str(option), 5) == option
    with pytest.raises(ShardingError, match="splits on dims"):
        ShardingOption.parse("[[0], [0, 1]]", 2)

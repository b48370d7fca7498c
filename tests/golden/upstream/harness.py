"""The harness of upstream's propagation tests as ours (docs/design/upstream-propagation.md).

A `Case` is one function of an upstream test file written twice: as an ONNX graph with our
annotations, and as the upstream IR it stands for, with the same `shard.shard` ops. `expected`
holds upstream's CHECK lines in our notation: per op, the sharding each of its operands is read
with and the sharding its result is produced with. The checks:

- `assert_ours`: the graph carries the IR's annotations, and `propagate` completes it to
  `expected` (or to `ours`, where we keep an answer that differs from upstream on purpose);
- `assert_upstream` (where `mlir-opt-22` is installed): upstream's `sharding-propagation` pass
  completes the IR to `expected`, so CI checks the CHECK lines against the real tool, not our
  reading of them, and to `propagate`'s answer on every op not in `ours`;
- `assert_fewer_bytes`: where we keep our own answer, it moves fewer bytes than upstream's.

Partial results: LLVM 22's `shard.sharding` has no partial axes (its partition all-reduces a
split reduction inside the op), so every comparison is on split axes; our `partial = sum[...]`
is dropped before comparing. An operand or result that upstream leaves without a `shard.shard`
is replicated.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from autoshard.annotations import Annotation
from autoshard.ir.graph import Graph
from autoshard.ir.onnx_import import import_onnx
from autoshard.mesh import Mesh
from autoshard.mlir import parse_module
from autoshard.plan import Plan
from autoshard.propagate import propagate
from autoshard.reshard import plan_reshard
from autoshard.sharding import Sharding

MLIR_OPT = shutil.which("mlir-opt-22")
S = Sharding.parse

# (operand shardings, result sharding) of one op, in our notation; parsed, per op.
OpShardings = tuple[tuple[str, ...], str]
Table = dict[str, tuple[tuple[Sharding, ...], Sharding]]


def held(value: str, text: str) -> Annotation:
    """`shard.shard %v to %s`: how `value` is produced."""
    return Annotation(value, S(text))


def read(value: str, text: str) -> Annotation:
    """`shard.shard %v to %s annotate_for_users`: how every user of `value` reads it."""
    return Annotation(value, S(text), for_users=True)


@dataclass(frozen=True)
class Op:
    """An ONNX node and its upstream twin: `upstream` is the op's name in the IR (the n-th op
    of that name is the n-th such Op of the case), `operands` how many of its leading operands
    correspond to the node's inputs (tosa zero points and linalg `outs` have no ONNX input)."""

    node: onnx.NodeProto
    upstream: str
    operands: int


@dataclass(frozen=True)
class Case:
    """One upstream function. `mesh` as `shard.grid` writes it; `inputs` name -> shape (a
    tuple is an int64 initializer: its values, as ReduceSum's axes); `expected` op name ->
    upstream's CHECK lines; `ours` the ops where autoshard keeps another answer (see the docs
    page); `traversal` upstream's pass option, as the file's RUN line sets it; `aliases` the
    IR's names of values the graph names otherwise (a fill's init: the fill's result)."""

    mesh: str
    inputs: dict[str, list[int] | tuple[int, ...]]
    ops: tuple[Op, ...]
    outputs: tuple[str, ...]
    annotations: tuple[Annotation, ...]
    expected: dict[str, OpShardings]
    upstream: str
    ours: dict[str, OpShardings] = field(default_factory=dict)
    traversal: str = ""
    aliases: dict[str, str] = field(default_factory=dict)


def split(sharding: Sharding) -> Sharding:
    """The split axes alone: the part of a sharding that LLVM 22 can state."""
    return Sharding(sharding.split_axes)


def parsed(table: dict[str, OpShardings]) -> Table:
    return {op: (tuple(S(t) for t in operands), S(r)) for op, (operands, r) in table.items()}


def onnx_model(case: Case, path: Path) -> Path:
    tensors = {n: s for n, s in case.inputs.items() if isinstance(s, list)}
    constants = [
        helper.make_tensor(n, TensorProto.INT64, [len(v)], v)
        for n, v in case.inputs.items()
        if isinstance(v, tuple)
    ]
    graph = helper.make_graph(
        [op.node for op in case.ops],
        "upstream_case",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in tensors.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, tensors.get(n)) for n in case.outputs],
        constants,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(model, path)
    return path


def planned(case: Case, tmp_path: Path) -> tuple[Graph, Plan]:
    graph = import_onnx(onnx_model(case, tmp_path / "case.onnx"))
    return graph, propagate(graph, Mesh.parse(case.mesh, "grid"), list(case.annotations))


def full_table(case: Case, plan: Plan) -> Table:
    """`plan`'s answer per op: how it reads each corresponding operand, how it produces its
    result (partial axes included)."""
    table = {}
    for op in case.ops:
        name = op.node.name
        reads = tuple(plan.needs[(name, i)] for i in range(op.operands))
        table[name] = (reads, plan.produced[op.node.output[0]])
    return table


def ours(case: Case, tmp_path: Path) -> Table:
    """`propagate`'s answer per op, split axes only."""
    table = full_table(case, planned(case, tmp_path)[1])
    return {op: (tuple(map(split, reads)), split(r)) for op, (reads, r) in table.items()}


def with_partials(case: Case, table: Table) -> Table:
    """Upstream's answer with the partial axes LLVM 22 leaves out: a mesh axis an op reads an
    operand split over but does not split its result over splits a reduction loop (a matmul's
    k, a ReduceSum's dims), so the op's local result is a partial sum over it."""
    full = {}
    for op in case.ops:
        reads, result = table[op.node.name]
        kept = {a for axes in result.split_axes for a in axes}
        partial = sorted({a for r in reads for axes in r.split_axes for a in axes} - kept)
        full[op.node.name] = (reads, Sharding(result.split_axes, tuple(partial)))
    return full


def moved(case: Case, graph: Graph, plan: Plan, table: Table, reduce_in_op: bool) -> int:
    """Bytes a device sends to run `case` as `table` says (ops in order, priced by
    `plan_reshard`): each operand from how it is held to how the op reads it, each result from
    how the op produces it to how it is held, each graph output to how it is returned. A value
    is held as annotated, else as produced: by `plan` (autoshard, partial results kept for the
    next op to reduce), or, where `reduce_in_op` (upstream's partition), reduced at once. Graph
    inputs are held as `plan` holds them."""
    mesh, held = plan.mesh, dict(plan.values)
    annotated = {a.value: a.sharding for a in case.annotations if not a.for_users}
    read_as = {a.value: a.sharding for a in case.annotations if a.for_users}
    total = 0

    def cost(value: str, src: Sharding, dst: Sharding) -> int:
        steps = plan_reshard(src, dst, graph.values[value].shape, mesh)
        return sum(c.bytes_per_device for c in steps)

    for op in case.ops:
        reads, produced = table[op.node.name]
        total += sum(cost(v, held[v], r) for v, r in zip(op.node.input, reads, strict=False))
        out = op.node.output[0]
        done = split(produced) if reduce_in_op else plan.values[out]
        held[out] = annotated.get(out, done)
        total += cost(out, produced, held[out])
    for out in case.outputs:
        total += cost(out, held[out], read_as.get(out, split(held[out])))
    return total


def mlir_opt(text: str, *args: str) -> str:
    result = subprocess.run(
        [str(MLIR_OPT), *args], input=text, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[:3000]
    return result.stdout


def operands_in_order(text: str, result: str) -> list[str]:
    """The operands of the op defining `result`, in order and repeated as written (`ins(%f,
    %f ...)`); `parse_module` lists another dialect's operands once each. mlir-opt prints an
    op's operands on its first line, its regions' block arguments on later ones."""
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"{result} ="))
    return re.findall(r"%[\w$.]+", line.split("=", 1)[1])


def upstream(case: Case) -> Table:
    """Upstream's answer per op after its `sharding-propagation` pass (with the file's
    traversal option): the sharding of the `shard.shard` each corresponding operand comes
    through, and of the `shard.shard` (not for users) its result goes through."""
    option = f"{{traversal={case.traversal}}}" if case.traversal else ""
    pipeline = f"--pass-pipeline=builtin.module(func.func(sharding-propagation{option}))"
    text = mlir_opt(case.upstream, pipeline)
    module = parse_module(text)
    names = [op.upstream for op in case.ops]
    found = [op for op in module.ops if op.name in set(names)]
    assert [op.name for op in found] == names

    def through(ssa: str) -> Sharding:
        producer = module.defining(ssa)
        return module.sharding(ssa) if producer and producer.kind == "shard" else Sharding()

    table = {}
    for op, mlir_op in zip(case.ops, found, strict=True):
        operands = operands_in_order(text, mlir_op.results[0])
        reads = tuple(split(through(ssa)) for ssa in operands[: op.operands])
        results = [
            u.results[0]
            for u in module.users(mlir_op.results[0])
            if u.kind == "shard" and not u.attrs["annotate_for_users"]
        ]
        produced = module.sharding(results[0]) if results else Sharding()
        table[op.node.name] = (reads, split(produced))
    return table


def shown(table: Table) -> dict[str, str]:
    """A table in our notation, for readable assertion messages."""
    return {op: f"{', '.join(map(str, r))} -> {p}" for op, (r, p) in table.items()}


needs_mlir_opt = pytest.mark.skipif(MLIR_OPT is None, reason="mlir-opt-22 (mlir-22-tools) absent")


def annotations_in(case: Case) -> set[tuple[str, str, bool]]:
    """The `shard.shard` ops of the case's IR before the pass, as (value, sharding, for users):
    a shard op of a shard op's result annotates the value at the head of the chain, and the
    IR's `%v` and `%v_` both name graph value `v`."""
    module = parse_module(case.upstream)
    found = set()
    for op in module.ops:
        if op.kind != "shard":
            continue
        value = op.operands[0]
        while (producer := module.defining(value)) is not None and producer.kind == "shard":
            value = producer.operands[0]
        name = value.lstrip("%")
        sharding = str(module.sharding(op.results[0]))
        found.add((case.aliases.get(name, name), sharding, op.attrs["annotate_for_users"]))
    return found


def assert_ours(case: Case, tmp_path: Path) -> None:
    """The graph carries the IR's annotations, and `propagate` completes it as upstream's CHECK
    lines say (or as `ours` keeps)."""
    given = {(a.value, str(a.sharding), a.for_users) for a in case.annotations}
    assert given == annotations_in(case)
    assert shown(ours(case, tmp_path)) == shown(parsed(case.expected | case.ours))


def assert_upstream(case: Case, tmp_path: Path) -> None:
    """Upstream's pass completes the case's IR as its CHECK lines say, and as `propagate`
    completes the graph, op by op, except where autoshard keeps its own answer (`ours`)."""
    theirs, mine = upstream(case), ours(case, tmp_path)
    assert shown(theirs) == shown(parsed(case.expected))
    agreed = [op.node.name for op in case.ops if op.node.name not in case.ours]
    assert shown({op: mine[op] for op in agreed}) == shown({op: theirs[op] for op in agreed})


def assert_fewer_bytes(case: Case, tmp_path: Path) -> tuple[int, int]:
    """Where autoshard keeps its own answer (`ours`), it moves fewer bytes than upstream's, as
    docs/design/propagation.md's rule asks ("The op takes the option that moves the fewest
    bytes"); returns (ours, upstream's)."""
    graph, plan = planned(case, tmp_path)
    mine = moved(case, graph, plan, full_table(case, plan), reduce_in_op=False)
    theirs = moved(case, graph, plan, with_partials(case, parsed(case.expected)), True)
    assert mine < theirs, (mine, theirs)
    return mine, theirs

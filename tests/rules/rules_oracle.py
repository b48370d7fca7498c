"""The numeric oracle for sharding rules (DTensor style): split one loop over two simulated
devices, run the op on each device's slices with onnxruntime, combine, compare with the op run
whole.

A case is one ONNX node with concrete inputs: `Data` inputs are the graph's inputs, `Param`
inputs (targets, axes, bounds) are initializers, so the importer sees them as constants. The
rule comes from the imported graph, exactly as the planner gets it. For a loop of even size:

- every operand dim whose map is exactly that loop is cut in two halves, device r taking half r;
- a Param listed as the case's `shape_param` (Reshape target, Expand shape) is rewritten to the
  local result shape the result map implies;
- the rule's note adds its local rewrite: "masked_lookup" (the split reduction loop of a Gather:
  ids outside the local rows become row 0 and their result rows are zeroed), "bias_once" (a
  split reduction loop: an operand the loop does not index is zero on device 1),
  "local_group" (loop 1 split: the `group` / `num_groups` attribute halves);
- the local results combine: a parallel loop concatenates along the result dims it indexes (a
  result it does not index must be the same on both devices); a reduction loop reduces the
  two results with the loop's ReductionKind.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from autoshard.ir.graph import Graph, Op, Value
from autoshard.ir.onnx_import import import_onnx
from autoshard.rules import IteratorType, OpRule, rule_for
from autoshard.sharding import ReductionKind

DEVICES = 2


@dataclass(frozen=True)
class Data:
    """A data input: its shape and how to fill it (or a fixed array)."""

    shape: tuple[int, ...]
    gen: str = "f"
    array: np.ndarray | None = field(default=None, compare=False)

    def make(self, rng: np.random.Generator) -> np.ndarray:
        if self.array is not None:
            return np.asarray(self.array)
        s = self.shape
        match self.gen:
            case "f":
                return rng.standard_normal(s).astype(np.float32)
            case "pos":  # logs, roots, powers, divisors
                return rng.uniform(0.5, 2.0, s).astype(np.float32)
            case "unit":  # asin, acos, atanh
                return rng.uniform(-0.9, 0.9, s).astype(np.float32)
            case "big":  # acosh
                return rng.uniform(1.5, 3.0, s).astype(np.float32)
            case "bool":
                return rng.random(s) < 0.5
            case "int":
                return rng.integers(-5, 6, s).astype(np.int64)
            case "int32":
                return rng.integers(0, 64, s).astype(np.int32)
            case "nz":  # nonzero ints (Mod divisors)
                return rng.integers(1, 6, s).astype(np.int64)
            case "uint":
                return rng.integers(0, 8, s).astype(np.uint32)
        raise ValueError(f"unknown generator {self.gen!r}")


@dataclass(frozen=True)
class Param:
    """A parameter input: an initializer, hence a constant for the importer."""

    value: Any

    @property
    def array(self) -> np.ndarray:
        value = np.asarray(self.value)
        return value.astype(np.int64) if value.dtype.kind == "i" else value


def i64(*values: int) -> Param:
    return Param(np.array(values, dtype=np.int64))


def case(
    id: str,
    inputs: tuple[Data | Param | None, ...],
    kinds: str,
    *,
    outputs: int = 1,
    opset: int = 17,
    shape_param: int | None = None,
    hand_built: bool = False,
    **attrs: Any,
) -> Case:
    """A Case whose op type is its id up to the first "-" (`Gemm-transB` is a Gemm)."""
    return Case(id, id.split("-")[0], inputs, kinds, attrs, outputs, opset, shape_param, hand_built)


@dataclass(frozen=True)
class Case:
    """One node to check: `kinds` lists its loops as tokens (p = parallel, i = invalid, a
    reduction by its kind: sum, max, min, product, average)."""

    id: str
    op_type: str
    inputs: tuple[Data | Param | None, ...]
    kinds: str
    attrs: Mapping[str, Any] = field(default_factory=dict)
    outputs: int = 1
    opset: int = 17
    shape_param: int | None = None
    hand_built: bool = False  # the importer cannot keep the op (see Oracle._hand_graph)

    @cached_property
    def arrays(self) -> list[np.ndarray | None]:
        rng = np.random.default_rng(sum(map(ord, self.id)))
        return [
            None if x is None else x.array if isinstance(x, Param) else x.make(rng)
            for x in self.inputs
        ]

    @property
    def input_names(self) -> list[str]:
        return ["" if x is None else f"in{i}" for i, x in enumerate(self.inputs)]

    @property
    def output_names(self) -> list[str]:
        return [f"out{i}" for i in range(self.outputs)]

    def node(self, attrs: Mapping[str, Any] | None = None) -> onnx.NodeProto:
        return helper.make_node(
            self.op_type, self.input_names, self.output_names, **(attrs or self.attrs)
        )

    def model(self, graph_inputs: Sequence[onnx.ValueInfoProto], inits, outputs, attrs=None):
        graph = helper.make_graph([self.node(attrs)], self.id, graph_inputs, outputs, inits)
        opsets = [helper.make_opsetid("", self.opset)]
        return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def kinds(rule: OpRule) -> str:
    def token(loop) -> str:
        if loop.kind is IteratorType.REDUCTION:
            return str(loop.reduction)
        return "p" if loop.kind is IteratorType.PARALLEL else "i"

    return " ".join(token(loop) for loop in rule.loops)


def _info(name: str, array: np.ndarray, symbolic: bool) -> onnx.ValueInfoProto:
    elem = helper.np_dtype_to_tensor_dtype(array.dtype)
    shape = [f"{name}_{d}" for d in range(array.ndim)] if symbolic else list(array.shape)
    return helper.make_tensor_value_info(name, elem, shape)


class Oracle:
    """A case, its rule from the imported graph, and onnxruntime sessions to run it."""

    def __init__(self, case: Case, tmp_path: Path) -> None:
        self.case = case
        self.arrays = case.arrays
        self._sessions: dict[str, ort.InferenceSession] = {}
        if case.hand_built:
            self.graph = self._hand_graph()
        else:
            self.graph = self._import(tmp_path)
            self._dtypes = [np.dtype(self.graph.values[n].dtype) for n in case.output_names]
        assert len(self.graph.ops) == 1, [str(op) for op in self.graph.ops]
        self.op: Op = self.graph.ops[0]
        rule = rule_for(self.op, self.graph)
        assert rule is not None, f"no rule for {self.op}"
        self.rule: OpRule = rule

    def _named(self):
        return [
            (name, x, a)
            for name, x, a in zip(self.case.input_names, self.case.inputs, self.arrays, strict=True)
            if x is not None
        ]

    def _import(self, tmp_path: Path) -> Graph:
        named = self._named()
        inputs = [_info(n, a, False) for n, x, a in named if isinstance(x, Data)]
        inits = [numpy_helper.from_array(a, n) for n, x, a in named if isinstance(x, Param)]
        outputs = [helper.make_empty_tensor_value_info(n) for n in self.case.output_names]
        path = tmp_path / f"{self.case.id}.onnx"
        onnx.save(self.case.model(inputs, inits, outputs), path)
        return import_onnx(path)

    def _hand_graph(self) -> Graph:
        """The IR of the node built by hand, for ops the importer cannot keep: results take
        the dtype of the first input (or of the op's `value`) and the shapes onnxruntime gives."""
        named = self._named()
        value = self.case.attrs.get("value")
        dtype = (
            helper.tensor_dtype_to_np_dtype(value.data_type)
            if isinstance(value, onnx.TensorProto)
            else named[0][2].dtype
        )
        self._dtypes = [dtype] * self.case.outputs
        whole = self.whole()
        values = {n: Value(n, a.shape, str(a.dtype)) for n, _, a in named}
        for name, result in zip(self.case.output_names, whole, strict=True):
            values[name] = Value(name, result.shape, str(result.dtype))
        op = Op(
            "node",
            self.case.op_type,
            inputs=tuple(self.case.input_names),
            outputs=tuple(self.case.output_names),
            attrs=dict(self.case.attrs),
        )
        data = tuple(n for n, x, _ in named if isinstance(x, Data))
        constants = {n: a for n, x, a in named if isinstance(x, Param)}
        return Graph("g", (op,), values, data, tuple(self.case.output_names), {}, constants)

    def run(
        self, feeds: Mapping[str, np.ndarray], attrs: Mapping[str, Any] | None = None
    ) -> list[np.ndarray]:
        """Run the node on `feeds`. Every input, params included, is a graph input, data with
        symbolic dims, so one session serves the whole and the local shapes."""
        key = repr(sorted((attrs or {}).items()))
        session = self._sessions.get(key)
        if session is None:
            outputs = [
                helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(t), None)
                for n, t in zip(self.case.output_names, self._dtypes, strict=True)
            ]
            # Data, and params the rule maps (constant ids) and a split cuts, get symbolic dims.
            rule = getattr(self, "rule", None)  # hand-built cases run whole before it is set
            maps = rule.operands if rule is not None else ()
            mapped = {n for n, m in zip(self.case.input_names, maps, strict=False) if m}
            data = {n for n, x, _ in self._named() if isinstance(x, Data) or n in mapped}
            inputs = [_info(n, a, n in data) for n, a in feeds.items()]
            model = self.case.model(inputs, [], outputs, attrs)
            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            options.log_severity_level = 3
            session = ort.InferenceSession(
                model.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
            self._sessions[key] = session
        return [np.asarray(r) for r in session.run(None, dict(feeds))]

    # ---- splitting ----------------------------------------------------------------------------

    def splittable(self) -> list[int]:
        return [
            k
            for k, loop in enumerate(self.rule.loops)
            if loop.kind is not IteratorType.INVALID and loop.size % DEVICES == 0
        ]

    def _local_result_shape(self, loop: int) -> np.ndarray:
        shape = list(self.graph.values[self.case.output_names[0]].shape)
        for d, expr in enumerate(self.rule.results[0].dims):
            if expr == ((1, loop),):
                shape[d] //= DEVICES
        return np.array(shape, dtype=np.int64)

    def local_feeds(self, loop: int, device: int) -> tuple[dict[str, np.ndarray], dict, Any]:
        """Device `device`'s inputs, attributes and result mask when `loop` is split."""
        rule, note = self.rule, self.rule.note
        is_reduction = rule.loops[loop].kind is IteratorType.REDUCTION
        feeds: dict[str, np.ndarray] = {}
        post = None
        for index, (name, array) in enumerate(zip(self.case.input_names, self.arrays, strict=True)):
            if array is None:
                continue
            m = rule.operands[index]
            if m is None:
                feeds[name] = (
                    self._local_result_shape(loop) if index == self.case.shape_param else array
                )
                continue
            touched = False
            for d, expr in enumerate(m.dims):
                if any(term == loop for _, term in expr):
                    assert expr == ((1, loop),), f"split loop {loop} in a combined dim {m}"
                    assert array.shape[d] % DEVICES == 0, (name, array.shape, d)
                    half = array.shape[d] // DEVICES
                    array = np.take(array, range(device * half, (device + 1) * half), axis=d)
                    touched = True
            if note == "bias_once" and is_reduction and not touched and device:
                array = np.zeros_like(array)
            feeds[name] = array
        attrs = dict(self.case.attrs)
        if note == "local_group" and loop == 1:
            key = "group" if "group" in attrs else "num_groups"
            attrs[key] = attrs[key] // DEVICES
        if note == "masked_lookup" and self.case.op_type == "GatherND":
            feeds = self._local_nd_ids(feeds, loop, device)
        elif note == "masked_lookup" and (is_reduction or self._splits_gathered_axis(loop)):
            feeds, post = self._masked_lookup(feeds, device)
        return feeds, attrs, post

    def _splits_gathered_axis(self, loop: int) -> bool:
        """Constant block-local ids share a parallel loop with the gathered axis: the local
        ids are rewritten as for a split reduction loop (and all fall in the local rows)."""
        data_map = self.rule.operands[0]
        axis = self.case.attrs.get("axis", 0) % len(self.case.inputs[0].shape)  # type: ignore[union-attr]
        return data_map is not None and data_map.dims[axis] == ((1, loop),)

    def _local_nd_ids(self, feeds: dict[str, np.ndarray], loop: int, device: int):
        """GatherND's constant block-local ids: the component of each indexed data dim the
        split loop cuts loses the dim's local offset (all ids then fall in the local block)."""
        data_map = self.rule.operands[0]
        full = self.arrays[0]
        assert data_map is not None and full is not None
        ids_name = self.case.input_names[1]
        ids = feeds[ids_name].copy()
        batch = self.case.attrs.get("batch_dims", 0)
        for component in range(ids.shape[-1]):
            dim = batch + component
            if data_map.dims[dim] == ((1, loop),):
                rows = full.shape[dim] // DEVICES
                ids[..., component] -= device * rows
                assert ((ids[..., component] >= 0) & (ids[..., component] < rows)).all()
        return {**feeds, ids_name: ids}

    def _masked_lookup(self, feeds: dict[str, np.ndarray], device: int):
        data_name, ids_name = self.case.input_names[:2]
        full = self.arrays[0]
        assert full is not None
        axis = self.case.attrs.get("axis", 0) % full.ndim
        rows = full.shape[axis] // DEVICES
        ids = feeds[ids_name]
        ids = np.where(ids < 0, ids + full.shape[axis], ids)
        mine = (ids >= device * rows) & (ids < (device + 1) * rows)
        feeds = {**feeds, ids_name: np.where(mine, ids - device * rows, 0).astype(ids.dtype)}
        shape = (1,) * axis + ids.shape + (1,) * (full.ndim - axis - 1)
        return feeds, mine.reshape(shape)

    def split(self, loop: int) -> list[np.ndarray]:
        """The results computed with `loop` split over two devices, then combined."""
        locals_ = []
        for device in range(DEVICES):
            feeds, attrs, mask = self.local_feeds(loop, device)
            results = self.run(feeds, attrs if attrs != dict(self.case.attrs) else None)
            if mask is not None:
                results = [r * mask.astype(r.dtype) for r in results]
            locals_.append(results)
        return [self._combine(loop, k, [lr[k] for lr in locals_]) for k in range(len(locals_[0]))]

    def _combine(self, loop: int, result: int, parts: list[np.ndarray]) -> np.ndarray:
        spec = self.rule.loops[loop]
        if spec.kind is IteratorType.REDUCTION:
            match spec.reduction:
                case ReductionKind.SUM:
                    return sum(parts[1:], parts[0])
                case ReductionKind.MAX:
                    return np.maximum.reduce(parts)
                case ReductionKind.MIN:
                    return np.minimum.reduce(parts)
                case ReductionKind.PRODUCT:
                    return math.prod(parts[1:], start=parts[0])
                case ReductionKind.AVERAGE:
                    return sum(parts[1:], parts[0]) / len(parts)
            raise AssertionError(f"no combiner for {spec}")
        dims = [d for d, e in enumerate(self.rule.results[result].dims) if e == ((1, loop),)]
        if not dims:
            for part in parts[1:]:
                np.testing.assert_array_equal(part, parts[0])
            return parts[0]
        (dim,) = dims
        return np.concatenate(parts, axis=dim)

    def whole(self) -> list[np.ndarray]:
        named = self._named()
        return self.run({n: a for n, _, a in named})


def check_rule(rule: OpRule, op: Op, graph: Graph) -> None:
    """The invariants every rule keeps (base.py): one map per operand and result,
    of the tensor's rank; omitted operands unmapped; results projected permutations over
    parallel and invalid loops; no splittable loop twice in one tensor; a splittable loop's
    size divides the dims that follow it; combined dims only over invalid loops."""
    assert len(rule.operands) == len(op.inputs), (op, rule)
    assert len(rule.results) == len(op.outputs), (op, rule)
    tensors = [*zip(op.inputs, rule.operands, strict=True)]
    tensors += [*zip(op.outputs, rule.results, strict=True)]
    for name, m in tensors:
        if not name:
            assert m is None, f"{op}: omitted operand has map {m}"
            continue
        if m is None:
            continue
        shape = graph.values[name].shape
        assert len(m.dims) == len(shape), f"{op}: map {m} for {name}{list(shape)}"
        splittable = []
        for size, expr in zip(shape, m.dims, strict=True):
            for coefficient, loop in expr:
                assert 0 <= loop < len(rule.loops) and coefficient > 0, (op, m)
            if len(expr) > 1:
                kinds = {rule.loops[loop].kind for _, loop in expr}
                assert kinds == {IteratorType.INVALID}, f"{op}: combined dim {expr} of {m}"
            elif expr:
                ((coefficient, loop),) = expr
                spec = rule.loops[loop]
                if spec.kind is not IteratorType.INVALID:
                    assert coefficient == 1, (op, m)
                    assert size % spec.size == 0, f"{op}: dim {size} on loop {spec} ({m})"
                    splittable.append(loop)
        assert len(splittable) == len(set(splittable)), f"{op}: a loop twice in {m}"
    for m in rule.results:
        for expr in m.dims:
            assert len(expr) <= 1 and all(c == 1 for c, _ in expr), f"{op}: result map {m}"
            for _, loop in expr:
                assert rule.loops[loop].kind is not IteratorType.REDUCTION, f"{op}: {m}"

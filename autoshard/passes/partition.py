"""Partition (docs/design/lowering.md): the sharded program as each device runs it.

A `Program` is SSA over *global* tensors held in shardings. Partitioning gives every device
(by linear index, the mesh's row-major order) its local program:

- every tensor gets the device's local shape (`Sharding.local_shape`: ceil-sized shards, the
  last ones smaller or empty; exact, never padded);
- every collective gets the device group it runs in (`Mesh.device_groups`, in its order);
- operands and attributes that carry shapes are rewritten to the local ones, as explicit
  constants (no 0 / -1 of Reshape): Reshape targets, Expand and ConstantOfShape shapes, Resize
  sizes, Slice bounds on split dims, Squeeze's implicit axes, Conv / GroupNormalization group
  counts (rule note "local_group");
- the rule notes that need a local rewrite get one: a vocabulary-split Gather ("masked_lookup")
  looks up `ids - lo` among its rows [lo, hi) and zeroes the rows it does not hold, giving the
  partial sums its result sharding says (with block-local constant ids every id is its own
  device's: no mask, nothing partial); a GatherND whose indexed dims are split subtracts each
  dim's start from its id component; a bias of a Gemm or Conv whose reduction is split
  ("bias_once") is added by the first device of each reduction group only;
- an op a device's shards leave nothing to compute (an empty result, or a reduction over an
  empty shard) becomes a ConstantOfShape: no values, or the reduction's identity (zeros for a
  sum), which is exactly that device's partial result.

The per-op rewrites (shape operands, rule notes) are tables in passes/local_rewrites.py: this
pass walks the program and looks each op up, by op type and by its rule's note.

Replicated constants a user needs split stay replicated on every device; materialization
already cut them with an `all_slice` (a local slice, no communication).

Worked example (the MLP of docs/design/lowering.md on mesh [2]): `x` 2x4x8 held [[], [], [0]] is
local 2x4x4 on both devices; `all_gather` over mesh axis 0 runs in the single group (0, 1); `dot1`
computes 2x4x16 with W1's local 8x16; `reduce_scatter` gives each device 2x4x4. On mesh [3] the same
x would be 2x4x3, 2x4x3, 2x4x2.

Splits a local op cannot compute exactly are refused with a `PartitionError` naming the op: a
reshape whose split loop the device count does not divide (its shards would not be the same
flat range on both sides), a group count a device's channels do not hold whole, an average of
uneven shards.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from autoshard.collectives import Collective, CollectiveKind
from autoshard.errors import AutoshardError
from autoshard.ir import dtypes
from autoshard.ir.graph import Attrs, Graph, Op
from autoshard.mesh import Device, Mesh
from autoshard.passes.local_rewrites import NOTE_REWRITES, SHAPE_REWRITES, Shape
from autoshard.passes.ring import RingSteps, ring_steps
from autoshard.program import Communicate, Compute, Program, Step, Tensor
from autoshard.rules import IteratorType, Note, OpRule, rule_for
from autoshard.rules.base import ring_loops
from autoshard.rules.shape import constant
from autoshard.sharding import ReductionKind, Sharding, Slice


class PartitionError(AutoshardError):
    """A sharded op that no local program computes exactly (the message names the op)."""


# ---- the result -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalCompute:
    """An ONNX op on local tensors; `step` is the index of the program step it implements (a
    masked lookup is several local ops of one step)."""

    op: Op
    step: int

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.op.inputs

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.op.outputs

    def __str__(self) -> str:
        return str(self.op)


@dataclass(frozen=True)
class LocalCollective(Communicate):
    """This device's part of a program collective (the program's `Communicate`, with where it
    runs): `group` lists the linear indices of the devices it runs with, in `Mesh.device_groups`
    order (its own position is `rank`). A permute has no group: `collective.pairs` says who
    sends to whom."""

    step: int
    group: tuple[int, ...]
    rank: int

    def __str__(self) -> str:
        where = (
            f"group {list(self.group)}"
            if self.group
            else "pairs " + str([list(p) for p in self.collective.pairs])
        )
        details = _details(self.collective)
        return f"{self.target} = {self.collective.kind}({self.source}) {details} {where}"


def _details(collective: Collective) -> str:
    """`mesh_axes = [0] gather_axis = 2`: the collective's attributes, kind left out."""
    return str(collective).partition(" ")[2]


LocalStep = LocalCompute | LocalCollective


@dataclass(frozen=True)
class DeviceProgram:
    """What one device runs. `shapes` has the local shape of every tensor it names (program
    tensors, rewritten constants, temporaries of local rewrites); `constants` the values that
    are this device's own (rewritten shapes, lookup offsets); the program's constants hold for
    every device."""

    index: int
    device: Device
    shapes: Mapping[str, Shape]
    steps: tuple[LocalStep, ...]
    constants: Mapping[str, np.ndarray] = field(default_factory=dict)

    def text(self) -> str:
        """The local program, one step a line with its results' local shapes:

        h: 2x4x16 = MatMul(x~1, w1)
        y~1: 2x4x4 = reduce_scatter(y) mesh_axes = [0] reduction = sum scatter_axis = 2 group [0, 1]
        """
        lines = []
        for step in self.steps:
            shapes = ", ".join(
                f"{n}: {'x'.join(map(str, self.shapes[n])) or 'scalar'}" for n in step.outputs if n
            )
            body = str(step).partition(" = ")[2]
            lines.append(f"{shapes} = {body}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Partitioned:
    """The partition of `program` (whose shape operands are split out per use, so a rewritten
    constant has one name per use), one `DeviceProgram` per device in linear order. `dtypes`
    has the element type of every name a device program uses."""

    program: Program
    devices: tuple[DeviceProgram, ...]
    dtypes: Mapping[str, str]

    @property
    def mesh(self) -> Mesh:
        return self.program.mesh

    def slices(self, tensor: str, index: int) -> tuple[Slice, ...]:
        """The region of the global tensor `tensor` device `index` holds."""
        t = self.program.tensors[tensor]
        return device_slices(t.sharding, t.shape, self.mesh)[index]

    def collectives_json(self) -> list[dict[str, object]]:
        """The program's collectives, each with its device groups (linear indices)."""
        out = self.program.collectives_json()
        for entry, step in zip(out, self.program.communications, strict=True):
            entry["groups"] = [list(g) for g in collective_groups(step.collective, self.mesh)]
        return out


# ---- geometry, cached: many tensors share a sharding and shape ---------------------------------


@functools.lru_cache(maxsize=65536)
def device_slices(sharding: Sharding, shape: Shape, mesh: Mesh) -> tuple[tuple[Slice, ...], ...]:
    """Each device's region of a global tensor, in linear device order."""
    return tuple(sharding.slices(mesh, shape, d) for d in mesh.devices())


@functools.lru_cache(maxsize=65536)
def local_shapes(sharding: Sharding, shape: Shape, mesh: Mesh) -> tuple[Shape, ...]:
    """Each device's local shape of a global tensor, in linear device order."""
    return tuple(tuple(b - a for a, b in region) for region in device_slices(sharding, shape, mesh))


@functools.lru_cache(maxsize=1024)
def collective_groups(collective: Collective, mesh: Mesh) -> tuple[tuple[int, ...], ...]:
    """The device groups of a collective as linear indices (none for a permute)."""
    if collective.kind is CollectiveKind.PERMUTE:
        return ()
    return tuple(
        tuple(mesh.linear_index(d) for d in group)
        for group in mesh.device_groups(collective.mesh_axes)
    )


# ---- the pass ---------------------------------------------------------------------------------


def partition(program: Program, graph: Graph) -> Partitioned:
    """Every device's local program of `program` (see the module docstring).

    `graph` is the graph the program was materialized from: its rules say which loops an op
    splits (to refuse inexact local ops) and its small initializers hold Slice bounds.
    """
    return _Partitioner(program, graph).run()


_RESHAPES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})


class _Partitioner:
    def __init__(self, program: Program, graph: Graph) -> None:
        self.program, self.graph, self.mesh = program, graph, program.mesh
        self.count = self.mesh.size
        self.tensors: dict[str, Tensor] = dict(program.tensors)
        self.constants: dict[str, np.ndarray] = dict(program.constants)
        self.dtypes: dict[str, str] = {n: t.dtype for n, t in program.tensors.items()}
        self.shapes: list[dict[str, Shape]] = [{} for _ in range(self.count)]
        self.own: list[dict[str, np.ndarray]] = [{} for _ in range(self.count)]
        self.steps: list[list[LocalStep]] = [[] for _ in range(self.count)]
        self.uses: dict[str, int] = {}
        for step in program.steps:
            for name in step.inputs:
                if name:
                    self.uses[name] = self.uses.get(name, 0) + 1
        self.step = 0

    # -- helpers --

    def local(self, name: str) -> tuple[Shape, ...]:
        t = self.tensors[name]
        return local_shapes(t.sharding, t.shape, self.mesh)

    def regions(self, name: str) -> tuple[tuple[Slice, ...], ...]:
        t = self.tensors[name]
        return device_slices(t.sharding, t.shape, self.mesh)

    def sharding(self, name: str) -> Sharding:
        return self.tensors[name].sharding

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.tensors or name in self.dtypes:
            name, k = f"{base}~{k}", k + 1
        return name

    def temporary(self, name: str, dtype: str, shapes: Sequence[Shape]) -> None:
        """A tensor only device programs have (a local rewrite's intermediate)."""
        self.dtypes[name] = dtype
        for k in range(self.count):
            self.shapes[k][name] = shapes[k]

    def device_constant(
        self,
        base: str,
        dtype: str,
        values: Sequence[np.ndarray],
        global_value: np.ndarray | None = None,
    ) -> str:
        """A constant every device holds its own value of (one shape everywhere). With a
        `global_value` the program gets it too, for the program's op that reads it."""
        name = self.fresh(base)
        numpy_type = dtypes.numpy_dtype(dtype)
        if global_value is not None:
            array = np.asarray(global_value, numpy_type)
            self.tensors[name] = Tensor(name, name, array.shape, dtype, Sharding())
            self.constants[name] = array
        self.dtypes[name] = dtype
        for k in range(self.count):
            value = np.asarray(values[k], numpy_type)
            self.own[k][name] = value
            self.shapes[k][name] = value.shape
        return name

    def shared_constant(self, base: str, value: np.ndarray, dtype: str, in_program: bool) -> str:
        """A constant with one value on every device."""
        array = np.asarray(value, dtypes.numpy_dtype(dtype))
        return self.device_constant(
            base, dtype, [array] * self.count, array if in_program else None
        )

    def replace_operand(
        self, op: Op, index: int, values: Sequence[np.ndarray], global_value: np.ndarray
    ) -> Op:
        """`op` reading a per-device constant at operand `index`. The operand keeps its name
        when it is a program constant read only here; else it gets a new one."""
        old = op.inputs[index] if index < len(op.inputs) else ""
        if old and old in self.program.constants and self.uses.get(old) == 1:
            dtype = self.dtypes[old]
            self.constants[old] = np.asarray(global_value, dtypes.numpy_dtype(dtype))
            for k in range(self.count):
                self.own[k][old] = np.asarray(values[k], dtypes.numpy_dtype(dtype))
            name = old
        else:
            suffix = _OPERAND_NAMES.get((op.type, index), f"in{index}")
            name = self.device_constant(f"{op.name}.{suffix}", "int64", values, global_value)
        inputs = list(op.inputs) + [""] * (index + 1 - len(op.inputs))
        inputs[index] = name
        return dataclasses.replace(op, inputs=tuple(inputs))

    def constant_value(self, name: str) -> np.ndarray | None:
        """The value of a parameter operand known at compile time."""
        if not name:
            return None
        if name in self.constants:
            return np.asarray(self.constants[name])
        value = self.tensors[name].value if name in self.tensors else name
        return constant(self.graph, value)

    def fail(self, op: Op, why: str) -> PartitionError:
        return PartitionError(f"cannot partition op '{op.name}' ({op.type}): {why}")

    # -- the walk --

    def run(self) -> Partitioned:
        for name in self.program.tensors:
            for k, shape in enumerate(self.local(name)):
                self.shapes[k][name] = shape
        steps: list[Step] = []
        for step in self.program.steps:
            if isinstance(step, Communicate):
                self.step = len(steps)
                self.communicate(step)
                steps.append(step)
                continue
            ring = self.ring(step)
            for move in ring.before:
                self.step = len(steps)
                self.communicate(move)
                steps.append(move)
            at = self.step = len(steps)
            op, per_device = self.compute(ring.step)
            steps.append(dataclasses.replace(ring.step, op=op))
            for k in range(self.count):
                ops = ring.joins[k] + per_device[k] + ring.first[k]
                self.steps[k].extend(LocalCompute(o, at) for o in ops)
            for move, added in ring.after:
                self.step = len(steps)
                self.communicate(move)
                steps.append(move)
                for k in range(self.count):
                    self.steps[k].extend(LocalCompute(o, at) for o in added[k])
        program = dataclasses.replace(
            self.program, tensors=self.tensors, steps=tuple(steps), constants=self.constants
        )
        devices = tuple(
            DeviceProgram(
                k,
                self.mesh.multi_index(k),
                MappingProxyType(self.shapes[k]),
                tuple(self.steps[k]),
                MappingProxyType(self.own[k]),
            )
            for k in range(self.count)
        )
        return Partitioned(program, devices, MappingProxyType(self.dtypes))

    def communicate(self, step: Communicate) -> None:
        groups = collective_groups(step.collective, self.mesh)
        where: dict[int, tuple[tuple[int, ...], int]] = {}
        for group in groups:
            for rank, index in enumerate(group):
                where[index] = (group, rank)
        for k in range(self.count):
            group, rank = where.get(k, ((), -1))
            self.steps[k].append(
                LocalCollective(step.source, step.target, step.collective, self.step, group, rank)
            )

    def add_tensor(self, tensor: Tensor) -> None:
        """A program tensor the partition adds (a block of ring attention)."""
        self.tensors[tensor.name] = tensor
        self.dtypes[tensor.name] = tensor.dtype
        for k, shape in enumerate(self.local(tensor.name)):
            self.shapes[k][tensor.name] = shape

    def ring(self, step: Compute) -> RingSteps:
        """A step computed as ring attention (`passes.ring`), or the step alone."""
        source = self.graph.op_by_name.get(step.op.name)
        rule = rule_for(source, self.graph) if source is not None else None
        if rule is None or step.option is None or not ring_loops(step.option):
            empty: list[list[Op]] = [[] for _ in range(self.count)]
            return RingSteps(step, [], empty, [list(e) for e in empty])
        return ring_steps(self, step, rule)

    def compute(self, step: Compute) -> tuple[Op, list[list[Op]]]:
        """The program's op (shape operands split out) and each device's local ops: the
        rewrites of passes/local_rewrites.py, looked up by op type and by the rule's note."""
        op = step.op
        source = self.graph.op_by_name.get(op.name)
        rule = rule_for(source, self.graph) if source is not None else None
        self.check(step, source, rule)
        shape_rewrite = SHAPE_REWRITES.get(op.type)
        if shape_rewrite is not None:
            op = shape_rewrite(self, op)
        note = rule.note if rule is not None else Note.NONE
        local_rewrite = NOTE_REWRITES.get((note, op.type))
        per_device = (
            local_rewrite(self, op)
            if local_rewrite is not None
            else [[op] for _ in range(self.count)]
        )
        result = self.sharding(op.outputs[0]) if op.outputs[0] else Sharding()
        partial = result.partial_type if result.partial_axes else None
        for k in range(self.count):
            per_device[k] = [
                c for o in per_device[k] for c in self.nothing_to_compute(o, k, partial)
            ]
        return op, per_device

    def nothing_to_compute(self, op: Op, k: int, partial: ReductionKind | None) -> list[Op]:
        """Where a device's shard leaves an op nothing to compute, its results are constants:
        empty results need no values; a reduction over an empty shard gives the reduction's
        identity (its partial result). Runtimes need not handle empty tensors in every op."""
        shapes = self.shapes[k]
        results = [n for n in op.outputs if n]
        empty_result = any(0 in shapes[n] for n in results)
        empty_operand = any(n and 0 in shapes[n] for n in op.inputs)
        if not empty_result and not (empty_operand and partial):
            return [op]
        out = []
        for j, name in enumerate(results):
            shape = self.shapes[k][name]
            fill = np.zeros(1, dtypes.numpy_dtype(self.dtypes[name]))
            if 0 not in shape:
                fill[0] = _identity(partial or ReductionKind.SUM, fill.dtype)
            target = f"{op.name}.shape{j}"
            self.own[k][target] = np.array(shape, np.int64)
            self.shapes[k][target] = (len(shape),)
            self.dtypes[target] = "int64"
            out.append(Op(f"{op.name}/const{j}", "ConstantOfShape", "", (target,), (name,),
                          Attrs({"value": fill})))  # fmt: skip
        return out

    # -- checks --

    def check(self, step: Compute, source: Op | None, rule: OpRule | None) -> None:
        """Refuse splits whose local op would not be exact (see the module docstring).
        `source` is the graph's op of the step, `rule` its rule."""
        op, option = step.op, step.option
        if option is None or not any(option.loops):
            return
        if source is None or rule is None or len(rule.loops) != len(option.loops):
            return
        for d, (loop, axes) in enumerate(zip(rule.loops, option.loops, strict=True)):
            n = self.mesh.group_size(axes)
            if not axes or loop.size % n == 0:
                continue
            if op.type in _RESHAPES and not _same_extent(rule, d, source, self.graph):
                raise self.fail(
                    op,
                    f"loop d{d} of size {loop.size} is split over mesh axes {list(axes)} "
                    f"({n} devices), which does not divide it; a reshape that merges or splits "
                    "the dim keeps shards aligned only when the device count divides the loop",
                )
            if loop.kind is IteratorType.REDUCTION and loop.reduction is ReductionKind.AVERAGE:
                raise self.fail(
                    op,
                    f"the average over loop d{d} of size {loop.size} is split over mesh axes "
                    f"{list(axes)} ({n} devices) unevenly; the mean of uneven shards' means is "
                    "not the mean",
                )

        if rule.note is Note.MASKED_LOOKUP:
            self.check_lookup(op, option.loops, rule)

    def check_lookup(self, op: Op, split: tuple[tuple[int, ...], ...], rule: OpRule) -> None:
        """A lookup whose constant ids are block-local (rules/shape.py) splits the table's
        gathered dims along with a dim of the ids. An even split lines the blocks up; an uneven
        one may (a dim of 2 rows looked up by ids [0, 1], over 3 devices: 1, 1, 0 each side),
        so then every device's ids are checked to fall in its own rows."""
        data = rule.operands[0]
        if data is None:
            return
        if op.type == "Gather":
            axis = op.attr("axis", 0)
            gathered = [axis % len(data.dims)] if isinstance(axis, int) else []
        else:
            batch = op.attr("batch_dims", 0)
            k = self.tensors[op.inputs[1]].shape[-1]
            gathered = list(range(batch, batch + k)) if isinstance(batch, int) else []
        for component, dim in enumerate(gathered):
            loop = data.loop_of(dim)
            if loop is None or rule.loops[loop].kind is not IteratorType.PARALLEL:
                continue
            n = self.mesh.group_size(split[loop])
            if split[loop] and rule.loops[loop].size % n and not self.own_rows(op, dim, component):
                raise self.fail(
                    op,
                    f"its table dim {dim} and its ids are split together (loop d{loop} of size "
                    f"{rule.loops[loop].size}) over {n} devices unevenly, and some device's ids "
                    "fall outside its rows",
                )

    def own_rows(self, op: Op, dim: int, component: int) -> bool:
        """Does every device's part of the constant ids (their `component` for a GatherND)
        index only rows of table dim `dim` that the device holds?"""
        data, ids = op.inputs[0], op.inputs[1]
        values = self.constant_value(ids)
        if values is None:
            return False
        if op.type == "GatherND":
            values = values[..., component]
        size = self.tensors[data].shape[dim]
        values = np.where(values < 0, values + size, values)
        id_regions = device_slices(self.sharding(ids), self.tensors[ids].shape, self.mesh)
        rows = device_slices(self.sharding(data), self.tensors[data].shape, self.mesh)
        for region, held in zip(id_regions, rows, strict=True):
            if op.type == "GatherND":
                region = region[:-1]
            mine = values[tuple(slice(a, b) for a, b in region)]
            lo, hi = held[dim]
            if mine.size and (mine.min() < lo or mine.max() >= hi):
                return False
        return True


def _identity(kind: ReductionKind, dtype: np.dtype) -> object:
    """The value a reduction of nothing gives (what an empty shard contributes)."""
    if kind in (ReductionKind.MAX, ReductionKind.MIN):
        if dtype.kind == "f":
            low, high = -np.inf, np.inf
        elif dtype.kind in "iu":
            low, high = np.iinfo(dtype).min, np.iinfo(dtype).max
        else:
            low, high = False, True
        return low if kind is ReductionKind.MAX else high
    if kind is ReductionKind.PRODUCT:
        return 1
    if kind is ReductionKind.BITWISE_AND:
        return True if dtype.kind == "b" else ~dtype.type(0)
    return 0


def _same_extent(rule: OpRule, loop: int, op: Op, graph: Graph) -> bool:
    """Does reshape loop `loop` index an input dim and an output dim of the same size? Then
    any split, even or not, gives both the same rows (the dim is carried over unchanged)."""
    operand, result = rule.operands[0], rule.results[0]
    if operand is None:
        return False
    inputs = [d for d in range(len(operand.dims)) if operand.loop_of(d) == loop]
    outputs = [d for d in range(len(result.dims)) if result.loop_of(d) == loop]
    if len(inputs) != 1 or len(outputs) != 1:
        return False
    a = graph.values[op.inputs[0]].shape[inputs[0]]
    return a == graph.values[op.outputs[0]].shape[outputs[0]]


_OPERAND_NAMES: dict[tuple[str, int], str] = {
    ("Reshape", 1): "shape",
    ("Expand", 1): "shape",
    ("ConstantOfShape", 0): "shape",
    ("Resize", 3): "sizes",
    ("Slice", 1): "starts",
    ("Slice", 2): "ends",
}

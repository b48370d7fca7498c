"""Repeated layers: which ops of a graph are copies of which, found from its structure alone.

Each op gets a structural signature: its type, attributes, the shapes and dtypes of its inputs
and outputs, and for each input where it comes from (a weight, a constant of some value, a graph
input, or an op). Ops of identical layers have identical signatures at the same offsets, so the
layers are a periodic run of the signature sequence:

    signatures   E E | a b c d | a b c d | a b c d | h     period 4, three repeats from op 2

`find_repeats` returns the run covering the most ops (period x repeats, the period a whole
block), then the same in what is left before and after it.

Exporters write the same layers differently, and the signatures must not see it:
- an op's name never counts (`/layers.0/MatMul` and `node_MatMul_12` are alike);
- a small integer initializer (a Reshape target) is known by its value, as a Constant node is;
- the TorchScript exporter's deduplicated parameters (`layers.1.ln.weight` an Identity of
  `layers.0.ln.weight`) are parameters of their own from the import on (`ir.onnx_import`);
- ops computed from parameters alone (a weight's Transpose or Cast, T5's position bias that its
  first block computes for all) sit where the exporter put them, not where the layers are
  alike: the runs are found without them, then each joins its layer when every layer has it.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.ir import dtypes
from autoshard.ir.fold import FOLD_LIMIT
from autoshard.ir.graph import Attrs, Graph
from autoshard.rules.gradient import RECOMPUTE_OF, computed_with


@dataclass(frozen=True)
class Run:
    """Repeated layers: op `layers[j][k]` (an index in graph order) is a copy of op
    `layers[0][k]`. A layer lists the ops computing on data in graph order, then those computed
    from parameters alone that every layer has (`find_repeats`); the layers follow one another,
    and an op between a layer's first and last op may be in none (computed from parameters
    alone and not in every layer: T5's position bias, which its first block computes for
    all)."""

    layers: tuple[tuple[int, ...], ...]

    @property
    def start(self) -> int:
        return self.layers[0][0]

    @property
    def period(self) -> int:
        """The ops of each layer."""
        return len(self.layers[0])

    @property
    def count(self) -> int:
        return len(self.layers)

    @property
    def ops(self) -> int:
        return self.period * self.count

    def span(self, j: int) -> range:
        """The ops from layer `j`'s first to its last, in graph order."""
        return range(min(self.layers[j]), max(self.layers[j]) + 1)

    @functools.cached_property
    def _where(self) -> dict[int, tuple[int, int]]:
        return {i: (j, k) for j, layer in enumerate(self.layers) for k, i in enumerate(layer)}

    def layer(self, index: int) -> int | None:
        """The layer op `index` is in (None: in no layer)."""
        where = self._where.get(index)
        return where[0] if where is not None else None

    def first(self, index: int) -> int | None:
        """The op of the first layer that op `index` copies (None: in no layer)."""
        where = self._where.get(index)
        return self.layers[0][where[1]] if where is not None else None

    def __contains__(self, index: int) -> bool:
        return index in self._where


@dataclass(frozen=True)
class Repeats:
    """The periodic runs of a graph's ops, largest first (a training step has three: the
    forward layers, their backward, their updates). `start`, `period` and `count` describe
    the largest."""

    runs: tuple[Run, ...] = ()

    def first(self, index: int) -> int:
        """The op of the first repeat that op `index` copies (itself outside the runs)."""
        for run in self.runs:
            first = run.first(index)
            if first is not None:
                return first
        return index

    @property
    def start(self) -> int:
        return self.runs[0].start if self.runs else 0

    @property
    def period(self) -> int:
        return self.runs[0].period if self.runs else 1

    @property
    def count(self) -> int:
        return self.runs[0].count if self.runs else 1

    @property
    def ops(self) -> int:
        return sum(run.ops for run in self.runs)


NONE = Repeats()


def signatures(graph: Graph) -> list[int]:
    """Each op's structural signature (see the module docstring). A gradient op is known by
    its forward op's signature, not its name."""
    produced = {out for op in graph.ops for out in op.outputs if out}
    table: dict[tuple, int] = {}
    result = []
    of_op: dict[str, int] = {}
    for op in graph.ops:
        forward = computed_with(op)
        attrs = (
            Attrs({k: v for k, v in op.attrs.items() if k not in ("op", RECOMPUTE_OF)})
            if forward
            else op.attrs
        )
        key = (
            op.type,
            op.domain,
            hash(attrs),
            of_op.get(forward, -1) if forward else -1,
            tuple(_origin(graph, name, produced) for name in op.inputs),
            tuple(_type(graph, name) for name in op.outputs),
        )
        of_op[op.name] = table.setdefault(key, len(table))
        result.append(of_op[op.name])
    return result


def _type(graph: Graph, name: str) -> tuple:
    if not name:
        return ()
    value = graph.values[name]
    return (value.shape, value.dtype)


def _origin(graph: Graph, name: str, produced: set[str]) -> tuple:
    if not name:
        return ("absent",)
    if name in produced:
        return ("op", _type(graph, name))
    array = _content(graph, name)
    if array is not None:
        array = np.ascontiguousarray(array)
        return ("constant", array.dtype.str, array.shape, hashlib.sha1(array.tobytes()).digest())
    kind = "weight" if name in graph.weights else "input"
    return (kind, _type(graph, name))


def _content(graph: Graph, name: str) -> np.ndarray | None:
    """A constant's value; or a small initializer's of no floating type, which no training
    changes (a Reshape target, an axes list): one exporter writes it as an initializer, another
    (or another layer) as a Constant node, and by value they are alike."""
    if name in graph.constants:
        return graph.constants[name]
    weight = graph.weights.get(name)
    if weight is None or not weight.has_data or weight.dtype in dtypes.FLOAT_DTYPES:
        return None
    return weight.load() if weight.size <= FOLD_LIMIT else None


def find_repeats(graph: Graph, min_period: int = 2) -> Repeats:
    """The repeated layers: the periodic runs of the signatures of the ops that compute on the
    model's data (`_free` says which do not), the run covering the most ops first (ties: the
    shortest period, then the earliest start), then the same in what is left before and after
    it. The ops computed from parameters alone then join their layers (`_joined`)."""
    sigs = signatures(graph)
    free = _free(graph)
    bound = [i for i in range(len(graph.ops)) if i not in free]
    seq = np.array([sigs[i] for i in bound], dtype=np.int64)
    found: list[list[list[int]]] = []
    segments = [(0, len(seq))]
    while segments:
        lo, hi = segments.pop()
        best = _best_run(seq[lo:hi], min_period)
        if best is not None:
            start, period, count = lo + best[0], best[1], best[2]
            found.append([bound[start + j * period : start + (j + 1) * period]
                          for j in range(count)])  # fmt: skip
            segments += [(lo, start), (start + period * count, hi)]
    runs = _joined(graph, sigs, free, found)
    return Repeats(tuple(sorted(runs, key=lambda r: (-r.ops, r.start))))


def _free(graph: Graph) -> set[int]:
    """The ops computed from parameters alone (the indices): those reading no data input (a
    graph input the forward reads, not an optimizer's state) nor any result of an op that does,
    and the gradients and recomputations of such ops. An exporter places them where the
    model computes them, inside a layer (a weight's Cast, T5's position bias in its first
    block only), so they do not take part in finding the layers."""
    forward = {name for op in graph.ops if graph.phase(op.name) == "forward" for name in op.inputs}
    computed = set(forward & set(graph.inputs))
    free: set[int] = set()
    free_ops: set[str] = set()
    for i, op in enumerate(graph.ops):
        forward_op = computed_with(op)
        if forward_op:
            alone = forward_op in free_ops
        else:
            alone = not any(name in computed for name in op.inputs)
        if alone:
            free.add(i)
            free_ops.add(op.name)
        else:
            computed.update(op.outputs)
    return free


def _joined(
    graph: Graph, sigs: Sequence[int], free: Collection[int], found: list[list[list[int]]]
) -> list[Run]:
    """The runs `found` (each a list of layers of op indices), with the free ops that every
    layer of a run has. A free op sits next to the first op reading its results, or when no
    op of a layer reads them, next to the last op it reads (a weight's Transpose next to its
    MatMul, the Transpose's gradient next to the gradient it reads); it joins that op's layer
    when every layer has a free op of its signature at the same place. T5's position bias,
    computed in the first block only, joins none; nor does a free op when the layers would
    overlap."""
    where = {i: (r, j, k) for r, layers in enumerate(found) for j, layer in enumerate(layers)
             for k, i in enumerate(layer)}  # fmt: skip
    index = {op.name: i for i, op in enumerate(graph.ops)}
    place: dict[int, tuple[int, int, int]] = {}

    def placed(i: int) -> tuple[int, int, int] | None:
        return place.get(i) if i in free else where.get(i)

    for i in sorted(free, reverse=True):  # a free op's readers come after it
        readers = sorted(index[c.name] for out in graph.ops[i].outputs if out
                         for c in graph.consumers(out))  # fmt: skip
        if readers and (at := placed(readers[0])) is not None:
            place[i] = at
    for i in sorted(set(free) - place.keys()):
        producers = sorted(index[p.name] for n in graph.ops[i].inputs if (p := graph.producer(n)))
        near = [at for at in map(placed, producers) if at is not None]
        if near:
            place[i] = near[-1]
    # Each layer's free ops by place: (next to member k, signature, how many such before).
    keyed: dict[tuple[int, int], dict[tuple[int, int, int], int]] = {}
    for i in sorted(place):
        r, j, k = place[i]
        mine = keyed.setdefault((r, j), {})
        same = sum(1 for key in mine if key[:2] == (k, sigs[i]))
        mine[(k, sigs[i], same)] = i
    runs = []
    for r, layers in enumerate(found):
        each = [keyed.get((r, j), {}) for j in range(len(layers))]
        common = sorted(set(each[0]).intersection(*each[1:]))
        joined = [(*layer, *(mine[key] for key in common))
                  for layer, mine in zip(layers, each, strict=True)]  # fmt: skip
        apart = all(max(a) < min(b) for a, b in itertools.pairwise(joined))
        runs.append(Run(tuple(joined) if apart else tuple(map(tuple, layers))))
    return runs


def _best_run(seq: np.ndarray, min_period: int) -> tuple[int, int, int] | None:
    """(start, period, count) of the periodic run of `seq` covering the most entries (ties:
    the shortest period, then the earliest start)."""
    n = len(seq)
    best, covered = None, 0
    same = np.zeros(n + 1, dtype=np.int8)  # 0-padded both ends: a run's edges are where it steps
    for period in range(min_period, n // 2 + 1):
        inner = same[1 : n - period + 1]
        np.equal(seq[:-period], seq[period:], out=inner.view(bool))
        same[n - period + 1] = 0
        # Runs of `same`: a run of length r starting at s makes ops s .. s+r+period-1 periodic.
        edges = np.flatnonzero(np.diff(same[: n - period + 2]))
        if not len(edges):
            continue
        starts = edges[::2]
        cover = (edges[1::2] - starts + period) // period * period
        k = int(np.argmax(cover))  # the first of the runs covering the most
        if cover[k] > covered and cover[k] >= 2 * period:
            best, covered = (int(starts[k]), period, int(cover[k]) // period), int(cover[k])
    return best

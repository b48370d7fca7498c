"""The ShardingInterface (docs/design/propagation.md) as data: loops, their iterator types,
indexing maps.

An op's computation is a loop nest. Each loop is `parallel`, `reduction` (with the kind that
combines partial results) or `invalid` (cannot be split). An indexing map sends the loops to the
dims of one operand or result: `MatMul [M, K] x [K, N] -> [M, N]` has loops (m, n, k), k a sum
reduction, and maps (m, k), (k, n), (m, n). A *sharding option* assigns mesh axes to loops;
each tensor's sharding follows through its map, and splitting a reduction loop leaves the
results partial. Rules never see the mesh: the same rule serves every mesh.

Dims are affine in the loops. Most are one loop (a projected permutation); a dim indexed by no
loop (`()`) is never split (a broadcast dim of size 1, a dim an op reads whole); Conv and
pooling dims combine an output loop and a kernel loop (`((stride, oh), (dilation, kh))`), of
which at most one may be split. Results are projected permutations.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from autoshard.sharding import ReductionKind, Sharding, ShardingOption


class IteratorType(enum.StrEnum):
    PARALLEL = "parallel"
    REDUCTION = "reduction"
    INVALID = "invalid"


class Note(enum.StrEnum):
    """The local rewrite a split of the op needs beyond its shards (passes/local_rewrites.py).

    The values are the words docs and tests use: `masked_lookup` (a Gather or GatherND whose
    table is split along what it looks up), `bias_once` (a Gemm or Conv bias, which a split
    reduction would add once per device), `local_group` (a Conv `group` or GroupNormalization
    `num_groups`, which counts the groups a device holds), `local_heads` (an attention or
    rotary op in the 3-D layout, whose head-count attributes count the heads a device holds; a
    causal Attention split on its queries, whose causal mask is written out).
    """

    NONE = ""
    MASKED_LOOKUP = "masked_lookup"
    BIAS_ONCE = "bias_once"
    LOCAL_GROUP = "local_group"
    LOCAL_HEADS = "local_heads"


@dataclass(frozen=True)
class Loop:
    """One loop of an op: its trip count, kind and, for a reduction, how partials combine."""

    size: int
    kind: IteratorType = IteratorType.PARALLEL
    reduction: ReductionKind | None = None

    def __post_init__(self) -> None:
        if (self.kind is IteratorType.REDUCTION) != (self.reduction is not None):
            raise ValueError("a reduction loop needs its reduction kind, other loops none")

    def __str__(self) -> str:
        if self.kind is IteratorType.REDUCTION:
            return f"reduction_{self.reduction}({self.size})"
        return f"{self.kind}({self.size})"


DimExpr = tuple[tuple[int, int], ...]
"""A tensor dim as a sum of coefficient * loop terms; () is a dim no loop indexes."""


@dataclass(frozen=True)
class IndexingMap:
    """Loops -> the dims of one tensor, one `DimExpr` per dim."""

    dims: tuple[DimExpr, ...]
    _loops: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The loops of each dim, worked out once: the search and the pricing ask per op again.
        object.__setattr__(self, "_loops", tuple(tuple(lp for _, lp in e) for e in self.dims))

    @staticmethod
    def of(*loops: int | None) -> IndexingMap:
        """A projected permutation: dim i is loop `loops[i]`, or no loop where None."""
        return IndexingMap(tuple(() if loop is None else ((1, loop),) for loop in loops))

    def loop_of(self, dim: int) -> int | None:
        """The loop a dim follows, when it follows exactly one with coefficient 1."""
        expr = self.dims[dim]
        return expr[0][1] if len(expr) == 1 and expr[0][0] == 1 else None

    def loops(self, dim: int) -> tuple[int, ...]:
        return self._loops[dim]

    def __str__(self) -> str:
        def term(coefficient: int, loop: int) -> str:
            return f"d{loop}" if coefficient == 1 else f"{coefficient}*d{loop}"

        parts = [" + ".join(term(c, loop) for c, loop in expr) or "0" for expr in self.dims]
        return f"({', '.join(parts)})"


@dataclass(frozen=True)
class OpRule:
    """What a rule says of one op: its loops and the map of every operand and result.

    An operand map of None marks an input that is not data but a parameter of the op (a
    Reshape's target shape, Slice bounds, axes): it is never sharded. `note` tells later stages
    of a local rewrite the split needs (e.g. `Note.MASKED_LOOKUP` for a vocabulary-split
    Gather). `ring` lists the (home, ring) loop pairs an attention kernel may split together
    as ring attention (`ring_loops`): its query rows and the keys it passes around the axis.
    `partial` lists the reductions whose partial values the op may read and write unreduced
    (`ShardingOption.partial_axes`): those it commutes with, f(reduce(x_i), reduce(y_i)) =
    reduce(f(x_i, y_i)), as Add, Sub and Sum do with a sum.
    """

    loops: tuple[Loop, ...]
    operands: tuple[IndexingMap | None, ...]
    results: tuple[IndexingMap, ...]
    note: Note = Note.NONE
    ring: tuple[tuple[int, int], ...] = ()
    partial: tuple[ReductionKind, ...] = ()

    def __str__(self) -> str:
        loops = ", ".join(f"d{i}: {loop}" for i, loop in enumerate(self.loops))
        maps = [str(m) if m is not None else "-" for m in self.operands]
        return f"loops [{loops}] operands {maps} results {[str(m) for m in self.results]}"

    def operand_sharding(self, option: ShardingOption, index: int) -> Sharding:
        """How `option` shards operand `index` (a parameter operand is never sharded)."""
        indexing = self.operands[index]
        if indexing is None:
            return Sharding()
        return Sharding(_split(indexing, option), option.partial_axes, option.partial_type)

    def result_sharding(self, option: ShardingOption, index: int) -> Sharding:
        """How `option` shards result `index`: partial over the axes of its split reductions
        and its partial axes."""
        partial: list[int] = list(option.partial_axes)
        kind = option.partial_type
        rings = ring_loops(option)
        passed = {h for h, _ in rings} | {r for _, r in rings}
        for number, (loop, axes) in enumerate(zip(self.loops, option.loops, strict=True)):
            if loop.kind is IteratorType.REDUCTION and axes and number not in passed:
                partial += axes
                kind = loop.reduction or kind
        return Sharding(_split(self.results[index], option), tuple(partial), kind)


def ring_loops(option: ShardingOption) -> tuple[tuple[int, int], ...]:
    """The (home, ring) loop pairs of a ring attention option: a loop split over exactly the
    axes of an earlier loop (no other option splits two loops over one axis). Each device
    keeps its block of the home loop (its query rows) and sees every block of the ring loop
    (the keys) as the blocks pass around the axes: a tensor indexed by both loops (the
    scores) is split by the home loop alone, one indexed by either alone is split by it (K
    and V arrive split on the sequence; dK and dV leave so), and neither loop leaves a
    partial result (the ring sums dK and dV as they pass)."""
    first: dict[tuple[int, ...], int] = {}
    pairs = []
    for loop, axes in enumerate(option.loops):
        if not axes:
            continue
        if axes in first:
            pairs.append((first[axes], loop))
        else:
            first[axes] = loop
    return tuple(pairs)


def _split(indexing: IndexingMap, option: ShardingOption) -> tuple[tuple[int, ...], ...]:
    """The mesh axes of each dim: those of the loops that index it, in order; under ring
    attention (`ring_loops`) a ring loop's dim is whole where the tensor has its home loop."""
    rings = ring_loops(option)
    indexed = {loop for dim in range(len(indexing.dims)) for loop in indexing.loops(dim)}
    whole = {r for h, r in rings if h in indexed}
    return tuple(
        tuple(a for loop in indexing.loops(dim) if loop not in whole for a in option.loops[loop])
        for dim in range(len(indexing.dims))
    )


def parallel(*sizes: int) -> tuple[Loop, ...]:
    return tuple(Loop(size) for size in sizes)


def reduction(size: int, kind: ReductionKind = ReductionKind.SUM) -> Loop:
    return Loop(size, IteratorType.REDUCTION, kind)


def invalid(size: int) -> Loop:
    return Loop(size, IteratorType.INVALID)


def broadcast_map(shape: Sequence[int], out_rank: int) -> IndexingMap:
    """Numpy broadcasting: an operand's dims align right with the result's loops; a dim of
    size 1 broadcast against a larger loop is indexed by no loop."""
    offset = out_rank - len(shape)
    return IndexingMap.of(*(None if size == 1 else offset + i for i, size in enumerate(shape)))

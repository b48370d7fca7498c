"""Fused regions: ops of a graph that engines run as one kernel (`AttentionRegion`), and what
that kernel keeps of the values inside it (`Fused`).

A flash-attention kernel (PyTorch SDPA, FlashAttention, cuDNN) computes the scores, their
scaling and mask, the softmax and the product with V tile by tile in on-chip memory: none of
the S x S tensors between the two matmuls is written to memory, and the backward recomputes
them from Q, K, V and the softmax's row statistics (its log-sum-exp, float32, one per row),
which is all the kernel keeps of them. A region is priced as one kernel on its softmax (the
forward kernel) and on the softmax's gradient op (the backward kernel); its other ops are
inside those kernels and cost nothing of their own; its values cost no memory but the
softmax's result, held as its row statistics.

The region is found by `autoshard.analysis.attention` and carried by the graph
(`Graph.fused`), so that the search's memory, the program's memory and the op costs all read
it from one place; a training step (`autoshard.training`) extends it to the gradient and
recomputed ops and values derived from the region's.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


class Kernel(enum.StrEnum):
    """What an op of a fused region is priced as (`Fused.kernel`)."""

    FORWARD = "forward"  # the region's forward kernel (its softmax, or a recomputation)
    BACKWARD = "backward"  # the region's backward kernel (the softmax's gradient op)
    INSIDE = "inside"  # inside one of the two: no cost of its own


class Held(enum.StrEnum):
    """How a device holds a value of a fused region (`Fused.held`)."""

    WHOLE = "whole"  # as any value: not inside a kernel
    STATISTICS = "statistics"  # a softmax's result: its row statistics, float32, alone
    NONE = "none"  # inside a kernel: never written to memory


@dataclass(frozen=True)
class AttentionRegion:
    """One attention core, softmax(mask(scale · Q·Kᵀ))·V, as the graph spells it.

    `ops` are its op names from the scores' MatMul to the output's MatMul, `inside` the values
    between them (scores-shaped, [..., s_q, s_kv]), `softmax` the op whose result is
    `probabilities`. `q`, `k`, `v` are the values the kernel reads (k as the graph holds it, not
    transposed, nor expanded to the query heads), `output` the result. `heads` and `kv_heads`
    count the query and key/value heads (GQA: fewer of the latter), `head_dim` the query's
    and key's last dim, `causal` whether the mask is a causal triangle (the kernel skips the
    tiles above the diagonal)."""

    ops: tuple[str, ...]
    inside: tuple[str, ...]
    softmax: str
    probabilities: str
    q: str
    k: str
    v: str
    output: str
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool

    def __str__(self) -> str:
        mask = "causal" if self.causal else "full"
        return (
            f"attention {self.softmax}: {self.heads} heads ({self.kv_heads} kv), head dim "
            f"{self.head_dim}, {mask}"
        )


@dataclass(frozen=True)
class Fused:
    """The fused regions of a graph: each region's ops and values, by name, and for the ops
    and values a training step derives from them (gradients, recomputations) the region op or
    value they come from (`derived`)."""

    regions: tuple[AttentionRegion, ...] = ()
    kernels: Mapping[str, Kernel] = field(default_factory=dict)
    statistics: frozenset[str] = frozenset()
    inside: frozenset[str] = frozenset()
    region_of: Mapping[str, int] = field(default_factory=dict)
    masks: frozenset[str] = frozenset()
    """Ops that make a causal mask only fused causal kernels read (`with_masks`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernels", MappingProxyType(dict(self.kernels)))
        object.__setattr__(self, "region_of", MappingProxyType(dict(self.region_of)))

    @classmethod
    def of(cls, regions: Iterable[AttentionRegion]) -> Fused:
        """The fused regions of a forward graph: each softmax its region's forward kernel."""
        regions = tuple(regions)
        kernels: dict[str, Kernel] = {}
        region_of: dict[str, int] = {}
        for index, region in enumerate(regions):
            for name in region.ops:
                kernels[name] = Kernel.FORWARD if name == region.softmax else Kernel.INSIDE
                region_of[name] = index
        return cls(
            regions,
            kernels,
            frozenset(r.probabilities for r in regions),
            frozenset(v for r in regions for v in r.inside),
            region_of,
        )

    def with_masks(self, ops: Iterable[str], values: Iterable[str]) -> Fused:
        """These regions, knowing that ops `ops` make values `values` for the causal masks of
        their kernels alone: a causal kernel masks its tiles itself (`is_causal`), so the ops
        cost nothing and the values, S x S each, are never written to memory."""
        return dataclasses.replace(
            self, masks=self.masks | frozenset(ops), inside=self.inside | frozenset(values)
        )

    def __bool__(self) -> bool:
        return bool(self.regions)

    def kernel(self, op: str) -> Kernel | None:
        """What op `op` is priced as; None when it is in no fused region."""
        return self.kernels.get(op)

    def region(self, op: str) -> AttentionRegion:
        return self.regions[self.region_of[op]]

    def held(self, value: str) -> Held:
        """How a device holds graph value `value` (`Held`)."""
        if value in self.statistics:
            return Held.STATISTICS
        return Held.NONE if value in self.inside else Held.WHOLE

    def derived(
        self,
        ops: Mapping[str, tuple[str, Kernel | None]],
        values: Mapping[str, tuple[str, bool]],
    ) -> Fused:
        """These regions, with the ops and values a training step derived from theirs: `ops`
        maps a new op to the region op it comes from and the kernel it runs as (None: as that
        op's kind for a recomputation, `Kernel.INSIDE` for a gradient op but the softmax's),
        `values` a new value to the region value it comes from and whether it is a
        recomputation (a recomputed softmax result is held as statistics again; a gradient
        of a value inside is not held at all)."""
        kernels, region_of = dict(self.kernels), dict(self.region_of)
        statistics, inside = set(self.statistics), set(self.inside)
        for new, (old, kernel) in ops.items():
            if old in self.kernels:
                kernels[new] = kernel if kernel is not None else self.kernels[old]
                region_of[new] = self.region_of[old]
        for new, (old, recomputed) in values.items():
            if old in self.inside:
                inside.add(new)
                if recomputed and old in self.statistics:
                    statistics.add(new)
        return Fused(
            self.regions, kernels, frozenset(statistics), frozenset(inside), region_of, self.masks
        )

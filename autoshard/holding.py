"""How a weight is held, in one vocabulary: the words the story, the plan summary, the HTML
report, `explain` and the exports all use, and the key plan documents record.

A weight is *held* (stored) as some sharding, *read* by its forward ops as another, and in a
training step has an optimizer state split some way and a gradient synchronized or not:

| key       | words                                                                  |
|-----------|------------------------------------------------------------------------|
| replicated| replicated                                                             |
| ddp       | replicated, gradients all-reduced (DDP)                                |
| zero      | replicated, optimizer state split (ZeRO-1/2)                           |
| fsdp      | sharded, gathered for use (FSDP/ZeRO-3)                                |
| tp        | split (tensor parallel)                                                |
| tp+zero   | split (tensor parallel), optimizer state split further (TP+ZeRO-1/2)  |
| tp+fsdp   | split (tensor parallel), sharded further, gathered for use (TP+FSDP)  |

`ddp` says its gradient is all-reduced only where it is (a training step whose batch is split);
a replicated weight with no gradient sync, or in a forward pass, is `replicated`. Lists of
weights join their kinds with `; ` (`225 replicated, optimizer state split (ZeRO-1/2); 65
replicated, gradients all-reduced (DDP)`): the words hold commas of their own.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping


class Holding(enum.StrEnum):
    """How a weight is held; its value is the key plan documents and exports record."""

    REPLICATED = "replicated"
    DDP = "ddp"
    ZERO = "zero"
    FSDP = "fsdp"
    TP = "tp"
    TP_ZERO = "tp+zero"
    TP_FSDP = "tp+fsdp"

    @property
    def words(self) -> str:
        """The words every page uses for it (the table of the module docstring)."""
        return WORDS[self]


WORDS: Mapping[Holding, str] = {
    Holding.REPLICATED: "replicated",
    Holding.DDP: "replicated, gradients all-reduced (DDP)",
    Holding.ZERO: "replicated, optimizer state split (ZeRO-1/2)",
    Holding.FSDP: "sharded, gathered for use (FSDP/ZeRO-3)",
    Holding.TP: "split (tensor parallel)",
    Holding.TP_ZERO: "split (tensor parallel), optimizer state split further (TP+ZeRO-1/2)",
    Holding.TP_FSDP: "split (tensor parallel), sharded further, gathered for use (TP+FSDP)",
}


def holding(
    held: Iterable[int],
    read: Iterable[int],
    state: Iterable[int] = (),
    synced: bool = False,
) -> Holding:
    """A weight held split over mesh axes `held`, read split over `read` (the union over its
    forward readers), its optimizer state split over `state` and its gradient all-reduced
    (`synced`) or not. Held further than read: gathered for use (FSDP); else a state split
    further than held: ZeRO."""
    held, read, state = frozenset(held), frozenset(read), frozenset(state)
    further, zero = held - read, state - held
    if read:
        return Holding.TP_FSDP if further else Holding.TP_ZERO if zero else Holding.TP
    if further:
        return Holding.FSDP
    if zero:
        return Holding.ZERO
    return Holding.DDP if synced else Holding.REPLICATED


def words_of(key: str) -> str:
    """The words for a recorded key; a key this version does not know, as it is."""
    try:
        return Holding(key).words
    except ValueError:
        return key


def counts_text(counts: Mapping[str, int], notes: Mapping[str, str] | None = None) -> str:
    """`225 replicated, optimizer state split (ZeRO-1/2); 65 replicated` of counts by key
    (in their order), each with its note after a comma where `notes` has one."""
    told = []
    for key, n in counts.items():
        note = (notes or {}).get(key)
        told.append(f"{n} {words_of(key)}" + (f", {note}" if note else ""))
    return "; ".join(told)

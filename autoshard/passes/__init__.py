"""Passes over a sharded program, each a pure function named with a verb."""

import enum


class Stage(enum.StrEnum):
    """The stages after a plan is decided, in the order they run; after each the program can
    be printed (`--dump-after`)."""

    MATERIALIZE = "materialize"  # reshards inserted as collectives (passes/materialize.py)
    CCL = "ccl"  # collectives fused, reassociated, moved (passes/ccl.py)
    PARTITION = "partition"  # each device's local program (passes/partition.py)

"""Error types of autoshard.

Every error a user can cause is an `AutoshardError` whose message names the culprit and, where
there are any, the valid choices. The CLI prints the message on one line and exits non-zero;
the REST service maps it to a 4xx. Anything else escaping is a bug.
"""

from __future__ import annotations


class AutoshardError(Exception):
    """Base of every user-facing error: the message is complete and fits on one line."""


class MeshError(AutoshardError, ValueError):
    """A mesh spec that cannot be a device mesh (`4x?`, `0x8`, duplicate axis names...)."""


class ShardingError(AutoshardError, ValueError):
    """A sharding that is malformed or does not fit its mesh or tensor."""


class CollectiveError(AutoshardError, ValueError):
    """A collective whose fields do not fit its kind (an all_reduce with a `dim`...)."""


class LimitError(AutoshardError, ValueError):
    """An input beyond one of autoshard's explicit limits (`autoshard/limits.py`), named in the
    message."""


class ModelError(AutoshardError):
    """A model file that cannot be imported: unreadable, malformed or unsupported."""


class UnboundDimError(ModelError):
    """Symbolic dims of the model's inputs that the user has not bound with `--dim NAME=SIZE`.

    `unbound` maps each dim name to the `input[axis]` places that carry it.
    """

    def __init__(self, message: str, unbound: dict[str, list[str]] | None = None) -> None:
        super().__init__(message)
        self.unbound = unbound or {}


class GraphError(AutoshardError):
    """A graph that breaks an invariant of the IR (found by `verify`)."""


class MlirError(AutoshardError, ValueError):
    """MLIR text that is not autoshard's notation, or a program the notation cannot express."""


class ClusterError(AutoshardError, ValueError):
    """A bad cluster description: the message names the flag or key and the valid choices."""


class PipelineError(AutoshardError, ValueError):
    """A pipeline that cannot be: its axis, stages, micro-batches or schedule."""

"""The command line: `autoshard COMMAND ...`.

`main` here is the console script's entry point. It imports the command line (numpy, onnx and
the planner: a fraction of a second) inside its own handler, so that Ctrl-C while Python is
still importing ends as it does later: `autoshard: interrupted`, exit 130, no traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

INTERRUPTED = 130
"""The exit status of a run the user interrupted (128 + SIGINT), as shells report it."""


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from autoshard.cli.main import main as run
    except KeyboardInterrupt:
        print("autoshard: interrupted", file=sys.stderr)
        return INTERRUPTED
    return run(argv)


__all__ = ["main"]

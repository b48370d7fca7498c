"""The command line: `autoshard COMMAND ...`.

`main` here is the console script's entry point. It imports the command line (numpy, onnx and
the planner: a fraction of a second) inside its own handler, so that Ctrl-C while Python is
still importing ends as it does later: `autoshard: interrupted`, exit 130, no traceback. An
extension module may turn the interrupt into an ImportError (numpy's core, interrupted while
it imports `datetime`, raises one): a SIGINT seen during the imports decides, whatever they
raise.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from types import FrameType

INTERRUPTED = 130
"""The exit status of a run the user interrupted (128 + SIGINT), as shells report it."""


def main(argv: Sequence[str] | None = None) -> int:
    seen: list[int] = []

    def interrupt(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGINT, interrupt)
        try:
            from autoshard.cli.main import main as run
        finally:
            signal.signal(signal.SIGINT, previous)
    except BaseException:
        if not seen and not isinstance(sys.exception(), KeyboardInterrupt):
            raise
        print("autoshard: interrupted", file=sys.stderr)
        return INTERRUPTED
    return run(argv)


__all__ = ["main"]

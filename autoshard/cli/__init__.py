"""The command line: `autoshard COMMAND ...`."""

from autoshard.cli.main import main

__all__ = ["main"]

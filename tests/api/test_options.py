"""The plan request's options module: its docstring example is the canonical form's promise,
so it runs as a test (CI runs no doctests otherwise)."""

from __future__ import annotations

import doctest

from service import options


def test_module_doctest_holds() -> None:
    result = doctest.testmod(options)
    assert (result.attempted, result.failed) == (4, 0)

"""Fixtures shared by every test folder."""

import signal
import warnings
from collections.abc import Iterator

import pytest

pytest_plugins = ["tests.browser"]


def _sigint() -> tuple[object, bool]:
    """SIGINT's handler in this process and whether the main thread blocks it: what a child
    process started now inherits (an ignored or blocked SIGINT survives exec)."""
    return signal.getsignal(signal.SIGINT), signal.SIGINT in signal.pthread_sigmask(
        signal.SIG_BLOCK, []
    )


@pytest.fixture(autouse=True)
def _sigint_kept(request: pytest.FixtureRequest) -> Iterator[None]:
    """Warn naming a test that leaves SIGINT ignored or blocked in the pytest process, so
    that the code behind it is found (a user's process embedding it would lose Ctrl-C)."""
    before = _sigint()
    yield
    after = _sigint()
    if after != before:
        warnings.warn(f"{request.node.nodeid} changed SIGINT: {before} -> {after}", stacklevel=1)
        if callable(before[0]) or before[0] in (signal.SIG_DFL, signal.SIG_IGN):
            signal.signal(signal.SIGINT, before[0])  # type: ignore[arg-type]
        if after[1] and not before[1]:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])

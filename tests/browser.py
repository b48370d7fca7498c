"""A real headless browser for tests of the pages we serve and write: Debian's Chromium driven by
Playwright. Every page records its console messages and uncaught errors, so a test can assert
that a page rendered without any.

CI installs Chromium with apt (.ci/run); where it is missing the browser tests skip, except on
CI, where a missing browser is a failure.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Console:
    """What a page said: console messages by type, and uncaught exceptions."""

    messages: list[tuple[str, str]] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)

    @property
    def errors(self) -> list[str]:
        found = [text for kind, text in self.messages if kind in ("error", "warning")]
        return found + self.exceptions


def _require_browser() -> Any:
    if CHROMIUM is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed (.ci/run installs it with apt)")
        pytest.skip("chromium is not installed (apt install chromium)")
    return pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One headless Chromium for the session."""
    sync_api = _require_browser()
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[tuple[Any, Console]]:
    """A fresh page of 1280x900, and what it says on its console."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    console = Console()
    opened.on("console", lambda m: console.messages.append((m.type, m.text)))
    opened.on("pageerror", lambda e: console.exceptions.append(str(e)))
    yield opened, console
    context.close()

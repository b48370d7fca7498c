"""Fixtures shared by every test folder."""

pytest_plugins = ["tests.browser"]

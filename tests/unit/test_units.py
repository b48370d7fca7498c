"""Sizes and times as the summaries print them (`autoshard.units`)."""

import pytest

from autoshard.units import format_seconds


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.00128, "1.28 ms"), (9.999999e-4, "1 ms"), (0.99999, "1 s"), (9.9999e-7, "1 µs"),
     (59.99, "60 s"), (0.0, "0 s"), (-0.0012, "-1.2 ms")],
)  # fmt: skip
def test_seconds_take_the_unit_of_their_rounded_value(seconds, text):
    assert format_seconds(seconds) == text

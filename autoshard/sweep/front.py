"""The Pareto fronts of a sweep: the points no other point beats on both step time and
resources (devices, or the cost of a step at a price per device-hour)."""

from __future__ import annotations

from collections.abc import Sequence


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """The indices of the points no other point dominates, both coordinates minimized (one
    dominates another when it is no worse in both and better in one; of equal points the
    first stands), by increasing first coordinate.

    >>> pareto_front([(8, 3.0), (16, 2.0), (16, 2.5), (32, 2.0), (64, 1.0)])
    [0, 1, 4]
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1], i))
    front: list[int] = []
    best = float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def step_cost(devices: int, step_time_s: float, price_per_device_hour: float) -> float:
    """What one step costs: the devices' time at their price."""
    return devices * step_time_s * price_per_device_hour / 3600.0

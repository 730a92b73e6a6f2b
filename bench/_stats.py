"""Small statistics shared by the benchmarks."""

from __future__ import annotations


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]

"""--metrics-config: which latency families to publish and how."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from geserve.errors import InvalidArgumentError


def _bool(key: str, value: str) -> bool:
    lowered = value.lower()
    if lowered in ("true", "1"):
        return True
    if lowered in ("false", "0"):
        return False
    raise InvalidArgumentError(f"--metrics-config {key} must be true or false, got '{value}'")


def parse_entries(entries: Sequence[str]) -> dict[str, Any]:
    """`key=value` entries as given to --metrics-config -> MetricsSettings fields."""
    values: dict[str, Any] = {}
    for entry in entries:
        key, separator, value = entry.partition("=")
        if not separator:
            raise InvalidArgumentError(f"--metrics-config expects key=value, got '{entry}'")
        if key in ("counter_latencies", "summary_latencies", "histogram_latencies"):
            values[key] = _bool(key, value)
        elif key == "summary_quantiles":
            values[key] = _quantiles(value)
        else:
            raise InvalidArgumentError(f"unknown --metrics-config key '{key}'")
    return values


def _quantiles(text: str) -> tuple[tuple[float, float], ...]:
    pairs = []
    for item in text.split(","):
        quantile, _, error = item.partition(":")
        try:
            pairs.append((float(quantile), float(error)))
        except ValueError:
            raise InvalidArgumentError(f"summary_quantiles expects quantile:error pairs, got '{item}'") from None
        if not 0.0 <= pairs[-1][0] <= 1.0:
            raise InvalidArgumentError(f"summary quantile {quantile} must be in [0, 1]")
    return tuple(pairs)

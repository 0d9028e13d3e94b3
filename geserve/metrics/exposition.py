"""The Prometheus text format as Triton's prometheus-cpp writes it (integral values without '.0')."""

from __future__ import annotations

import math

from prometheus_client.registry import CollectorRegistry

CONTENT_TYPE = "text/plain; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**63:
        return str(int(value))
    return repr(float(value))


def render(registry: CollectorRegistry) -> bytes:
    """Every family of the registry in text exposition format 0.0.4."""
    lines: list[str] = []
    for metric in registry.collect():
        lines.append(f"# HELP {metric.name} {_escape(metric.documentation)}")
        lines.append(f"# TYPE {metric.name} {metric.type}")
        for sample in metric.samples:
            labels = ",".join(f'{key}="{_escape(value)}"' for key, value in sample.labels.items())
            lines.append(
                f"{sample.name}{{{labels}}} {format_value(sample.value)}"
                if labels
                else f"{sample.name} {format_value(sample.value)}"
            )
    return ("\n".join(lines) + "\n").encode()

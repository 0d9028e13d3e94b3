"""What `geserve check` reports: one problem a line, and what it learned of each model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from geserve._generated import model_config_pb2 as mc


@dataclass(frozen=True, slots=True)
class Problem:
    path: Path
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.field}: {self.message}"


@dataclass(slots=True)
class Checked:
    """One model's problems, and the config of each version that checked clean, as its load would complete it."""

    problems: list[Problem] = field(default_factory=list)
    notes: list[Problem] = field(default_factory=list)  # what check cannot decide offline: printed, not failed
    # What loads, but otherwise than the config reads (a batch dim taken from the graph): printed, not failed.
    warnings: list[Problem] = field(default_factory=list)
    configs: dict[int, mc.ModelConfig] = field(default_factory=dict)
    # Why load may add to its config what check cannot know (model code, a compile check does not run); "" if not.
    completed_at_load: str = ""


def unchecked(message: str, reasons: Mapping[str, str]) -> str:
    """A message check cannot confirm: it read configs that load completes further (model -> why)."""
    read = "; ".join(f"{model}: {reason}" for model, reason in sorted(reasons.items()))
    return f"not checked: {message}, as read from config.pbtxt ({read})"

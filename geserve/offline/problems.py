"""What `geserve check` reports: one problem a line, and what it learned of each model."""

from __future__ import annotations

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
    configs: dict[int, mc.ModelConfig] = field(default_factory=dict)
    completes_itself: bool = False  # a python model whose auto_complete_config (not run here) may add to its config

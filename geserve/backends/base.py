"""The Backend protocol every execution backend implements."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from geserve._generated import model_config_pb2 as mc


class Backend(Protocol):
    """One model instance on one device.

    Lifecycle: `load` -> `complete_config` -> any number of `execute` -> `unload`. All calls
    happen in the worker that owns the instance, never on the front-end's event loop.
    """

    def load(self, config: mc.ModelConfig, model_path: Path, device_id: int) -> None:
        """Open the model file (or folder) at `model_path` on `device_id`."""

    def complete_config(self, config: mc.ModelConfig, auto_complete: bool) -> None:
        """With `auto_complete`, fill what the config leaves out from the model file (inputs,
        outputs, dtypes, dims, max_batch_size); then check the config against the model file and
        raise ModelLoadError naming both where they disagree."""

    def execute(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        """Run one batch; inputs and outputs carry the batch dimension when the model batches."""

    def unload(self) -> None:
        """Release everything `load` acquired."""

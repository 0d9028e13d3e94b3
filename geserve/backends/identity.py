"""Identity backend: output i is input i, after an optional `execute_delay_ms`; for tests and benchmarks."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from geserve._generated import model_config_pb2 as mc
from geserve.backends.base import OutputAllocator
from geserve.codecs import dtypes
from geserve.errors import ModelLoadError


class IdentityBackend:
    """Copies each input to the output at the same position, converted to the output's dtype."""

    def __init__(self) -> None:
        self._output_source: dict[str, tuple[str, np.dtype[np.generic]]] = {}
        self._delay_s = 0.0

    def load(self, config: mc.ModelConfig, model_path: Path, device_id: int) -> None:
        parameter = config.parameters.get("execute_delay_ms")
        if parameter is not None:
            try:
                self._delay_s = float(parameter.string_value) / 1000.0
            except ValueError:
                raise ModelLoadError(
                    f"model '{config.name}': parameter 'execute_delay_ms' must be a number, "
                    f"got '{parameter.string_value}'"
                ) from None

    def complete_config(self, config: mc.ModelConfig, auto_complete: bool) -> None:
        if len(config.output) > len(config.input):
            raise ModelLoadError(
                f"model '{config.name}': the identity backend needs an input for every output "
                f"({len(config.input)} inputs, {len(config.output)} outputs)"
            )
        for source, output in zip(config.input, config.output, strict=False):
            self._output_source[output.name] = (source.name, dtypes.from_config(output.data_type).numpy)

    def execute(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str], allocate: OutputAllocator | None = None
    ) -> dict[str, np.ndarray]:
        if self._delay_s:
            time.sleep(self._delay_s)
        outputs = {}
        for name in output_names:
            source, dtype = self._output_source[name]
            outputs[name] = inputs[source].astype(dtype, copy=False)
        return outputs

    def unload(self) -> None:
        self._output_source.clear()


def create_backend() -> IdentityBackend:
    return IdentityBackend()

"""MLServer model for `make bench-npu-peers`: sleeps t(b) = t0 + k*b for a batch of b, returns zeros."""

from __future__ import annotations

import os
import time

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class SleepingModel(MLModel):
    async def load(self) -> bool:
        extra = self._settings.parameters.extra  # type: ignore[union-attr]
        self._t0_us, self._k_us = float(extra["t0_us"]), float(extra["k_us"])
        self._log = os.open(extra["batch_log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        batch = NumpyCodec.decode_input(payload.inputs[0]).shape[0]
        # Blocking, as a device is: one batch at a time per worker (asyncio.sleep would overlap batches).
        time.sleep((self._t0_us + self._k_us * batch) / 1e6)  # noqa: ASYNC251
        os.write(self._log, f"{batch}\n".encode())
        output = NumpyCodec.encode_output("output", np.zeros((batch, 1000), np.float32))
        output.parameters = None  # perf_analyzer's HTTP client expects binary_data_size in any parameters
        return InferenceResponse(model_name=self.name, outputs=[output])

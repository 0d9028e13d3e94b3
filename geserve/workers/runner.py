"""InstanceRunner: builds one backend instance from an InstanceSpec and executes batches on it."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from geserve._generated import model_config_pb2 as mc
from geserve.backends import registry
from geserve.backends.base import Backend
from geserve.errors import GeserveError, InternalError, ModelLoadError
from geserve.workers.messages import Execute, Executed, InstanceSpec

logger = logging.getLogger(__name__)


class InstanceRunner:
    """The backend side of a worker, shared by the in-process and the process worker."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.spec = spec
        self._backend: Backend | None = None

    def load(self) -> mc.ModelConfig:
        """Load the backend and return the config it serves; raises ModelLoadError."""
        spec = self.spec
        config = mc.ModelConfig.FromString(spec.config)
        try:
            backend = registry.by_name(spec.backend).create()
            backend.load(config, Path(spec.model_path), spec.device_id)
            backend.complete_config(config, spec.auto_complete)
        except GeserveError as error:
            raise ModelLoadError(error.message) from None
        except Exception as error:
            logger.exception("instance %s failed to load", spec.instance_name)
            raise ModelLoadError(f"model '{spec.model_name}': {type(error).__name__}: {error}") from None
        self._backend = backend
        return config

    def execute(self, message: Execute) -> Executed:
        """Run one batch; any failure becomes the batch's error, never an exception."""
        backend = self._backend
        started = time.monotonic_ns()
        if backend is None:
            error: GeserveError = InternalError(f"instance '{self.spec.instance_name}' is not loaded")
            return Executed(message.request_id, None, error, started, started)
        try:
            outputs = backend.execute(message.inputs, message.output_names)
            missing = [name for name in message.output_names if name not in outputs]
            if missing:
                raise InternalError(f"model '{self.spec.model_name}' did not produce output(s) {missing}")
        except GeserveError as error:
            return Executed(message.request_id, None, error, started, time.monotonic_ns())
        except Exception as error:
            logger.exception("instance %s failed to execute", self.spec.instance_name)
            failure = InternalError(
                f"model '{self.spec.model_name}' failed to execute: {type(error).__name__}: {error}"
            )
            return Executed(message.request_id, None, failure, started, time.monotonic_ns())
        finished = time.monotonic_ns()
        answer = {name: outputs[name] for name in message.output_names}
        return Executed(message.request_id, answer, None, started, finished)

    def unload(self) -> None:
        if self._backend is not None:
            try:
                self._backend.unload()
            except Exception:
                logger.exception("instance %s failed to unload", self.spec.instance_name)
            self._backend = None

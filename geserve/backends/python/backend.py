"""PythonBackend: a `model.py` with Triton's `TritonPythonModel`, run in its worker process."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import json
import logging
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format

from geserve._generated import model_config_pb2 as mc
from geserve.backends.base import BackendRequest, OutputAllocator, RequestResult, ResponseEmitter
from geserve.backends.python import pb_utils
from geserve.errors import (
    AlreadyExistsError,
    CancelledError,
    GeserveError,
    InternalError,
    InvalidArgumentError,
    ModelLoadError,
    NotFoundError,
    UnavailableError,
    UnknownError,
    UnsupportedError,
)
from geserve.repository.config import config_to_json
from geserve.types import SERVER_PARAMETERS, CustomMetric, with_parameters

logger = logging.getLogger(__name__)

DEFAULT_FILENAME = "model.py"
_ERRORS: dict[int, type[GeserveError]] = {
    pb_utils.TritonError.INVALID_ARG: InvalidArgumentError,
    pb_utils.TritonError.NOT_FOUND: NotFoundError,
    pb_utils.TritonError.UNAVAILABLE: UnavailableError,
    pb_utils.TritonError.UNSUPPORTED: UnsupportedError,
    pb_utils.TritonError.ALREADY_EXISTS: AlreadyExistsError,
    pb_utils.TritonError.CANCELLED: CancelledError,
    pb_utils.TritonError.UNKNOWN: UnknownError,
}


class _SenderAnswers:
    """What a non-decoupled batch's requests answered through their response senders: each request's response and
    whether its FINAL flag came, which execute may leave to other threads after it returns."""

    def __init__(self) -> None:
        self._responses: dict[int, pb_utils.InferenceResponse] = {}
        self._finals: set[int] = set()
        self._changed = threading.Condition()

    def record(self, index: int, response: pb_utils.InferenceResponse | None, final: bool) -> None:
        with self._changed:
            if response is not None:
                self._responses[index] = response
            if final:
                self._finals.add(index)
            self._changed.notify_all()

    def responded(self, index: int) -> bool:
        with self._changed:
            return index in self._responses

    def final(self, index: int) -> bool:
        with self._changed:
            return index in self._finals

    def response(self, index: int) -> pb_utils.InferenceResponse | None:
        with self._changed:
            return self._responses.get(index)

    def wait_final(
        self, index: int, model: str, cancelled: Callable[[], bool]
    ) -> pb_utils.InferenceResponse | GeserveError | None:
        """The request's response once its FINAL flag came. Triton waits for it without end; so does this, saying in
        the log every minute which request is still waited for, unless the request is cancelled (its client went
        away), which ends the wait with a CANCELLED error."""
        waited = 0.0
        with self._changed:
            while not self._changed.wait_for(lambda: index in self._finals, timeout=_CANCEL_CHECK_S):
                if cancelled():
                    return CancelledError(
                        f"model '{model}': the request was cancelled before it was answered through its response sender"
                    )
                waited += _CANCEL_CHECK_S
                if waited >= _FINAL_WAIT_LOG_S:
                    waited = 0.0
                    logger.warning(
                        "model '%s': request %d of the batch has not sent its final response through its response "
                        "sender; execute returned None, so it is waited for",
                        model,
                        index,
                    )
            return self._responses.get(index)


# How often a request answered through its sender, and still waited for, is named in the log, and how often whether
# it was cancelled is looked at meanwhile.
_FINAL_WAIT_LOG_S = 60.0
_CANCEL_CHECK_S = 0.5


def _python_error(error: BaseException) -> str:
    """A Python exception as Triton's python backend words it (pybind11's error_already_set): the type and message,
    then `At:` and each frame of the model's code, innermost first."""
    frames = traceback.extract_tb(error.__traceback__)[1:]  # the first is the call into execute
    lines = "".join(f"  {frame.filename}({frame.lineno}): {frame.name}\n" for frame in reversed(frames))
    return f"{last_line(error)}\n\nAt:\n{lines}" if lines else last_line(error)


def last_line(error: BaseException) -> str:
    """The last line of the error's traceback, e.g. "ModuleNotFoundError: No module named 'x'"."""
    return traceback.format_exception_only(type(error), error)[-1].strip()


class PythonBackend:
    """Loads model.py, completes the config with `auto_complete_config`, calls `initialize`, hands
    `execute` the batch's requests, and `finalize` on unload."""

    def __init__(self) -> None:
        self._class: Any = None
        self._model: Any = None
        self._name = ""
        self._path = Path()
        self._device_id = 0
        self._instance_name = ""
        self._instance_kind = "CPU"
        self._decoupled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def describe_instance(self, name: str, kind: str) -> None:
        """The instance's name and kind ("CPU", "GPU", "MODEL"), for `initialize`'s args."""
        self._instance_name, self._instance_kind = name, kind

    # -- loading -------------------------------------------------------------------------------

    def load(self, config: mc.ModelConfig, model_path: Path, device_id: int) -> None:
        self._name = config.name
        self._device_id = device_id
        path = model_path / DEFAULT_FILENAME if model_path.is_dir() else model_path
        if not path.is_file():
            raise ModelLoadError(f"model '{config.name}': python model file '{path}' does not exist")
        self._path = path
        sys.modules.setdefault("triton_python_backend_utils", pb_utils)
        # model.py may import modules that sit next to it, as under Triton.
        sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(f"geserve_python_model_{config.name}", path)
        if spec is None or spec.loader is None:
            raise ModelLoadError(f"model '{config.name}': cannot import '{path}'")
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except BaseException as error:
            logger.exception("importing %s failed", path)
            raise ModelLoadError(f"model '{config.name}': failed to load '{path}': {last_line(error)}") from None
        self._class = getattr(module, "TritonPythonModel", None)
        if not inspect.isclass(self._class):
            raise ModelLoadError(f"model '{config.name}': '{path}' does not define a class TritonPythonModel")

    def complete_config(self, config: mc.ModelConfig, auto_complete: bool) -> None:
        if auto_complete and hasattr(self._class, "auto_complete_config"):
            self._auto_complete(config)
        self._decoupled = config.model_transaction_policy.decoupled
        try:
            self._model = self._class()
            initialize = getattr(self._model, "initialize", None)
            if initialize is not None:
                self._wait(initialize(self._initialize_args(config)))
        except BaseException as error:
            logger.exception("initialize of model '%s' failed", config.name)
            raise ModelLoadError(f"model '{config.name}': initialize failed: {last_line(error)}") from None

    def _auto_complete(self, config: mc.ModelConfig) -> None:
        wrapper = pb_utils.ModelConfig(config_to_json(config))
        try:
            completed = self._class.auto_complete_config(wrapper)
            if not isinstance(completed, pb_utils.ModelConfig):
                raise TypeError(f"auto_complete_config returned {type(completed).__name__}, not pb_utils.ModelConfig")
            parsed = json_format.ParseDict(completed.as_dict(), mc.ModelConfig())
        except BaseException as error:
            logger.exception("auto_complete_config of model '%s' failed", config.name)
            raise ModelLoadError(f"model '{config.name}': auto_complete_config failed: {last_line(error)}") from None
        config.CopyFrom(parsed)

    def _initialize_args(self, config: mc.ModelConfig) -> dict[str, str]:
        return {
            "model_config": json.dumps(config_to_json(config)),
            "model_instance_kind": self._instance_kind,
            "model_instance_name": self._instance_name or f"{config.name}_0",
            "model_instance_device_id": str(self._device_id),
            "model_repository": str(self._path.parent.parent),
            "model_version": self._path.parent.name,
            "model_name": config.name,
        }

    # -- execution -----------------------------------------------------------------------------

    def execute(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str], allocate: OutputAllocator | None = None
    ) -> dict[str, np.ndarray]:
        raise InternalError(f"model '{self._name}': the python backend runs requests, not bare batches")

    def execute_requests(self, requests: Sequence[BackendRequest], emit: ResponseEmitter) -> list[RequestResult] | None:
        answers = _SenderAnswers()
        prepared = [self._request(index, request, emit, answers) for index, request in enumerate(requests)]
        try:
            returned = self._model.execute(prepared)
            if inspect.isawaitable(returned):
                if self._decoupled:
                    # Decoupled coroutines run side by side and answer through their senders (what they return is
                    # not looked at, as in Triton).
                    self._submit(returned).add_done_callback(self._log_failure)
                    return None
                returned = self._wait(returned)
        except GeserveError:
            raise
        except BaseException as error:
            text = self._failed(_python_error(error))
            logger.error("%s", text)
            raise InternalError(text) from None
        if self._decoupled:
            if returned is not None:
                self._refuse_returned(prepared, emit)
            return None
        if returned is None:  # answered through the response senders, maybe after execute returned
            return [self._sent(answers, index, requests[index]) for index in range(len(requests))]
        return self._results(returned, requests, answers)

    def _failed(self, message: str) -> str:
        """Triton's text for a failed execute (python_backend pb_stub.cc), which names the instance."""
        instance = self._instance_name or f"{self._name}_0"
        return f"Failed to process the request(s) for model '{instance}', message: {message}"

    def _refuse_returned(self, prepared: Sequence[pb_utils.InferenceRequest], emit: ResponseEmitter) -> None:
        """A decoupled model returned responses: every request not answered in full fails, as in Triton."""
        text = self._failed(
            f"Python model '{self._name}' is using the decoupled mode and the execute function must return None."
        )
        logger.error("%s", text)
        for index, request in enumerate(prepared):
            if request.get_response_sender()._close():  # the server's own final answer
                emit(index, None, InternalError(text), True)

    def _request(
        self, index: int, request: BackendRequest, emit: ResponseEmitter, answers: _SenderAnswers
    ) -> pb_utils.InferenceRequest:
        parameters = request.parameters
        flags = (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if parameters.get("sequence_start") else 0) | (
            pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if parameters.get("sequence_end") else 0
        )
        timeout = parameters.get("timeout", 0)
        correlation = parameters.get("sequence_id", 0)
        prepared = pb_utils.InferenceRequest(
            model_name=self._name,
            # Copies: the batch's views into shared memory are reused by the next batch, while a model may
            # keep its requests (a decoupled model answers from its own threads after execute returns).
            inputs=[pb_utils.Tensor(name, np.array(array, copy=True)) for name, array in request.inputs.items()],
            requested_output_names=list(request.output_names),
            request_id=request.request_id,
            correlation_id=correlation if isinstance(correlation, int | str) else 0,
            flags=flags,
            timeout=timeout if isinstance(timeout, int) else 0,
            parameters={key: value for key, value in parameters.items() if key not in SERVER_PARAMETERS},
        )

        def handle(response: pb_utils.InferenceResponse | None, final: bool) -> None:
            if self._decoupled:
                outputs, error = _unpack(response, self._name) if response is not None else (None, None)
                emit(index, outputs, error, final)
            else:
                answers.record(index, response, final)

        sender = pb_utils.InferenceResponseSender(handle, request.cancelled, decoupled=self._decoupled)
        prepared.attach(sender, request.cancelled)
        return prepared

    def _results(
        self, returned: Any, requests: Sequence[BackendRequest], answers: _SenderAnswers
    ) -> list[RequestResult]:
        count = len(requests)
        if not isinstance(returned, list | tuple) or len(returned) != count:
            size = len(returned) if isinstance(returned, list | tuple) else type(returned).__name__
            failure = InternalError(
                self._failed(
                    "Number of InferenceResponse objects do not match the number of InferenceRequest objects. "
                    f"InferenceRequest(s) size is:{count}, and InferenceResponse(s) size is:{size}"
                )
            )
            return [failure] * count
        if any(entry is not None and answers.responded(index) for index, entry in enumerate(returned)):
            # Answered twice, through the sender and in the list: Triton fails every request not answered in full.
            failure = InternalError(
                self._failed("Unable to send response. Non-decoupled model cannot send more than one response.")
            )
            return [
                self._unpacked(answers.response(index)) if answers.final(index) else failure for index in range(count)
            ]
        results: list[RequestResult] = []
        for index, response in enumerate(returned):
            if response is None:  # this request is answered through its sender
                results.append(self._sent(answers, index, requests[index]))
            elif not isinstance(response, pb_utils.InferenceResponse):
                results.append(
                    InternalError(
                        f"model '{self._name}': execute returned {type(response).__name__} "
                        "where an InferenceResponse was expected"
                    )
                )
            else:
                results.append(self._unpacked(response))
        return results

    def _sent(self, answers: _SenderAnswers, index: int, request: BackendRequest) -> RequestResult:
        """What request `index` answered through its sender, waited for."""
        answered = answers.wait_final(index, self._name, request.cancelled)
        return answered if isinstance(answered, GeserveError) else self._unpacked(answered)

    def _unpacked(self, response: pb_utils.InferenceResponse | None) -> RequestResult:
        outputs, error = _unpack(response, self._name) if response is not None else ({}, None)
        return error if error is not None else outputs or {}

    # -- readiness, async and unloading --------------------------------------------------------

    def model_ready(self) -> bool:
        is_ready = getattr(self._model, "is_ready", None)
        if is_ready is None:
            return True
        try:
            return bool(self._wait(is_ready()))
        except Exception:
            logger.exception("is_ready of model '%s' failed", self._name)
            return False

    def custom_metrics(self) -> list[CustomMetric]:
        """The series of every pb_utils.MetricFamily the model created."""
        kinds = {pb_utils.MetricFamily.COUNTER: "counter", pb_utils.MetricFamily.GAUGE: "gauge"}
        series = []
        for family in list(pb_utils.MetricFamily.families.values()):
            for metric in list(family.metrics):
                series.append(
                    CustomMetric(
                        family.name,
                        family.description,
                        kinds.get(family.kind, "histogram"),
                        tuple(sorted(metric.labels.items())),
                        metric.value,
                        tuple(metric.buckets),
                        tuple(metric.counts) if family.kind == pb_utils.MetricFamily.HISTOGRAM else (),
                        metric.sum,
                        metric.set_ns,
                    )
                )
        return series

    def _submit(self, coroutine: Any) -> Future[Any]:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="geserve-python-model", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _wait(self, value: Any) -> Any:
        return self._submit(value).result() if inspect.isawaitable(value) else value

    def _log_failure(self, future: Future[Any]) -> None:
        error = future.exception()
        if error is not None:
            logger.error("execute of model '%s' failed: %s", self._name, last_line(error))

    def unload(self) -> None:
        finalize = getattr(self._model, "finalize", None)
        if finalize is not None:
            try:
                self._wait(finalize())
            except Exception:
                logger.exception("finalize of model '%s' failed", self._name)
        self._model = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        with contextlib.suppress(ValueError):
            sys.path.remove(str(self._path.parent))


def _unpack(
    response: pb_utils.InferenceResponse, model: str
) -> tuple[dict[str, np.ndarray] | None, GeserveError | None]:
    error = response.error()
    if error is not None:
        message = error.message() if isinstance(error, pb_utils.TritonError) else str(error)
        code = error.code() if isinstance(error, pb_utils.TritonError) else pb_utils.TritonError.INTERNAL
        return None, _ERRORS.get(code, InternalError)(message)
    outputs: dict[str, np.ndarray] = {}
    for tensor in response.output_tensors():
        if not isinstance(tensor, pb_utils.Tensor):
            return None, InternalError(
                f"model '{model}': a response holds {type(tensor).__name__}, not a pb_utils.Tensor"
            )
        outputs[tensor.name()] = tensor.as_numpy()
    text = response.parameters()
    # Checked when the response was made; "{}" (none set) is by far the most common, and costs no parse.
    return with_parameters(outputs, json.loads(text) if text != "{}" else {}), None

"""Triton's `model_warmup`: the samples a version's config asks for, built and checked as Triton does."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import numpy as np

from geserve._generated import model_config_pb2 as mc
from geserve.batching.warmup import WarmupSample
from geserve.codecs import dtypes
from geserve.core.models import ModelVersion
from geserve.core.validation import validate_inputs
from geserve.errors import GeserveError, ModelLoadError
from geserve.residency import SharedTensor
from geserve.types import InferInput, InferRequest

logger = logging.getLogger(__name__)

# Where `input_data_file` names are looked up, in the model's folder (Triton's kWarmupDataFolder).
WARMUP_FOLDER = "warmup"
# BYTES elements are framed with a 4-byte length: zero data is that many empty strings.
_BYTES_ELEMENT_SIZE = 4


def refuse_for_ensemble(config: mc.ModelConfig) -> None:
    """An ensemble runs its steps' models, which warm up themselves: Triton refuses the field there."""
    if config.model_warmup:
        raise ModelLoadError(f"model_warmup can not be specified for ensemble '{config.name}'")


def build_samples(model: ModelVersion, model_directory: Path) -> list[WarmupSample]:
    """Every sample of the version's `model_warmup`, its requests checked against the config as a client's
    would be; a sample Triton cannot build fails the load with Triton's message."""
    config = model.config
    controls = {control.name for control in config.sequence_batching.control_input}
    samples: list[WarmupSample] = []
    for setting in config.model_warmup:
        if setting.batch_size == 0:
            logger.debug("model '%s': skipping batch 0 warmup sample '%s'", model.name, setting.name)
            continue
        given: list[InferInput] = []
        control_inputs: dict[str, np.ndarray] = {}
        for name, meta in setting.inputs.items():
            shape = ((1,) if model.max_batch_size > 0 else ()) + tuple(meta.dims)
            if name in controls:
                # A sequence control tensor, passed as given (Triton's override input), unchecked.
                control_inputs[name] = _control_array(name, meta, shape, model_directory)
            else:
                given.append(InferInput(name, _wire_name(meta), shape, _sample_bytes(name, meta, model_directory)))
        try:
            inputs = validate_inputs(InferRequest(model.name, model.version_str, tuple(given)), model)
        except GeserveError as error:
            raise ModelLoadError(error.message) from None
        inputs.update({name: SharedTensor.local(array) for name, array in control_inputs.items()})
        largest = max(model.max_batch_size, 1)
        if setting.batch_size > largest:
            # What Triton's backends answer a batch larger than the model takes (any batch of more than one
            # request when it does not batch), as the sample's execution error.
            raise ModelLoadError(
                f"failed to run warmup sample '{setting.name}': batch size {setting.batch_size} for "
                f"'{model.name}', max allowed is {model.max_batch_size}; "
            )
        # Triton runs each sample at least once: count 0 means once.
        count = max(setting.count, 1)
        samples.append(
            WarmupSample(setting.name, count, setting.batch_size, inputs, model.output_names, model.decoupled)
        )
    return samples


def _wire_name(meta: mc.ModelWarmup.Input) -> str:
    try:
        return dtypes.from_config(meta.data_type).wire
    except GeserveError:
        return "INVALID"  # refused by the data-type check, in Triton's words


def _element_size(meta: mc.ModelWarmup.Input) -> int:
    try:
        size = dtypes.from_config(meta.data_type).itemsize
    except GeserveError:
        size = None
    return size or _BYTES_ELEMENT_SIZE


def _sample_bytes(name: str, meta: mc.ModelWarmup.Input, model_directory: Path) -> memoryview:
    """The raw little-endian bytes of one request's input (BYTES: Triton's length-prefixed elements)."""
    if any(dim < 0 for dim in meta.dims):
        raise ModelLoadError(f"warmup setting expects all variable-size dimensions are specified for input '{name}'")
    count = math.prod(meta.dims)
    byte_size = count * _element_size(meta)
    is_bytes = meta.data_type == mc.TYPE_STRING
    kind = meta.WhichOneof("input_data_type")
    if kind == "zero_data" or (kind == "random_data" and is_bytes):
        # Random strings would need framing: Triton sends zero-length ones, as for zero data.
        return memoryview(bytes(byte_size))
    if kind == "random_data":
        generator = np.random.default_rng()
        if meta.data_type == mc.TYPE_BOOL:
            return memoryview(generator.integers(0, 2, size=byte_size, dtype=np.uint8).tobytes())
        return memoryview(generator.bytes(byte_size))
    if kind == "input_data_file":
        data = _read_data_file(name, meta.input_data_file, model_directory)
        if is_bytes:
            return memoryview(data)
        if len(data) < byte_size:
            raise ModelLoadError(
                f"warmup setting expects {byte_size} bytes, but the data provided from {meta.input_data_file} "
                f"only has {len(data)} bytes"
            )
        return memoryview(data)[:byte_size]  # Triton reads what it needs from a longer file
    raise ModelLoadError(f"warmup setting expects input '{name}' to have input_data_type set")


def _read_data_file(name: str, file_name: str, model_directory: Path) -> bytes:
    folder = (model_directory / WARMUP_FOLDER).resolve()
    path = (folder / file_name).resolve()
    if not path.is_relative_to(folder):
        raise ModelLoadError(
            f"warmup input_data_file '{file_name}' of input '{name}' must lie in the model's '{WARMUP_FOLDER}' folder"
        )
    try:
        return path.read_bytes()
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise ModelLoadError(f"failed to open text file for read {folder / file_name}: {reason}") from None


def _control_array(name: str, meta: mc.ModelWarmup.Input, shape: tuple[int, ...], model_directory: Path) -> np.ndarray:
    data = _sample_bytes(name, meta, model_directory)
    datatype = dtypes.from_config(meta.data_type) if meta.data_type != mc.TYPE_INVALID else None
    if datatype is None or datatype.itemsize is None:
        raise ModelLoadError(
            f"warmup input '{name}' is a sequence control tensor and needs a numeric or BOOL data_type"
        )
    return np.frombuffer(data, dtype=datatype.numpy.newbyteorder("<")).reshape(shape)

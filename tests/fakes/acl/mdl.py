"""Simulated `acl.mdl`: loading real-format `.om` files, describing them, datasets, gears and execution."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import om as om_files
from ._state import (
    DESERIALIZE_MODEL,
    DYNAMIC_TENSOR_NAME,
    FAILURE,
    GE_DYNAMIC_BATCH_SIZE_INVALID,
    INVALID_MODEL_ID,
    INVALID_PARAM,
    MODEL_NOT_DYNAMIC,
    NEVER,
    READ_MODEL_FAILURE,
    RT_MODEL_CONTEXT,
    RT_PARAM_INVALID,
    RUNTIME,
    SUCCESS,
    Model,
    Queued,
    api,
)

NUMPY_TYPES = {
    0: np.float32,
    1: np.float16,
    2: np.int8,
    3: np.int32,
    4: np.uint8,
    6: np.int16,
    7: np.uint16,
    8: np.uint32,
    9: np.int64,
    10: np.uint64,
    11: np.float64,
    12: np.bool_,
}


# -- loading ---------------------------------------------------------------------------------


@api("mdl.load_from_file", out=(0,), parse="s")
def load_from_file(path: str) -> tuple[int, int]:
    context = RUNTIME.current_context()
    if not Path(path).is_file():
        raise RUNTIME.fail(READ_MODEL_FAILURE, f"cannot read model file {path}")
    try:
        loaded = om_files.load(Path(path))
    except ValueError as error:  # what the runtime says of a file it cannot parse (100012)
        raise RUNTIME.fail(DESERIALIZE_MODEL, f"{path}: {error}") from None
    except Exception as error:  # the twin does not load
        raise RUNTIME.fail(DESERIALIZE_MODEL, f"{path}: the ONNX twin does not load: {error}") from None
    model_id = next(RUNTIME.model_ids)
    RUNTIME.models[model_id] = Model(model_id, context.handle, loaded, loaded.file_bytes)
    return model_id, SUCCESS


def _model(model_id: int) -> Model:
    RUNTIME.require_init()
    model = RUNTIME.models.get(model_id)
    if model is None:
        raise RUNTIME.fail(INVALID_MODEL_ID, f"model id {model_id} is not loaded")
    if model.context != RUNTIME.current_context().handle:
        raise RUNTIME.fail(RT_MODEL_CONTEXT, f"model {model_id} was loaded in another context")
    return model


@api("mdl.unload", parse="I")
def unload(model_id: int) -> int:
    _model(model_id)
    del RUNTIME.models[model_id]
    for desc, described in RUNTIME.descs.items():
        if described == model_id:
            RUNTIME.descs[desc] = None
    return SUCCESS


# -- descriptions ----------------------------------------------------------------------------


@api("mdl.create_desc", value=0)
def create_desc() -> int:
    RUNTIME.require_init()
    handle = next(RUNTIME.handles)
    RUNTIME.descs[handle] = None
    return handle


@api("mdl.get_desc", parse="kI")
def get_desc(desc: int, model_id: int) -> int:
    if desc not in RUNTIME.descs:
        raise RUNTIME.fail(INVALID_PARAM, f"unknown model description {desc:#x}")
    _model(model_id)
    RUNTIME.descs[desc] = model_id
    return SUCCESS


@api("mdl.destroy_desc", parse="k")
def destroy_desc(desc: int) -> int:
    if desc not in RUNTIME.descs:
        raise RUNTIME.fail(INVALID_PARAM, f"unknown model description {desc:#x}")
    del RUNTIME.descs[desc]
    return SUCCESS


def _described(desc: int) -> Model:
    model_id = RUNTIME.descs.get(desc)
    if model_id is None or model_id not in RUNTIME.models:
        raise RUNTIME.fail(INVALID_PARAM, f"model description {desc:#x} describes no loaded model")
    return RUNTIME.models[model_id]


def _inputs(model: Model) -> list[dict[str, Any]]:
    """As the file has them: the gear input at its own index, batch dims -1."""
    return list(model.om.inputs)


def _outputs(model: Model) -> list[dict[str, Any]]:
    """As the file has them: a gear model's outputs carry the largest gear's dims."""
    return list(model.om.outputs)


def _dynamic_index(model: Model) -> int | None:
    return next((i for i, t in enumerate(_inputs(model)) if t["name"] == DYNAMIC_TENSOR_NAME), None)


def _tensor(desc: int, index: int, inputs: bool) -> dict[str, Any]:
    model = _described(desc)
    tensors = _inputs(model) if inputs else _outputs(model)
    if not 0 <= index < len(tensors):
        raise RUNTIME.fail(INVALID_PARAM, f"index {index} is out of range ({len(tensors)} tensors)")
    return tensors[index]


def _shape(model: Model, tensor: dict[str, Any], batch: int | None) -> list[int]:
    """The dims at gear `batch` (the largest when None): the first dim of every tensor but the gear input."""
    dims = list(tensor["dims"])
    if model.gears and dims and tensor["name"] != DYNAMIC_TENSOR_NAME:
        dims[0] = batch if batch is not None else max(model.gears)
    return dims


def _nbytes(model: Model, tensor: dict[str, Any], batch: int | None = None) -> int:
    dims = _shape(model, tensor, batch)
    if tensor["dtype"] not in NUMPY_TYPES or any(d < 0 for d in dims):
        return 0  # as aclmdlGetInputSizeByIndex documents for shapes it cannot size
    return math.prod(dims) * np.dtype(NUMPY_TYPES[tensor["dtype"]]).itemsize


# aclmdlIODims.name is char[ACL_MAX_TENSOR_NAME_LEN = 128] (acl_mdl.h): a name that does not fit with its NUL
# is given there as `acl_modelId_<model id>_<input|output>_<index>` (hicann/ge api/acl/acl_model/model/
# model_common.cpp `GetTensorDescNameToDims`, `GetConvertTensorName`; `TransConvertTensorNameToLegal` appends
# `_<letters>` only if that collides with a real tensor name). get_*_name_by_index keep the real name.
MAX_TENSOR_NAME_LEN = 128


def _dims(desc: int, side: str, index: int, tensor: dict[str, Any], dims: list[int]) -> dict[str, Any]:
    name = str(tensor["name"])
    if len(name) + 1 > MAX_TENSOR_NAME_LEN:
        name = f"acl_modelId_{RUNTIME.descs[desc]}_{side}_{index}"
    return {"name": name, "dimCount": len(dims), "dims": dims}


@api("mdl.get_num_inputs", value=0, parse="k")
def get_num_inputs(desc: int) -> int:
    return len(_inputs(_described(desc)))


@api("mdl.get_num_outputs", value=0, parse="k")
def get_num_outputs(desc: int) -> int:
    return len(_outputs(_described(desc)))


@api("mdl.get_input_size_by_index", value=0, parse="kk")
def get_input_size_by_index(desc: int, index: int) -> int:
    return _nbytes(_described(desc), _tensor(desc, index, True))


@api("mdl.get_output_size_by_index", value=0, parse="kk")
def get_output_size_by_index(desc: int, index: int) -> int:
    return _nbytes(_described(desc), _tensor(desc, index, False))


@api("mdl.get_input_dims", out=({},), parse="kk")
def get_input_dims(desc: int, index: int) -> tuple[dict[str, Any], int]:
    tensor = _tensor(desc, index, True)
    return _dims(desc, "input", index, tensor, list(tensor.get("dims_v1", tensor["dims"]))), SUCCESS


@api("mdl.get_input_dims_v2", out=({},), parse="kk")
def get_input_dims_v2(desc: int, index: int) -> tuple[dict[str, Any], int]:
    """The same as get_input_dims but for static-AIPP inputs, where these are the dims that multiply out to
    get_input_size_by_index (CANN docs, aclmdlGetInputDimsV2)."""
    tensor = _tensor(desc, index, True)
    return _dims(desc, "input", index, tensor, list(tensor.get("dims_v2", tensor["dims"]))), SUCCESS


@api("mdl.get_output_dims", out=({},), parse="kk")
def get_output_dims(desc: int, index: int) -> tuple[dict[str, Any], int]:
    tensor = _tensor(desc, index, False)
    return _dims(desc, "output", index, tensor, list(tensor["dims"])), SUCCESS


MAX_DIM_CNT = 128  # ACL_MAX_DIM_CNT


@api("mdl.get_cur_output_dims", out=({},), parse="kk")
def get_cur_output_dims(desc: int, index: int) -> tuple[dict[str, Any], int]:
    """As hicann/ge api/acl/acl_model/model/model.cpp `aclmdlGetCurOutputDimsImpl` answers: the output
    dims (the largest gear's) while no gear is set; once one is, the `_dynamic_output_dims` entry for
    that gear's index (or -1) and this output (model_common.cpp `GetCurOuputShapeInfo`), and
    ACL_ERROR_FAILURE when the model's NetOutput carries no such entry."""
    model = _described(desc)
    tensor = _tensor(desc, index, False)
    if model.batch is None:  # GetCurShape gives nothing: a static model, or no gear set yet
        return _dims(desc, "output", index, tensor, list(tensor["dims"])), SUCCESS
    gear_index = model.gears.index(model.batch)
    for entry in model.om.dynamic_output_dims:
        if not 2 <= len(entry) <= 2 + MAX_DIM_CNT:
            raise RUNTIME.fail(FAILURE, f"output shape info size[{len(entry)}] is invalid, range is [2, 130]")
        if entry[0] in (gear_index, -1) and entry[1] == index:
            return _dims(desc, "output", index, tensor, list(entry[2:])), SUCCESS
    raise RUNTIME.fail(
        FAILURE,
        f"get current output shape info failed: the model's _dynamic_output_dims has no entry for output {index} "
        f"at gear index {gear_index} (batch {model.batch})",
    )


@api("mdl.get_input_name_by_index", value="", parse="kk")
def get_input_name_by_index(desc: int, index: int) -> str:
    return str(_tensor(desc, index, True)["name"])


@api("mdl.get_output_name_by_index", value="", parse="kk")
def get_output_name_by_index(desc: int, index: int) -> str:
    return str(_tensor(desc, index, False)["name"])


def _index_by_name(desc: int, name: str, inputs: bool) -> tuple[int, int]:
    model = _described(desc)
    tensors = _inputs(model) if inputs else _outputs(model)
    for index, tensor in enumerate(tensors):
        if tensor["name"] == name:
            return index, SUCCESS
    raise RUNTIME.fail(INVALID_PARAM, f"the model has no {'input' if inputs else 'output'} named '{name}'")


@api("mdl.get_input_index_by_name", out=(0,), parse="ks")
def get_input_index_by_name(desc: int, name: str) -> tuple[int, int]:
    return _index_by_name(desc, name, True)


@api("mdl.get_output_index_by_name", out=(0,), parse="ks")
def get_output_index_by_name(desc: int, name: str) -> tuple[int, int]:
    return _index_by_name(desc, name, False)


@api("mdl.get_input_data_type", value=-1, parse="kk")
def get_input_data_type(desc: int, index: int) -> int:
    return int(_tensor(desc, index, True)["dtype"])


@api("mdl.get_output_data_type", value=-1, parse="kk")
def get_output_data_type(desc: int, index: int) -> int:
    return int(_tensor(desc, index, False)["dtype"])


@api("mdl.get_input_format", value=-1, parse="kk")
def get_input_format(desc: int, index: int) -> int:
    return int(_tensor(desc, index, True)["format"])


@api("mdl.get_output_format", value=-1, parse="kk")
def get_output_format(desc: int, index: int) -> int:
    return int(_tensor(desc, index, False)["format"])


@api("mdl.get_dynamic_batch", out=({},), parse="k")
def get_dynamic_batch(desc: int) -> tuple[dict[str, Any], int]:
    gears = _described(desc).gears
    return {"batchCount": len(gears), "batch": gears}, SUCCESS


def _gear_shapes(desc: int, kind: str) -> list[list[int]]:
    om = _described(desc).om
    return [list(shape) for shape in om.gear_shapes] if om.gear_kind == kind else []


@api("mdl.get_dynamic_hw", out=({},), parse="kk")
def get_dynamic_hw(desc: int, index: int) -> tuple[dict[str, Any], int]:
    shapes = _gear_shapes(desc, "dynamic_image_size")
    return {"hwCount": len(shapes), "hw": shapes}, SUCCESS


@api("mdl.get_input_dynamic_gear_count", out=(0,), parse="kk")
def get_input_dynamic_gear_count(desc: int, index: int) -> tuple[int, int]:
    return len(_gear_shapes(desc, "dynamic_dims")), SUCCESS


@api("mdl.get_input_dynamic_dims", out=([],), parse="kkk")
def get_input_dynamic_dims(desc: int, index: int, count: int) -> tuple[list[dict[str, Any]], int]:
    shapes = _gear_shapes(desc, "dynamic_dims")[:count]
    return [{"name": "", "dimCount": len(shape), "dims": shape} for shape in shapes], SUCCESS


# -- datasets --------------------------------------------------------------------------------


@api("mdl.create_dataset", value=0)
def create_dataset() -> int:
    RUNTIME.require_init()
    handle = next(RUNTIME.handles)
    RUNTIME.datasets[handle] = []
    return handle


def _dataset(dataset: int) -> list[int]:
    if dataset not in RUNTIME.datasets:
        raise RUNTIME.fail(INVALID_PARAM, f"unknown dataset {dataset:#x}")
    return RUNTIME.datasets[dataset]


@api("mdl.add_dataset_buffer", out=(0,), parse="kk")
def add_dataset_buffer(dataset: int, buffer: int) -> tuple[int, int]:
    if buffer not in RUNTIME.data_buffers:
        raise RUNTIME.fail(INVALID_PARAM, f"unknown data buffer {buffer:#x}")
    _dataset(dataset).append(buffer)
    return dataset, SUCCESS


@api("mdl.get_dataset_num_buffers", value=0, parse="k")
def get_dataset_num_buffers(dataset: int) -> int:
    return len(_dataset(dataset))


@api("mdl.get_dataset_buffer", value=0, parse="kk")
def get_dataset_buffer(dataset: int, index: int) -> int:
    buffers = _dataset(dataset)
    return buffers[index] if 0 <= index < len(buffers) else 0


@api("mdl.destroy_dataset", parse="k")
def destroy_dataset(dataset: int) -> int:
    _dataset(dataset)
    del RUNTIME.datasets[dataset]  # the container only: its data buffers are the caller's
    return SUCCESS


def _buffer_at(dataset: int, index: int) -> tuple[int, int]:
    buffers = _dataset(dataset)
    if not 0 <= index < len(buffers) or buffers[index] not in RUNTIME.data_buffers:
        raise RUNTIME.fail(INVALID_PARAM, f"dataset {dataset:#x} has no live data buffer at index {index}")
    return RUNTIME.data_buffers[buffers[index]]


# -- gears and execution ---------------------------------------------------------------------


@api("mdl.set_dynamic_batch_size", parse="IkkK")
def set_dynamic_batch_size(model_id: int, dataset: int, index: int, batch: int) -> int:
    model = _model(model_id)
    if not model.gears:
        raise RUNTIME.fail(MODEL_NOT_DYNAMIC, f"model {model_id} was not compiled with dynamic batch sizes")
    if index != _dynamic_index(model):
        raise RUNTIME.fail(INVALID_PARAM, f"input {index} is not '{DYNAMIC_TENSOR_NAME}'")
    tensor = _inputs(model)[index]
    if batch not in model.gears:
        raise RUNTIME.fail(
            GE_DYNAMIC_BATCH_SIZE_INVALID, f"batch size {batch} is not one of the model's gears {model.gears}"
        )
    address, size = _buffer_at(dataset, index)
    value = np.full(tensor["dims"], batch, dtype=NUMPY_TYPES[tensor["dtype"]]).tobytes()
    if size < len(value):
        raise RUNTIME.fail(INVALID_PARAM, f"the '{DYNAMIC_TENSOR_NAME}' buffer holds {size} bytes")
    RUNTIME.check_untouched(address, len(value), "written")
    RUNTIME.write(address, value)  # the runtime fills it, not the caller
    model.batch = batch
    return SUCCESS


@api("mdl.execute", parse="Ikk")
def execute(model_id: int, input_dataset: int, output_dataset: int) -> int:
    started = time.monotonic_ns()
    device, rows, writes, _ = _run(model_id, input_dataset, output_dataset)
    for address, data in writes:
        RUNTIME.write(address, data)
    RUNTIME.spend_device_time(rows)
    RUNTIME.busy_ns[device] += time.monotonic_ns() - started
    return SUCCESS


@api("mdl.execute_async", parse="Ikkk")
def execute_async(model_id: int, input_dataset: int, output_dataset: int, stream: int) -> int:
    """Queues the work: the device starts it once its earlier work ends, and the outputs appear when it
    ends (reading them before `synchronize_stream` reads what was there before)."""
    if RUNTIME.streams.get(stream) != RUNTIME.current_context().handle:
        raise RUNTIME.fail(RT_PARAM_INVALID, f"stream {stream:#x} is not a stream of the current context")
    model = _model(model_id)
    device = RUNTIME.contexts[model.context].device
    fault = RUNTIME.injected_fault(device)
    if fault is not None:  # the launch succeeds; the stream's synchronize reports the failure
        message = f"model execution failed on device {device} (injected fault {fault})"
        RUNTIME.queued[stream].append(Queued(device, time.monotonic_ns(), 0, [], [], fault, message))
        return SUCCESS
    hang = RUNTIME.injected_hang()
    device, rows, writes, buffers = _run(model_id, input_dataset, output_dataset)
    device_ns = RUNTIME.device_time_us(rows) * 1000
    ends_at = NEVER if hang is not None else max(time.monotonic_ns(), RUNTIME.device_free_at[device]) + device_ns
    RUNTIME.device_free_at[device] = ends_at  # a hung AI Core runs nothing queued after it either
    RUNTIME.queued[stream].append(Queued(device, ends_at, device_ns, writes, buffers, hang=hang or 0))
    return SUCCESS


def _run(
    model_id: int, input_dataset: int, output_dataset: int
) -> tuple[int, int, list[tuple[int, bytes]], list[tuple[int, int]]]:
    """What the model computes from its input buffers now: (device, rows, the output writes, the buffers used)."""
    model = _model(model_id)
    device = RUNTIME.contexts[model.context].device
    inputs, outputs = _inputs(model), _outputs(model)
    if len(_dataset(input_dataset)) != len(inputs) or len(_dataset(output_dataset)) != len(outputs):
        raise RUNTIME.fail(
            INVALID_PARAM,
            f"model {model_id} takes {len(inputs)} inputs and {len(outputs)} outputs; the datasets hold "
            f"{len(_dataset(input_dataset))} and {len(_dataset(output_dataset))}",
        )
    fault = RUNTIME.injected_fault(device)
    if fault is not None:
        raise RUNTIME.fail(fault, f"model execution failed on device {device} (injected fault {fault})")
    batch = model.batch if model.gears else None
    feeds: dict[str, np.ndarray] = {}
    buffers: list[tuple[int, int]] = []
    for index, tensor in enumerate(inputs):
        address, size = _buffer_at(input_dataset, index)
        buffers.append((address, size))
        if tensor["name"] == DYNAMIC_TENSOR_NAME:
            dtype = NUMPY_TYPES[tensor["dtype"]]
            written = int(np.frombuffer(RUNTIME.read(address, np.dtype(dtype).itemsize), dtype=dtype)[0])
            if batch is not None and written != batch:
                raise RUNTIME.fail(INVALID_PARAM, f"'{DYNAMIC_TENSOR_NAME}' was overwritten by the application")
            continue
        _device_only(address, f"input {index}")
        need = _nbytes(model, tensor, batch)
        if size < need:
            raise RUNTIME.fail(INVALID_PARAM, f"input {index} holds {size} bytes; the gear needs {need}")
        # The device reads its memory in place; the simulator's host emulation need not copy it first.
        array = np.frombuffer(RUNTIME.view(address, need), dtype=NUMPY_TYPES[tensor["dtype"]])
        feeds[tensor["name"]] = array.reshape(_shape(model, tensor, batch))
    RUNTIME.last_inputs = feeds
    results = om_files.run(model.om, feeds, NUMPY_TYPES)
    writes: list[tuple[int, bytes]] = []
    for index, (tensor, result) in enumerate(zip(outputs, results, strict=True)):
        address, size = _buffer_at(output_dataset, index)
        buffers.append((address, size))
        _device_only(address, f"output {index}")
        data = np.ascontiguousarray(result, dtype=NUMPY_TYPES[tensor["dtype"]]).tobytes()
        if len(data) != _nbytes(model, tensor, batch) or size < len(data):
            raise RUNTIME.fail(INVALID_PARAM, f"output {index} needs {len(data)} bytes; its buffer holds {size}")
        writes.append((address, data))
    rows = batch if batch is not None else (_shape(model, inputs[0], None) or [1])[0]
    RUNTIME.executions += 1
    RUNTIME.rows_executed.append(rows)
    return device, rows, writes, buffers


def _device_only(address: int, what: str) -> None:
    if RUNTIME.space_of(address) != "device":
        raise RUNTIME.fail(RT_PARAM_INVALID, f"{what} is in host memory; models read device memory only")

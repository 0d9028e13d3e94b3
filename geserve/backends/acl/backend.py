"""AclBackend: one `.om` model on one NPU, with device buffers sized once for the largest gear."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from geserve._generated import model_config_pb2 as mc
from geserve.backends.acl import completion
from geserve.backends.acl.description import OmDescription, OmTensor, check_output_dims, check_servable
from geserve.backends.acl.introspect import describe
from geserve.backends.acl.runtime import (
    MALLOC_HUGE_FIRST,
    MEM_DDR,
    MEM_HBM,
    MEMCPY_DEVICE_TO_DEVICE,
    MEMCPY_DEVICE_TO_HOST,
    MEMCPY_HOST_TO_DEVICE,
    REPEAT_INITIALIZE,
    RUN_MODE_DEVICE,
    SYNC_TIMEOUTS,
    Acl,
    import_acl,
)
from geserve.backends.acl.soc import check_soc, read_before_load
from geserve.backends.base import DeviceFaultError, OutputAllocator
from geserve.codecs import visible_devices
from geserve.errors import GeserveError, InternalError, ModelLoadError
from geserve.types import DeviceUsage

logger = logging.getLogger(__name__)

DEFAULT_FILENAME = "model.om"
# How long a batch may run on the NPU before the instance counts it as hung (config parameter, ms).
SYNC_TIMEOUT_PARAMETER = "sync_timeout_ms"
DEFAULT_SYNC_TIMEOUT_MS = 60000
_INT32_MAX = 2**31 - 1  # aclrtSynchronizeStreamWithTimeout takes an int32_t


@dataclass(slots=True)
class _DeviceBuffer:
    """Device memory for one model input or output, and the data buffer that presents it."""

    tensor: OmTensor | None  # None for the runtime-filled dynamic-batch input
    address: int
    size: int
    data_buffer: int
    presented: int  # bytes the data buffer currently presents to the model


@dataclass(slots=True)
class _InputSide:
    """One input dataset and its device buffers. Two sides let the next batch's inputs be copied to the
    device while the model still reads the running batch's."""

    dataset: int
    by_name: dict[str, _DeviceBuffer]


@dataclass(slots=True)
class _Staged:
    """A batch whose inputs are on the device: the side holding them, its rows and the gear it runs at."""

    side: _InputSide
    rows: int | None
    gear: int | None
    launched: bool = False
    waited: Exception | bool = False  # after `wait`: True, or the error synchronizing raised


class AclBackend:
    """init -> set_device -> context -> stream -> load -> describe -> buffers and datasets, once;
    per batch: copy in (to a free input side), pad to a gear, launch on the stream, wait, copy out;
    on unload, all of it in reverse."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._acl: Acl | None = None
        self._owns_init = False
        self._device = -1
        self._visible_device = -1
        self._context = 0
        self._stream = 0
        self._model_id: int | None = None
        self._desc = 0
        self._om: OmDescription | None = None
        self._model_file = ""
        self._batched = False
        self._copy_in = MEMCPY_HOST_TO_DEVICE
        self._copy_out = MEMCPY_DEVICE_TO_HOST
        self._memory_attribute = MEM_DDR
        self._input_datasets: list[int] = []
        self._output_dataset = 0
        self._input_buffers: list[_DeviceBuffer] = []
        self._output_buffers: list[_DeviceBuffer] = []
        self._free_sides: list[_InputSide] = []
        self._sides = 0
        self._outputs: dict[str, _DeviceBuffer] = {}
        self._launched: _Staged | None = None
        self._sync_timeout_ms = DEFAULT_SYNC_TIMEOUT_MS
        self._hung = False  # a synchronize timed out: work may still run on the device

    # -- loading -------------------------------------------------------------------------------

    def load(self, config: mc.ModelConfig, model_path: Path, device_id: int) -> None:
        if model_path.is_dir():
            model_path = model_path / DEFAULT_FILENAME
        if not model_path.is_file():
            raise ModelLoadError(f"model '{config.name}': model file '{model_path}' does not exist")
        self._model_file = str(model_path)
        self._sync_timeout_ms = sync_timeout_ms(config)
        # finalize otherwise waits up to 2 s to flush device logs, on every unload and restart
        os.environ.setdefault("ASCEND_LOG_DEVICE_FLUSH_TIMEOUT", "0")
        acl = self._acl = Acl(import_acl(config.name), config.name)
        self._device = device_id
        try:
            self._open(acl, device_id)
        except GeserveError as error:
            self.unload()
            raise ModelLoadError(error.message) from None

    def _open(self, acl: Acl, device_id: int) -> None:
        module = acl.module
        ret = module.init()
        if ret != REPEAT_INITIALIZE:  # another user of pyACL in this process initialised it already
            acl.check("acl.init", ret)
            self._owns_init = True
        self._visible_device = visible_index(device_id)
        acl.check("acl.rt.set_device", module.rt.set_device(self._visible_device))
        self._context = acl.out("acl.rt.create_context", module.rt.create_context(self._visible_device))
        self._stream = acl.out("acl.rt.create_stream", module.rt.create_stream())
        if acl.out("acl.rt.get_run_mode", module.rt.get_run_mode()) == RUN_MODE_DEVICE:
            # On the device's own CPU "host" memory is device memory (RC mode).
            self._copy_in = self._copy_out = MEMCPY_DEVICE_TO_DEVICE
        soc = str(module.get_soc_name() or "")
        self._memory_attribute = MEM_HBM if soc.startswith("Ascend910") else MEM_DDR
        # What the runtime would only report batch by batch, or as a bare load failure, refused up front.
        file_om = read_before_load(self._model_file)
        check_soc(acl.model_name, self._model_file, soc, file_om)
        if file_om is not None:
            check_output_dims(file_om, acl.model_name, self._model_file)
        self._model_id = acl.out("acl.mdl.load_from_file", module.mdl.load_from_file(self._model_file))
        self._desc = acl.handle("acl.mdl.create_desc", module.mdl.create_desc())
        acl.check("acl.mdl.get_desc", module.mdl.get_desc(self._desc, self._model_id))
        om = self._om = describe(acl, self._desc, soc or None)
        check_servable(om, acl.model_name, self._model_file)
        logger.info(
            "loaded '%s' on NPU %d (soc %s): inputs %s, outputs %s, gears %s",
            self._model_file, self._device, soc or "unknown",
            [(t.name, list(t.dims)) for t in om.inputs], [(t.name, list(t.dims)) for t in om.outputs], list(om.gears),
        )  # fmt: skip
        self._free_sides.append(self._input_side())
        self._output_dataset = acl.handle("acl.mdl.create_dataset", module.mdl.create_dataset())
        for tensor in om.outputs:  # keyed by the config's names in complete_config
            self._device_buffer(tensor, tensor.size, self._output_dataset, self._output_buffers)

    def _input_side(self) -> _InputSide:
        """A dataset with a device buffer for every model input, the runtime-filled one included."""
        acl = self._require()
        om = self._require_model()
        dataset = acl.handle("acl.mdl.create_dataset", acl.module.mdl.create_dataset())
        self._input_datasets.append(dataset)
        by_index = {tensor.index: tensor for tensor in om.inputs}
        if om.dynamic_input is not None:
            by_index[om.dynamic_input.index] = om.dynamic_input
        side = _InputSide(dataset, {})
        for index in range(om.input_count):
            if index not in by_index:
                raise ModelLoadError(f"model '{acl.model_name}': '{self._model_file}' describes no input {index}")
            tensor = by_index[index]
            runtime_filled = tensor is om.dynamic_input
            buffer = self._device_buffer(None if runtime_filled else tensor, tensor.size, dataset, self._input_buffers)
            if not runtime_filled:
                side.by_name[tensor.name] = buffer
        self._sides += 1
        return side

    def _device_buffer(
        self, tensor: OmTensor | None, size: int, dataset: int, owned: list[_DeviceBuffer]
    ) -> _DeviceBuffer:
        """Device memory wrapped in a data buffer, appended to `dataset` and to `owned` (which unload frees)."""
        acl = self._require()
        module = acl.module
        address = acl.out("acl.rt.malloc", module.rt.malloc(max(size, 1), MALLOC_HUGE_FIRST))
        data_buffer = module.create_data_buffer(address, size)
        if not data_buffer:
            module.rt.free(address)
            raise acl.error("acl.create_data_buffer", 500000)
        buffer = _DeviceBuffer(tensor, address, size, data_buffer, size)
        owned.append(buffer)
        acl.out("acl.mdl.add_dataset_buffer", module.mdl.add_dataset_buffer(dataset, data_buffer))
        return buffer

    def complete_config(self, config: mc.ModelConfig, auto_complete: bool) -> None:
        om = self._require_model()
        matched = completion.complete(config, om, auto_complete, self._model_file)
        by_full_name = {buffer.tensor.name: buffer for buffer in self._output_buffers if buffer.tensor is not None}
        # Clients name outputs as the config does; the device buffers are the .om's, by ATC's full names.
        self._outputs = {name: by_full_name[tensor.name] for name, tensor in matched.items()}
        self._batched = config.max_batch_size > 0

    # -- execution -----------------------------------------------------------------------------

    def execute(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str], allocate: OutputAllocator | None = None
    ) -> dict[str, np.ndarray]:
        staged = self.stage(inputs)
        self.launch(staged)
        return self.finish(staged, output_names, allocate)

    def stage(self, inputs: Mapping[str, np.ndarray]) -> _Staged:
        """Copy the batch to a free input side. The model may be running the batch on the other side."""
        return self.stage_blocks({name: (array,) for name, array in inputs.items()})

    def stage_blocks(self, inputs: Mapping[str, Sequence[np.ndarray]]) -> _Staged:
        """`stage` for a batch given as each input's row blocks (the requests' rows where they lie): each block is
        copied to its rows on the device, so the batch is never joined in host memory first."""
        acl = self._require()
        om = self._require_model()
        rows, gear = self._rows_and_gear(inputs, om)
        if self._free_sides:
            side = self._free_sides.pop()
        elif self._sides < 2:
            side = self._input_side()  # the second side, made when a batch is first staged behind another
        else:
            raise InternalError(f"model '{acl.model_name}': two batches are already staged or running")
        try:
            for name, buffer in side.by_name.items():
                self._copy_input(acl, name, [np.asarray(block) for block in inputs[name]], buffer, gear)
        except BaseException:
            self._free_sides.append(side)
            raise
        return _Staged(side, rows, gear)

    def launch(self, staged: object) -> None:
        """Queue the staged batch on the stream (the batch launched before it must have finished)."""
        assert isinstance(staged, _Staged)
        acl = self._require()
        om = self._require_model()
        module = acl.module
        if self._launched is not None:
            raise InternalError(f"model '{acl.model_name}': a batch was launched before the previous one finished")
        dataset = staged.side.dataset
        try:
            if om.gears and om.dynamic_input is not None:
                acl.check(
                    "acl.mdl.set_dynamic_batch_size",
                    module.mdl.set_dynamic_batch_size(self._model_id, dataset, om.dynamic_input.index, staged.gear),
                )
            # Asynchronous, so the wait happens in synchronize_stream, which releases the GIL.
            acl.check(
                "acl.mdl.execute_async",
                module.mdl.execute_async(self._model_id, dataset, self._output_dataset, self._stream),
            )
        except BaseException:
            self.discard(staged)
            raise
        staged.launched = True
        self._launched = staged

    def wait(self, staged: object) -> None:
        """synchronize_stream from the worker's waiting thread (the binding releases the GIL there)."""
        assert isinstance(staged, _Staged) and staged is self._launched
        acl = self._require()
        try:
            # A thread uses the runtime in the context it sets; the stream belongs to the instance's.
            acl.check("acl.rt.set_context", acl.module.rt.set_context(self._context))
            self._synchronize(acl)
            staged.waited = True
        except Exception as error:  # raised by `finish`, on the thread that answers the batch
            staged.waited = error

    def finish(
        self, staged: object, output_names: Sequence[str], allocate: OutputAllocator | None = None
    ) -> dict[str, np.ndarray]:
        """Wait for the launched batch, then copy its outputs out (only its rows, not the gear's padding)."""
        assert isinstance(staged, _Staged) and staged is self._launched
        acl = self._require()
        self._launched = None
        try:
            if isinstance(staged.waited, Exception):
                raise staged.waited
            if staged.waited is False:
                self._synchronize(acl)
        finally:
            self._free_sides.append(staged.side)
        return {name: self._copy_output(acl, name, staged.rows, staged.gear, allocate) for name in output_names}

    def _synchronize(self, acl: Acl) -> None:
        """Wait for the stream, at most sync_timeout_ms (-1: forever). A device that does not finish in time
        fails the batch as a device fault, so the worker retires and a fresh one takes the NPU."""
        call = "acl.rt.synchronize_stream_with_timeout"
        ret = acl.module.rt.synchronize_stream_with_timeout(self._stream, self._sync_timeout_ms)
        if ret in SYNC_TIMEOUTS:
            self._hung = True
            cause = acl.error(call, ret).args[0].removeprefix(f"model '{acl.model_name}': ")
            raise DeviceFaultError(
                f"model '{acl.model_name}': the NPU did not finish the batch within {self._sync_timeout_ms} ms "
                f"(parameter '{SYNC_TIMEOUT_PARAMETER}'): {cause.removesuffix('; the instance restarts')}; "
                "the instance restarts"
            )
        acl.check(call, ret)

    def discard(self, staged: object) -> None:
        assert isinstance(staged, _Staged) and not staged.launched
        self._free_sides.append(staged.side)

    def _rows_and_gear(
        self, inputs: Mapping[str, Sequence[np.ndarray]], om: OmDescription
    ) -> tuple[int | None, int | None]:
        """Rows in this batch and the gear they run at; (None, None) for a model without a batch dim."""
        if not (om.gears or (self._batched and om.rows)):
            return None, None
        blocks = [np.asarray(block) for block in inputs[om.inputs[0].name]]
        rows = sum(int(block.shape[0]) if block.ndim else 1 for block in blocks)
        if rows > om.rows:
            raise InternalError(
                f"model '{self._require().model_name}': a batch of {rows} exceeds the largest gear {om.rows}"
            )
        return rows, om.gear_for(rows)

    def _copy_input(
        self, acl: Acl, name: str, blocks: list[np.ndarray], buffer: _DeviceBuffer, gear: int | None
    ) -> None:
        tensor = buffer.tensor
        assert tensor is not None and tensor.datatype is not None
        for block in blocks:
            if block.dtype != tensor.datatype.numpy:
                raise InternalError(
                    f"model '{acl.model_name}': input '{name}' is {block.dtype}, expected {tensor.datatype.numpy}"
                )
        # Arena views are contiguous; this is for other callers.
        blocks = [block if block.flags.c_contiguous else np.ascontiguousarray(block) for block in blocks]
        nbytes = sum(block.nbytes for block in blocks)
        needed = gear * tensor.row_bytes if gear is not None else buffer.size
        if nbytes > needed or (gear is None and nbytes != needed):
            raise InternalError(
                f"model '{acl.model_name}': input '{name}' holds {nbytes} bytes; the model takes {needed}"
            )
        rt = acl.module.rt
        offset = 0
        for block in blocks:
            if block.nbytes:
                # Straight from where the request's rows lie (the shared-memory arena) to their place on the device.
                acl.check(
                    "acl.rt.memcpy",
                    rt.memcpy(
                        buffer.address + offset, buffer.size - offset, block.ctypes.data, block.nbytes, self._copy_in
                    ),
                )
            offset += block.nbytes
        if needed > nbytes:
            # Rows that only fill the gear: zeros, so padding never computes on stale data.
            acl.check("acl.rt.memset", rt.memset(buffer.address + nbytes, buffer.size - nbytes, 0, needed - nbytes))
        if buffer.presented != needed:
            acl.check(
                "acl.update_data_buffer", acl.module.update_data_buffer(buffer.data_buffer, buffer.address, needed)
            )
            buffer.presented = needed

    def _copy_output(
        self, acl: Acl, name: str, rows: int | None, gear: int | None, allocate: OutputAllocator | None
    ) -> np.ndarray:
        buffer = self._outputs[name]
        tensor = buffer.tensor
        assert tensor is not None and tensor.datatype is not None
        dims_info, ret = acl.module.mdl.get_cur_output_dims(self._desc, tensor.index)
        if ret != 0:
            # A lookup in the model's description (model_common.cpp GetCurOuputShapeInfo: ACL_ERROR_FAILURE
            # where `_dynamic_output_dims` has no entry for this output at this gear), not the device's
            # doing: the batch fails, the instance stays.
            cause = acl.error("acl.mdl.get_cur_output_dims", ret, device_fault=False)
            at = f"at batch size {gear}" if gear is not None else "without a batch size set"
            raise InternalError(
                f"{cause}; the runtime gives no dims for output '{name}' (index {tensor.index}) {at}, so its "
                "result cannot be returned; it answers from the dims per gear that ATC records in the model's "
                "_dynamic_output_dims for --dynamic_batch_size: compile the model again with ATC"
            )
        shape = tuple(
            int(d) for d in dims_info.get("dims", [])[: int(dims_info.get("dimCount", len(dims_info.get("dims", []))))]
        )
        if rows is not None:
            if not shape or shape[0] != gear:
                raise InternalError(
                    f"model '{acl.model_name}': output '{name}' has dims {list(shape)} after running at batch {gear}"
                )
            shape = (rows, *shape[1:])  # the padded rows' outputs are dropped
        datatype = tensor.datatype
        host = allocate(name, datatype.wire, shape) if allocate is not None else np.empty(shape, datatype.numpy)
        if host.nbytes > buffer.size:
            raise InternalError(f"model '{acl.model_name}': output '{name}' of dims {list(shape)} overruns its buffer")
        if host.nbytes:
            rt = acl.module.rt
            acl.check(
                "acl.rt.memcpy", rt.memcpy(host.ctypes.data, host.nbytes, buffer.address, host.nbytes, self._copy_out)
            )
        return host

    # -- device metrics ------------------------------------------------------------------------

    def device_usage(self) -> DeviceUsage | None:
        acl = self._acl
        if acl is None or self._model_id is None:
            return None
        rt = acl.module.rt
        free, total, ret = rt.get_mem_info(self._memory_attribute)
        if ret == 0 and total == 0:  # the other kind of memory on this chip
            other = MEM_DDR if self._memory_attribute == MEM_HBM else MEM_HBM
            free, total, ret = rt.get_mem_info(other)
            if ret == 0 and total:
                self._memory_attribute = other
        if ret != 0:
            logger.warning("%s", acl.error("acl.rt.get_mem_info", ret))
            return None
        utilization: float | None = None
        reader = getattr(rt, "get_device_utilization_rate", None)  # newer CANN only
        if reader is not None:
            rates, ret = reader(self._visible_device)
            if ret == 0 and isinstance(rates, dict):
                # -1 means the chip cannot measure that unit: unknown, not idle
                known = [int(rates.get(key, -1)) for key in ("cube_utilization", "vector_utilization")]
                known = [value for value in known if value >= 0]
                utilization = min(max(known), 100) / 100 if known else None
        return DeviceUsage(self._device, int(total), int(total - free), utilization)

    # -- unloading -----------------------------------------------------------------------------

    def unload(self) -> None:
        """Release in reverse order; keep going past failures so everything that can be freed is."""
        acl = self._acl
        if acl is None:
            return
        if self._hung:
            # Work may still run on the NPU: freeing its buffers, or reset_device (which waits for pending
            # tasks), could fault or never return. The process is retiring; its exit releases the device.
            logger.warning("'%s': the NPU hung; leaving its resources to the process's exit", self._model_file)
            self._reset()
            return
        module = acl.module
        steps: list[tuple[str, Any]] = []
        if self._launched is not None:  # nothing may be freed under a running execute
            steps.append(
                (
                    "acl.rt.synchronize_stream_with_timeout",
                    lambda s=self._stream: module.rt.synchronize_stream_with_timeout(s, self._sync_timeout_ms),
                )
            )
        for buffer in (*self._output_buffers, *self._input_buffers):
            steps.append(("acl.destroy_data_buffer", lambda b=buffer: module.destroy_data_buffer(b.data_buffer)))
            steps.append(("acl.rt.free", lambda b=buffer: module.rt.free(b.address)))
        for dataset in (self._output_dataset, *self._input_datasets):
            if dataset:
                steps.append(("acl.mdl.destroy_dataset", lambda d=dataset: module.mdl.destroy_dataset(d)))
        if self._model_id is not None:
            steps.append(("acl.mdl.unload", lambda m=self._model_id: module.mdl.unload(m)))
        if self._desc:
            steps.append(("acl.mdl.destroy_desc", lambda d=self._desc: module.mdl.destroy_desc(d)))
        if self._stream:
            steps.append(("acl.rt.destroy_stream", lambda s=self._stream: module.rt.destroy_stream(s)))
        if self._context:
            steps.append(("acl.rt.destroy_context", lambda c=self._context: module.rt.destroy_context(c)))
        if self._visible_device >= 0:
            steps.append(("acl.rt.reset_device", lambda d=self._visible_device: module.rt.reset_device(d)))
        if self._owns_init:
            steps.append(("acl.finalize", module.finalize))
        for call, step in steps:
            try:
                ret = step()
            except Exception:
                logger.exception("%s raised while unloading '%s'", call, self._model_file)
                continue
            if ret != 0:
                logger.error("%s", acl.error(call, ret))
        self._reset()

    # -- helpers -------------------------------------------------------------------------------

    def _require(self) -> Acl:
        if self._acl is None:
            raise InternalError("the ACL backend is not loaded")
        return self._acl

    def _require_model(self) -> OmDescription:
        if self._om is None:
            raise InternalError("the ACL backend has no model loaded")
        return self._om


def sync_timeout_ms(config: mc.ModelConfig) -> int:
    """The config's sync_timeout_ms: a positive number of ms, or -1 to wait as long as the device takes."""
    parameter = config.parameters.get(SYNC_TIMEOUT_PARAMETER)
    if parameter is None or not parameter.string_value:
        return DEFAULT_SYNC_TIMEOUT_MS
    text = parameter.string_value
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value == -1 or 0 < value <= _INT32_MAX:
        return value
    raise ModelLoadError(
        f"model '{config.name}': parameter '{SYNC_TIMEOUT_PARAMETER}' must be a whole number of milliseconds from 1 "
        f"to {_INT32_MAX}, or -1 to wait without a limit; got '{text}'"
    )


def visible_index(device_id: int) -> int:
    """The id to give acl.rt.set_device. A worker's environment names its one NPU in
    ASCEND_RT_VISIBLE_DEVICES (the loader sets it), and pyACL re-indexes the visible devices from 0;
    otherwise `device_id` is already a logical id of this process. The variable is read as the runtime
    reads it (no spaces stripped), so the count is the runtime's."""
    value = os.environ.get(visible_devices.VARIABLE)
    return 0 if value is not None and len(visible_devices.parse(value).kept) == 1 else device_id


def create_backend() -> AclBackend:
    return AclBackend()

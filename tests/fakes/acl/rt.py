"""Simulated `acl.rt`: devices, contexts, streams, memory and copies."""

from __future__ import annotations

import os
import time

from ._state import (
    INVALID_PARAM,
    RT_CONTEXT_NULL,
    RT_PARAM_INVALID,
    RT_STREAM_CONTEXT,
    RUNTIME,
    STREAM_SYNC_TIMEOUT,
    SUCCESS,
    Context,
    api,
)

_last_utilization: dict[int, tuple[float, int]] = {}


@api("rt.get_run_mode", out=(0,))
def get_run_mode() -> tuple[int, int]:
    RUNTIME.require_init()
    return RUNTIME.run_mode, SUCCESS


@api("rt.get_device_count", out=(0,))
def get_device_count() -> tuple[int, int]:
    RUNTIME.require_init()
    return len(RUNTIME.visible_devices()), SUCCESS


@api("rt.set_device", parse="i")
def set_device(device: int) -> int:
    RUNTIME.require_init()
    RUNTIME.check_device(device)
    if device not in RUNTIME.default_contexts:
        handle = next(RUNTIME.handles)
        RUNTIME.contexts[handle] = Context(handle, device, default=True)
        RUNTIME.default_contexts[device] = handle
    RUNTIME.local.context = RUNTIME.default_contexts[device]
    return SUCCESS


@api("rt.get_device", out=(0,))
def get_device() -> tuple[int, int]:
    return RUNTIME.current_context().device, SUCCESS


@api("rt.reset_device", parse="i")
def reset_device(device: int) -> int:
    RUNTIME.require_init()
    RUNTIME.check_device(device)
    handle = RUNTIME.default_contexts.pop(device, None)
    if handle is not None:
        for stream in RUNTIME.contexts.pop(handle).streams:
            RUNTIME.streams.pop(stream, None)
        if getattr(RUNTIME.local, "context", None) == handle:
            RUNTIME.local.context = None
    RUNTIME.faulty.pop(device, None)
    return SUCCESS


@api("rt.create_context", out=(0,), parse="i")
def create_context(device: int) -> tuple[int, int]:
    RUNTIME.require_init()
    RUNTIME.check_device(device)
    handle = next(RUNTIME.handles)
    RUNTIME.contexts[handle] = Context(handle, device, default=False)
    RUNTIME.local.context = handle
    return handle, SUCCESS


@api("rt.set_context", parse="k")
def set_context(context: int) -> int:
    RUNTIME.require_init()
    if context not in RUNTIME.contexts:
        raise RUNTIME.fail(RT_PARAM_INVALID, f"unknown context {context:#x}")
    RUNTIME.local.context = context
    return SUCCESS


@api("rt.get_context", out=(0,))
def get_context() -> tuple[int, int]:
    return RUNTIME.current_context().handle, SUCCESS


@api("rt.destroy_context", parse="k")
def destroy_context(context: int) -> int:
    RUNTIME.require_init()
    found = RUNTIME.contexts.get(context)
    if found is None or found.default:
        raise RUNTIME.fail(RT_PARAM_INVALID, f"{context:#x} is not a context created by create_context")
    if any(model.context == context for model in RUNTIME.models.values()):
        raise RUNTIME.fail(RT_PARAM_INVALID, "unload the context's models before destroying it")
    for stream in found.streams:
        RUNTIME.streams.pop(stream, None)
    del RUNTIME.contexts[context]
    if getattr(RUNTIME.local, "context", None) == context:
        RUNTIME.local.context = None
    return SUCCESS


@api("rt.create_stream", out=(0,))
def create_stream() -> tuple[int, int]:
    context = RUNTIME.current_context()
    handle = next(RUNTIME.handles)
    context.streams.add(handle)
    RUNTIME.streams[handle] = context.handle
    return handle, SUCCESS


def _stream_context(stream: int) -> Context:
    context = RUNTIME.current_context()
    if stream not in RUNTIME.streams:
        raise RUNTIME.fail(RT_PARAM_INVALID, f"unknown stream {stream:#x}")
    if RUNTIME.streams[stream] != context.handle:
        raise RUNTIME.fail(RT_STREAM_CONTEXT, "the stream does not belong to the current context")
    return context


@api("rt.destroy_stream", parse="k")
def destroy_stream(stream: int) -> int:
    context = _stream_context(stream)
    context.streams.discard(stream)
    del RUNTIME.streams[stream]
    RUNTIME.queued.pop(stream, None)  # work never synchronized: its outputs are lost with the stream
    return SUCCESS


def synchronize_stream(stream: int) -> int:
    """Waits, with the GIL and the simulator's lock released (as the binding releases the GIL), until the
    work queued on `stream` ends; then its outputs appear and its device time counts as busy. Work that
    hangs (ACL_SIM_HANG_FILE) never ends: this waits forever, as on a hung device."""
    ends_at, ret = _queued_end(stream)
    if ret != SUCCESS:
        return int(ret)
    return _wait(stream, ends_at, None)


def synchronize_stream_with_timeout(stream: int, timeout: int) -> int:
    """synchronize_stream that gives up after `timeout` ms, leaving the work queued; -1 and 0 set no limit (the
    runtime's limit checks all test `timeout > 0`, e.g. stars_engine.cc's "sync task timeout"). A wait that runs out returns ACL_ERROR_RT_STREAM_SYNC_TIMEOUT,
    507046 (hicann/runtime src/acl/aclrt_impl/stream.cpp aclrtSynchronizeStreamWithTimeoutImpl), or the code
    written in ACL_SIM_HANG_FILE."""
    ends_at, ret = _queued_end_with_timeout(stream, timeout)
    if ret != SUCCESS:
        return int(ret)
    limit = int(timeout)
    return _wait(stream, ends_at, None if limit <= 0 else time.monotonic_ns() + limit * 1_000_000)


def _wait(stream: int, ends_at: int, gives_up_at: int | None) -> int:
    wait_ns = min(ends_at, gives_up_at or ends_at) - time.monotonic_ns()
    if wait_ns > 0:
        time.sleep(wait_ns / 1e9)
    with RUNTIME.lock:
        if gives_up_at is not None and ends_at > gives_up_at:
            hung = [work for work in RUNTIME.queued.get(stream, ()) if work.ends_at > gives_up_at]
            code = next((work.hang for work in hung if work.hang), STREAM_SYNC_TIMEOUT)
            RUNTIME.fail(code, f"stream {stream:#x} did not finish within the timeout")  # for get_recent_err_msg
            return code
        failed = None
        for work in RUNTIME.queued.pop(stream, []):
            if work.error:
                failed = failed or work
                continue
            for address, data in work.writes:
                RUNTIME.write(address, data)
            RUNTIME.busy_ns[work.device] += work.device_ns
        if failed is not None:
            RUNTIME.fail(failed.error, failed.message)  # for get_recent_err_msg
            return failed.error
    return SUCCESS


@api("rt.synchronize_stream", out=(0,), parse="k")
def _queued_end(stream: int) -> tuple[int, int]:
    return _end_of(stream), SUCCESS


@api("rt.synchronize_stream_with_timeout", out=(0,), parse="ki")
def _queued_end_with_timeout(stream: int, timeout: int) -> tuple[int, int]:
    # aclrtSynchronizeStreamWithTimeoutImpl takes -1 up to INT_MAX, and refuses the rest with 107000.
    if timeout < -1:
        raise RUNTIME.fail(RT_PARAM_INVALID, f"timeout must be in [-1, INT_MAX], got {timeout}")
    return _end_of(stream), SUCCESS


def _end_of(stream: int) -> int:
    """When the work queued on `stream` ends (monotonic ns; 0 when none is)."""
    _stream_context(stream)
    return max((work.ends_at for work in RUNTIME.queued.get(stream, ())), default=0)


@api("rt.malloc", out=(0,), parse="ki")
def malloc(size: int, policy: int) -> tuple[int, int]:
    if policy not in (0, 1, 2, 3, 4, 5, 6, 7):
        raise RUNTIME.fail(INVALID_PARAM, f"invalid memory policy {policy}")
    return RUNTIME.allocate(size, "device"), SUCCESS


@api("rt.free", parse="k")
def free(address: int) -> int:
    RUNTIME.require_init()
    RUNTIME.release(address, "device")
    return SUCCESS


@api("rt.malloc_host", out=(0,), parse="k")
def malloc_host(size: int) -> tuple[int, int]:
    if RUNTIME.run_mode == 0:
        return RUNTIME.allocate(size, "device"), SUCCESS  # on the device's own CPU, "host" memory is device memory
    return RUNTIME.allocate(size, "host"), SUCCESS


@api("rt.free_host", parse="k")
def free_host(address: int) -> int:
    RUNTIME.require_init()
    RUNTIME.release(address, "device" if RUNTIME.run_mode == 0 else "host")
    return SUCCESS


@api("rt.memcpy", parse="kkkki")
def memcpy(dst: int, dest_max: int, src: int, count: int, kind: int) -> int:
    RUNTIME.current_context()
    if count > dest_max:
        raise RUNTIME.fail(INVALID_PARAM, f"count {count} exceeds the destination's {dest_max} bytes")
    # `kind` is a reserved parameter whose value has no effect: the runtime decides from the two
    # pointers whether the copy can be made (aclrtMemcpy in CANN 5.0.4 through 8.0, HIASCEND
    # canncommercial/800/apiref/appdevgapi/aclcppdevg_03_0105.html; pyacl.md §2.2). Every pair of host
    # and device pointers can be copied between here, so the kind is not checked.
    if count:
        RUNTIME.copy(dst, src, count)
    return SUCCESS


@api("rt.memset", parse="kkik")
def memset(address: int, max_count: int, value: int, count: int) -> int:
    RUNTIME.current_context()
    RUNTIME.check_untouched(address, count, "written")
    if count > max_count:
        raise RUNTIME.fail(INVALID_PARAM, f"count {count} exceeds max_count {max_count}")
    if RUNTIME.space_of(address) != "device":
        raise RUNTIME.fail(RT_PARAM_INVALID, f"{address:#x} is not device memory")
    if count:
        RUNTIME.write(address, bytes([value & 0xFF]) * count)
    return SUCCESS


@api("rt.get_mem_info", out=(0, 0), parse="i")
def get_mem_info(attribute: int) -> tuple[int, int, int]:
    context = RUNTIME.current_context()
    if attribute not in range(18):
        raise RUNTIME.fail(INVALID_PARAM, f"invalid memory attribute {attribute}")
    if attribute not in (0, 1, 12):  # the simulated 310P has one kind of device memory
        return 0, 0, SUCCESS
    total = RUNTIME.memory_bytes
    return total - RUNTIME.device_used(context.device), total, SUCCESS


@api("rt.get_device_utilization_rate", out=({},), parse="i")
def get_device_utilization_rate(device: int) -> tuple[dict[str, int], int]:
    """AI Core busy share since the previous query, in percent."""
    RUNTIME.require_init()
    if getattr(RUNTIME.local, "context", None) is None:
        raise RUNTIME.fail(RT_CONTEXT_NULL, "set the device first")
    RUNTIME.check_device(device)
    now = time.monotonic_ns()
    busy = RUNTIME.busy_ns[device]
    previous_at, previous_busy = _last_utilization.get(device, (now, busy))
    _last_utilization[device] = (now, busy)
    share = 0 if now <= previous_at else min(100, round(100 * (busy - previous_busy) / (now - previous_at)))
    # A field the chip cannot measure reads -1 while the call still succeeds (pyacl.md, first section).
    unknown = os.environ.get("ACL_SIM_UTILIZATION_UNKNOWN") == "1"
    rates = {
        "cube_utilization": -1 if unknown else share,
        "vector_utilization": -1 if unknown else share,
        "aicpu_utilization": 0,
        "memory_utilization": 0,
        "utilization_extend": 0,
    }
    return rates, SUCCESS

"""The pyACL module, imported lazily in the worker, and return codes turned into exceptions."""

from __future__ import annotations

import importlib
from typing import Any

from geserve.backends.base import DeviceFaultError
from geserve.errors import InternalError, ModelLoadError

# aclrtMemcpyKind, aclrtRunMode, aclrtMemMallocPolicy, aclrtMemAttr (acl_rt.h)
MEMCPY_HOST_TO_DEVICE = 1
MEMCPY_DEVICE_TO_HOST = 2
MEMCPY_DEVICE_TO_DEVICE = 3
RUN_MODE_DEVICE = 0
MALLOC_HUGE_FIRST = 0
MEM_DDR = 0
MEM_HBM = 1
REPEAT_INITIALIZE = 100002
DYNAMIC_TENSOR_NAME = "ascend_mbatch_shape_data"

_ERROR_NAMES = {
    100000: "ACL_ERROR_INVALID_PARAM",
    100001: "ACL_ERROR_UNINITIALIZE",
    100011: "ACL_ERROR_INVALID_MODEL_ID",
    100012: "ACL_ERROR_DESERIALIZE_MODEL",
    100013: "ACL_ERROR_PARSE_MODEL",
    100014: "ACL_ERROR_READ_MODEL_FAILURE",
    100019: "ACL_ERROR_MODEL_NOT_DYNAMIC",
    107000: "ACL_ERROR_RT_PARAM_INVALID",
    107001: "ACL_ERROR_RT_INVALID_DEVICEID",
    107002: "ACL_ERROR_RT_CONTEXT_NULL",
    107003: "ACL_ERROR_RT_STREAM_CONTEXT",
    107004: "ACL_ERROR_RT_MODEL_CONTEXT",
    107019: "ACL_ERROR_RT_WAIT_TIMEOUT",
    107020: "ACL_ERROR_RT_TASK_TIMEOUT",
    145013: "ACL_ERROR_GE_DYNAMIC_BATCH_SIZE_INVALID",
    148049: "ACL_ERROR_INVALID_OPP_PATH",
    207001: "ACL_ERROR_RT_MEMORY_ALLOCATION",
    207004: "ACL_ERROR_RT_NO_DEVICE",
    207018: "ACL_ERROR_RT_DEVICE_OOM",
    500001: "ACL_ERROR_FAILURE",
    507010: "ACL_ERROR_RT_LOST_HEARTBEAT",
    507011: "ACL_ERROR_RT_MODEL_EXECUTE",
    507014: "ACL_ERROR_RT_AICORE_TIMEOUT",
    507015: "ACL_ERROR_RT_AICORE_EXCEPTION",
    507053: "ACL_ERROR_RT_DEVICE_MEM_ERROR",
    507046: "ACL_ERROR_RT_STREAM_SYNC_TIMEOUT",
    507054: "ACL_ERROR_RT_HBM_MULTI_BIT_ECC_ERROR",
    507899: "ACL_ERROR_RT_DRV_INTERNAL_ERROR",
}


# What a synchronize that gives up returns: ACL_ERROR_RT_STREAM_SYNC_TIMEOUT, 507046 (hicann/runtime
# src/acl/aclrt_impl/stream.cpp aclrtSynchronizeStreamWithTimeoutImpl passes the runtime's stream-sync timeout
# through as that code). The synchronize_stream_with_timeout docs say only "non-zero on failure", so rt_error_codes.h's
# ACL_ERROR_RT_WAIT_TIMEOUT ("wait timeout") and ACL_ERROR_RT_TASK_TIMEOUT ("task timeout"), which they do not rule
# out, are taken the same way: all three mean the device did not finish.
SYNC_TIMEOUTS = frozenset({107019, 107020, 507046})
# Codes outside 5xxxxx that still mean the device can no longer be trusted: work still queued on a stream
# that timed out would write into buffers the next batch uses.
_DEVICE_FAULTS = frozenset({107019, 107020})


def import_acl(model_name: str) -> Any:
    """`import acl`, or a load error that says where pyACL comes from."""
    try:
        return importlib.import_module("acl")
    except ImportError as error:
        raise ModelLoadError(
            f"model '{model_name}': the 'ge' backend needs pyACL (the Python module 'acl'), which comes with "
            "the Ascend CANN toolkit, not with pip: install CANN and source its set_env.sh "
            "('source /usr/local/Ascend/cann/set_env.sh' for CANN 8.5 and newer, "
            f"'source /usr/local/Ascend/ascend-toolkit/set_env.sh' before) before starting geserve ({error})"
        ) from None


def describe_code(code: int) -> str:
    name = _ERROR_NAMES.get(code)
    return f"{code} ({name})" if name else str(code)


class Acl:
    """Calls into pyACL for one model, raising on any non-zero return code with the runtime's message."""

    def __init__(self, module: Any, model_name: str) -> None:
        self.module = module
        self.model_name = model_name

    def error(self, call: str, code: int, device_fault: bool = True) -> Exception:
        """The exception for `call` returning `code`: a DeviceFaultError for the codes that mean the device
        failed, unless `device_fault` is False (a call that never reaches the device, whatever its code)."""
        message = ""
        try:
            message = str(self.module.get_recent_err_msg() or "").strip()
        except Exception:
            message = ""
        text = f"model '{self.model_name}': {call} failed with error {describe_code(code)}"
        if message:
            text += f": {message}"
        if device_fault and (code // 100000 == 5 or code in _DEVICE_FAULTS):
            # 5xxxxx: the device or runtime failed; nothing in this process can be trusted any more.
            return DeviceFaultError(text + "; the instance restarts")
        return InternalError(text)

    def check(self, call: str, ret: int) -> None:
        """For calls that return only `ret`."""
        if ret != 0:
            raise self.error(call, ret)

    def out(self, call: str, result: tuple[Any, ...]) -> Any:
        """For calls returning `(value, ret)`: the value."""
        *values, ret = result
        if ret != 0:
            raise self.error(call, ret)
        return values[0] if len(values) == 1 else tuple(values)

    def handle(self, call: str, value: int) -> int:
        """For calls returning a handle directly, 0 on failure."""
        if not value:
            raise self.error(call, 500000)
        return value


def load_error(error: Exception) -> ModelLoadError:
    """A failure while loading is the model's load error, whatever its class."""
    return ModelLoadError(str(error))

"""A simulator of pyACL (`import acl`), the Python binding of Huawei's AscendCL, for tests only.

pyACL and NPUs do not exist on these machines; tests that need them put `tests/fakes` first on
`sys.path` (or PYTHONPATH of a geserve process) so that `import acl` finds this package. It follows
`shared/reference/pyacl.md`: plain-int handles, `(value, ..., ret)` tuples, separate host and device
address spaces, per-thread contexts, datasets and data buffers, dynamic-batch gears, the real error
codes for misuse, and a leak report at `acl.finalize`. Models are real-format `.om` files, described from
the vendored samples' expected.json or the test writer's record, never by geserve's reader (`om.py`);
`FIDELITY.md` gives the source behind each simulated behaviour.
"""

from __future__ import annotations

import os
import time

from . import mdl, rt, util
from ._state import REPEAT_FINALIZE, REPEAT_INITIALIZE, RUNTIME, SUCCESS, api

__all__ = ["mdl", "rt", "util"]

_DATA_TYPE_SIZES = {0: 4, 1: 2, 2: 1, 3: 4, 4: 1, 6: 2, 7: 2, 8: 4, 9: 8, 10: 8, 11: 8, 12: 1, 27: 2}


@api("init", parse="|s")
def init(config_path: str | None = None) -> int:
    delay_ms = int(os.environ.get("ACL_SIM_INIT_DELAY_MS", "0"))
    if delay_ms > 0:
        time.sleep(delay_ms / 1000)  # a driver slow to answer (or wedged): the caller's timeout decides
    if RUNTIME.initialized:
        return REPEAT_INITIALIZE
    if RUNTIME.finalized:
        RUNTIME.reset()
    RUNTIME.initialized = True
    return SUCCESS


@api("finalize")
def finalize() -> int:
    if not RUNTIME.initialized:
        return REPEAT_FINALIZE
    RUNTIME.initialized = False
    RUNTIME.finalized = True
    RUNTIME.write_report()
    return SUCCESS


@api("get_recent_err_msg", value="")
def get_recent_err_msg() -> str:
    return RUNTIME.recent_error()


@api("get_version", out=(0, 0, 0))
def get_version() -> tuple[int, int, int, int]:
    return 8, 0, 0, SUCCESS


@api("get_soc_name", value="")
def get_soc_name() -> str:
    """The chip, named as ATC's --soc_version names it; tests set it with ACL_SIM_SOC_NAME."""
    return os.environ.get("ACL_SIM_SOC_NAME", "Ascend310P3")


@api("data_type_size", value=0, parse="i")
def data_type_size(dtype: int) -> int:
    return _DATA_TYPE_SIZES.get(dtype, 0)


@api("create_data_buffer", value=0, parse="kk")
def create_data_buffer(address: int, size: int) -> int:
    RUNTIME.require_init()
    handle = next(RUNTIME.handles)
    RUNTIME.data_buffers[handle] = (address, size)
    return handle


def _buffer(handle: int) -> tuple[int, int]:
    if handle not in RUNTIME.data_buffers:
        raise RUNTIME.fail(100000, f"unknown data buffer {handle:#x}")
    return RUNTIME.data_buffers[handle]


@api("get_data_buffer_addr", value=0, parse="k")
def get_data_buffer_addr(handle: int) -> int:
    return _buffer(handle)[0]


@api("get_data_buffer_size_v2", value=0, parse="k")
def get_data_buffer_size_v2(handle: int) -> int:
    return _buffer(handle)[1]


@api("update_data_buffer", parse="kkk")
def update_data_buffer(handle: int, address: int, size: int) -> int:
    _buffer(handle)
    RUNTIME.data_buffers[handle] = (address, size)
    return SUCCESS


@api("destroy_data_buffer", parse="k")
def destroy_data_buffer(handle: int) -> int:
    _buffer(handle)
    del RUNTIME.data_buffers[handle]
    for buffers in RUNTIME.datasets.values():
        if handle in buffers:
            buffers[buffers.index(handle)] = 0  # the dataset now holds a dangling entry
    return SUCCESS

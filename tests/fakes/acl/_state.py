"""State of the simulated Ascend runtime in this process: devices, memory, contexts, models, leaks.

Everything a real pyACL process holds lives here, so that misuse returns the codes the real
runtime returns and `acl.finalize` can report whatever was never released. Configuration comes
from the environment, since the simulator runs inside geserve's worker processes:

- ACL_SIM_DEVICE_COUNT   physical NPUs (default 2); ASCEND_RT_VISIBLE_DEVICES restricts and re-indexes
- ACL_SIM_RUN_MODE       1 = ACL_HOST (default, PCIe card), 0 = ACL_DEVICE (app on the device's CPU)
- ACL_SIM_MEMORY_BYTES   device memory per NPU (default 8 GiB)
- ACL_SIM_EXECUTE_US     simulated device time per execute (default 0): t0 of t(b) = t0 + k*b; `execute` spends it
                         holding the GIL, `execute_async` queues it on the device and `synchronize_stream` waits
                         for it with the GIL released
- ACL_SIM_EXECUTE_US_PER_ROW  k of t(b): device time per row of the gear (or static batch) that runs (default 0)
- ACL_SIM_FAULT_FILE     a file holding an error code: the next execute in any process takes it
                         (renames it away) and fails with that code; the device then stays faulty
- ACL_SIM_HANG_FILE      a file holding an error code: the next execute_async in any process takes it and its work
                         never ends (a hung AI Core); synchronize_stream_with_timeout gives up on it with that
                         code (default 507046, what the runtime returns), synchronize_stream waits forever
- ACL_SIM_INIT_DELAY_MS  acl.init takes this long (default 0): a driver slow or wedged at start
- ACL_SIM_REPORT_DIR     where each process writes `acl-sim-<pid>.json` (calls, executions, leaks)
- ACL_SIM_UTILIZATION_UNKNOWN  1: get_device_utilization_rate reads -1 (unsupported) for the AI Core fields
- ACL_SIM_SOC_NAME       what get_soc_name answers (default Ascend310P3), named as ATC --soc_version names chips
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import itertools
import json
import operator
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUCCESS = 0
INVALID_PARAM = 100000
UNINITIALIZE = 100001
REPEAT_INITIALIZE = 100002
INVALID_MODEL_ID = 100011
DESERIALIZE_MODEL = 100012
READ_MODEL_FAILURE = 100014
MODEL_NOT_DYNAMIC = 100019
REPEAT_FINALIZE = 100037
INVALID_RESOURCE_HANDLE = 200005
RT_PARAM_INVALID = 107000
RT_INVALID_DEVICEID = 107001
RT_CONTEXT_NULL = 107002
RT_STREAM_CONTEXT = 107003
RT_MODEL_CONTEXT = 107004
NEVER = 1 << 62  # monotonic ns at which a hung execute ends
# ACL_ERROR_RT_STREAM_SYNC_TIMEOUT: what aclrtSynchronizeStreamWithTimeout returns when the wait runs out
# (hicann/runtime src/acl/aclrt_impl/stream.cpp aclrtSynchronizeStreamWithTimeoutImpl; rt_error_codes.h).
STREAM_SYNC_TIMEOUT = 507046
RT_FEATURE_NOT_SUPPORT = 207000
RT_MEMORY_ALLOCATION = 207001
GE_DYNAMIC_BATCH_SIZE_INVALID = 145013
FAILURE = 500001  # ACL_ERROR_FAILURE

HOST_TO_HOST, HOST_TO_DEVICE, DEVICE_TO_HOST, DEVICE_TO_DEVICE = 0, 1, 2, 3
ACL_DEVICE, ACL_HOST = 0, 1
DYNAMIC_TENSOR_NAME = "ascend_mbatch_shape_data"

# Device addresses live in the kernel half of the address space: dereferencing one on the host
# faults, as it does on hardware. Their bytes are kept in host buffers the simulator maps to.
_DEVICE_BASE = 0xFFFF_A000_0000_0000
_LIBC = ctypes.PyDLL(None)  # PyDLL: calls keep the GIL, as the real binding's execute does


@dataclass
class Queued:
    """An execute launched on a stream: when the device finishes it, and what it writes then."""

    device: int
    ends_at: int  # monotonic ns
    device_ns: int
    writes: list[tuple[int, bytes]]  # (output address, bytes) written when it ends
    buffers: list[tuple[int, int]]  # (address, size) of every buffer it reads or writes
    error: int = 0  # a device fault: synchronize_stream returns it, as the runtime reports faults there
    message: str = ""
    hang: int = 0  # a hung execute: it never ends, and a timed-out synchronize returns this code


class SimError(Exception):
    """A call failed with `code`; the public functions turn it into their return convention."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Allocation:
    address: int
    size: int
    space: str  # "device" or "host" (pinned host memory from malloc_host)
    device: int | None
    backing: Any  # ctypes buffer holding the bytes

    @property
    def real(self) -> int:
        return ctypes.addressof(self.backing)


@dataclass
class Context:
    handle: int
    device: int
    default: bool
    streams: set[int] = field(default_factory=set)


@dataclass
class Model:
    model_id: int
    context: int
    om: Any  # om.OmModel: the file's description and how to run it
    weight_bytes: int
    batch: int | None = None  # the gear set by set_dynamic_batch_size

    @property
    def gears(self) -> list[int]:
        return list(self.om.gears)


class Runtime:
    """One process's simulated pyACL runtime."""

    def __init__(self) -> None:
        self.reset()
        atexit.register(self._report_at_exit)

    def reset(self) -> None:
        self.initialized = False
        self.finalized = False
        self.handles = itertools.count(0x1000)
        self.device_memory = itertools.count(0)
        self.allocations: dict[int, Allocation] = {}
        self.contexts: dict[int, Context] = {}
        self.default_contexts: dict[int, int] = {}
        self.streams: dict[int, int] = {}  # stream -> context
        self.models: dict[int, Model] = {}
        self.model_ids = itertools.count(1)
        self.descs: dict[int, int | None] = {}  # desc -> model id it describes
        self.datasets: dict[int, list[int]] = {}
        self.data_buffers: dict[int, tuple[int, int]] = {}  # buffer -> (address, size)
        self.faulty: dict[int, int] = {}  # device -> the 5xxxxx code it keeps failing with
        self.busy_ns: dict[int, int] = collections.defaultdict(int)
        self.calls: collections.Counter[str] = collections.Counter()
        self.executions = 0
        self.rows_executed: list[int] = []
        self.last_inputs: dict[str, Any] = {}  # what the device read at the last execute
        self.device_free_at: dict[int, int] = collections.defaultdict(int)  # monotonic ns the queued work ends
        self.queued: dict[int, list[Queued]] = collections.defaultdict(list)  # stream -> launched, not synchronized
        self.local = threading.local()
        self.lock = threading.RLock()
        self.report_written = False

    # -- configuration -------------------------------------------------------------------------

    @property
    def run_mode(self) -> int:
        return int(os.environ.get("ACL_SIM_RUN_MODE", str(ACL_HOST)))

    def visible_devices(self) -> list[int]:
        physical = int(os.environ.get("ACL_SIM_DEVICE_COUNT", "2"))
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        if visible is None:
            return list(range(physical))
        # hicann/runtime src/runtime/core/src/runtime.cc: SplitString reads runs of ASCII digits separated by single
        # commas from the first character, and stops at anything else, a space included ('1, 2' is device 1 alone,
        # HIASCEND envref_07_0028); Runtime::GetVisibleDevices stops at the first id past the devices and once it
        # holds as many ids as there are devices, but refuses the whole list (no device at all) when an id is lower
        # than the one before it or repeats one.
        read = re.match(r"[0-9]+(?:,[0-9]+)*", visible)
        devices: list[int] = []
        for item in read.group().split(",") if read else ():
            device = int(item)
            if device >= physical or device > (1 << 31) - 1:
                break
            if devices and (device < devices[-1] or device in devices):
                return []
            devices.append(device)
            if len(devices) >= physical:
                break
        return devices

    @property
    def memory_bytes(self) -> int:
        return int(os.environ.get("ACL_SIM_MEMORY_BYTES", str(8 << 30)))

    # -- checks shared by the API functions ----------------------------------------------------

    def record(self, name: str) -> None:
        self.calls[name] += 1

    def fail(self, code: int, message: str) -> SimError:
        self.local.message = f"EE{code % 10000:04d}: {message}"
        return SimError(code, message)

    def recent_error(self) -> str:
        message: str = getattr(self.local, "message", "")
        self.local.message = ""
        return message

    def require_init(self) -> None:
        if not self.initialized:
            raise self.fail(UNINITIALIZE, "acl.init has not been called")

    def current_context(self) -> Context:
        self.require_init()
        handle = getattr(self.local, "context", None)
        if handle is None or handle not in self.contexts:
            raise self.fail(RT_CONTEXT_NULL, "no current context: call acl.rt.set_device or set_context first")
        return self.contexts[handle]

    def check_device(self, device: int) -> None:
        if not 0 <= device < len(self.visible_devices()):
            raise self.fail(RT_INVALID_DEVICEID, f"invalid device id {device}")

    # -- memory --------------------------------------------------------------------------------

    def allocate(self, size: int, space: str) -> int:
        if size <= 0:
            raise self.fail(INVALID_PARAM, f"size must be positive, got {size}")
        device: int | None = None
        if space == "device":
            device = self.current_context().device
            # malloc rounds up to a multiple of 32 plus 32 bytes
            size = (size + 31) // 32 * 32 + 32
            if self.device_used(device) + size > self.memory_bytes:
                raise self.fail(RT_MEMORY_ALLOCATION, "device out of memory")
            address = _DEVICE_BASE + (next(self.device_memory) << 32)
        else:
            self.require_init()
        backing = (ctypes.c_char * size)()
        if space != "device":
            address = ctypes.addressof(backing)
        self.allocations[address] = Allocation(address, size, space, device, backing)
        return address

    def release(self, address: int, space: str) -> None:
        allocation = self.allocations.get(address)
        if allocation is None or allocation.space != space:
            raise self.fail(
                RT_PARAM_INVALID, f"address {address:#x} was not allocated as {space} memory (double free?)"
            )
        del self.allocations[address]

    def device_used(self, device: int) -> int:
        used = sum(a.size for a in self.allocations.values() if a.device == device)
        return used + sum(m.weight_bytes for m in self.models.values() if self.contexts[m.context].device == device)

    def find(self, address: int) -> Allocation | None:
        for allocation in self.allocations.values():
            if allocation.address <= address < allocation.address + allocation.size:
                return allocation
        return None

    def space_of(self, address: int) -> str:
        """Device allocations are device memory; in ACL_DEVICE mode all of this process's memory is."""
        allocation = self.find(address)
        if self.run_mode == ACL_DEVICE:
            return "device"
        return allocation.space if allocation is not None and allocation.space == "device" else "host"

    def resolve(self, address: int, count: int) -> int:
        """A real address for `count` bytes at `address`, checking device ranges."""
        allocation = self.find(address)
        if allocation is None:
            if address >= _DEVICE_BASE:
                raise self.fail(RT_PARAM_INVALID, f"device address {address:#x} is not allocated")
            return address  # pageable host memory (a numpy array): trusted like the real runtime does
        if address + count > allocation.address + allocation.size:
            raise self.fail(
                RT_PARAM_INVALID,
                f"{count} bytes at {address:#x} overrun the {allocation.size}-byte allocation at {allocation.address:#x}",
            )
        return allocation.real + (address - allocation.address)

    def read(self, address: int, count: int) -> bytes:
        return ctypes.string_at(self.resolve(address, count), count)

    def view(self, address: int, count: int) -> memoryview:
        """The `count` bytes at `address`, in place (what the device reads, without a host copy)."""
        real = self.resolve(address, count)
        allocation = self.find(address)
        if allocation is None:  # the caller's own memory (pageable host memory in ACL_DEVICE mode)
            return memoryview((ctypes.c_char * count).from_address(real)).cast("B")
        # from_buffer keeps the allocation's backing alive for as long as the view is
        return memoryview((ctypes.c_char * count).from_buffer(allocation.backing, real - allocation.real)).cast("B")

    def write(self, address: int, data: bytes) -> None:
        ctypes.memmove(self.resolve(address, len(data)), data, len(data))

    def copy(self, destination: int, source: int, count: int) -> None:
        self.check_untouched(destination, count, "written")
        self.check_untouched(source, count, "read")
        ctypes.memmove(self.resolve(destination, count), self.resolve(source, count), count)

    def check_untouched(self, address: int, count: int, how: str) -> None:
        """Stricter than the runtime, which gives garbage instead: device memory that a launched, not yet
        synchronized execute reads or writes may not be touched by the host."""
        for stream, launched in self.queued.items():
            for work in launched:
                for start, size in work.buffers:
                    if address < start + size and start < address + count:
                        raise self.fail(
                            RT_PARAM_INVALID,
                            f"{count} bytes at {address:#x} are {how} while an execute queued on stream "
                            f"{stream:#x} still uses them: synchronize the stream first",
                        )

    # -- leaks and the report ------------------------------------------------------------------

    def leaks(self) -> list[str]:
        found = [f"{a.space} memory {a.address:#x} ({a.size} bytes) not freed" for a in self.allocations.values()]
        found += [f"model {model_id} not unloaded" for model_id in self.models]
        found += [f"model description {desc:#x} not destroyed" for desc in self.descs]
        found += [f"dataset {ds:#x} not destroyed" for ds in self.datasets]
        found += [f"data buffer {buf:#x} not destroyed" for buf in self.data_buffers]
        found += [f"stream {stream:#x} not destroyed" for stream in self.streams]
        found += [f"context {c.handle:#x} not destroyed" for c in self.contexts.values() if not c.default]
        found += [f"device {device} not reset" for device in self.default_contexts]
        return found

    def write_report(self) -> None:
        directory = os.environ.get("ACL_SIM_REPORT_DIR")
        if not directory:
            return
        report = {
            "pid": os.getpid(),
            "visible_devices": os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
            "device_count": len(self.visible_devices()),  # what acl.rt.get_device_count answers
            "run_mode": self.run_mode,
            "finalized": self.finalized,
            "leaks": self.leaks(),
            "calls": dict(self.calls),
            "executions": self.executions,
            "rows_executed": self.rows_executed,
        }
        path = Path(directory) / f"acl-sim-{os.getpid()}.json"
        path.write_text(json.dumps(report, indent=1))
        self.report_written = True

    def _report_at_exit(self) -> None:
        if self.calls and not self.report_written:
            self.write_report()  # the process ended without acl.finalize: the report says so

    # -- device time and faults ----------------------------------------------------------------

    @staticmethod
    def device_time_us(rows: int) -> int:
        """t(b) = t0 + k*b for a batch of b rows."""
        microseconds = int(os.environ.get("ACL_SIM_EXECUTE_US", "0"))
        return microseconds + int(float(os.environ.get("ACL_SIM_EXECUTE_US_PER_ROW", "0")) * rows)

    def spend_device_time(self, rows: int) -> None:
        """A synchronous execute: the device is busy for t(b), the host's core is not (the GIL stays held)."""
        microseconds = self.device_time_us(rows)
        if microseconds > 0:
            _LIBC.usleep(microseconds)

    @staticmethod
    def injected_hang() -> int | None:
        """The code a hung stream's timed-out synchronize returns, when a hang was injected for this execute."""
        return _take_file(os.environ.get("ACL_SIM_HANG_FILE"), STREAM_SYNC_TIMEOUT)

    def injected_fault(self, device: int) -> int | None:
        if device in self.faulty:
            return self.faulty[device]
        code = _take_file(os.environ.get("ACL_SIM_FAULT_FILE"), 507011)
        if code is not None:
            self.faulty[device] = code
        return code


def _take_file(path: str | None, default: int) -> int | None:
    """The code in an injection file, which this call takes away; None when there is no such file."""
    if not path:
        return None
    taken = f"{path}.taken-{os.getpid()}"
    try:
        os.rename(path, taken)  # atomic: exactly one execute in one process takes it
    except FileNotFoundError:
        return None
    code = int(Path(taken).read_text().strip() or str(default))
    os.unlink(taken)
    return code


RUNTIME = Runtime()


_NO_VALUE = object()
_UNSIGNED_LONG = (1 << 64) - 1
_UNSIGNED_INT = (1 << 32) - 1


def _parse_one(code: str, value: Any) -> tuple[bool, Any]:
    """One argument as CPython's PyArg_ParseTuple converts it for format `code` (Python/getargs.c): (parsed?, value).
    `k`/`K` (handles, pointers, sizes, indexes) take only an int or a subclass of it, masked to 64 bits: a numpy
    integer or a float is refused. `i` and `I` take anything with __index__ (numpy integers included, floats not);
    `i` must fit a C int, `I` is masked to 32 bits. `s` takes a str without NUL characters."""
    if code in "kK":
        return isinstance(value, int), value & _UNSIGNED_LONG if isinstance(value, int) else value
    if code in "iI":
        try:
            number = operator.index(value)
        except TypeError:
            return False, value
        if code == "I":
            return True, number & _UNSIGNED_INT
        return -(1 << 31) <= number < (1 << 31), number
    if code == "s":
        return isinstance(value, str) and "\0" not in value, value
    raise ValueError(f"format {code!r} is not simulated")


def parse_args(name: str, formats: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`args` as the binding's PyArg_ParseTuple(args, formats) takes them (`|` starts the optional ones), or the
    TypeError its CHECK_NULL raises in place of the parser's own: "acl.<name> args parse failed", with a "!" in
    the acl.mdl functions (RT-SRC `utils_methods.h` CHECK_NULL_2; the messages of `mdl/mdl_wrap.cpp`,
    `py_init_acl.cpp` and `rt/*.cpp`)."""
    required, _, optional = formats.partition("|")
    codes = required + optional
    parsed: list[Any] = []
    ok = len(required) <= len(args) <= len(codes)
    for code, value in zip(codes, args if ok else (), strict=False):
        accepted, converted = _parse_one(code, value)
        ok = ok and accepted
        parsed.append(converted)
    if not ok:
        raise TypeError(f"acl.{name} args parse failed{'!' if name.startswith('mdl.') else ''}")
    return tuple(parsed)


def api(name: str, out: tuple[Any, ...] | None = None, value: Any = _NO_VALUE, parse: str | None = None) -> Any:
    """Give a simulated call the binding's return convention on failure: `ret`; or the out-values
    (zero/empty) and `ret` last when the C call has out-params; or just `value` when the C call
    returns a value instead of an error code. `parse` is the binding's PyArg_ParseTuple format for the
    call's arguments (parse_args); the arguments of a call without one are not checked. Every call is counted
    for the report."""

    def wrap(function: Any) -> Any:
        def call(*args: Any) -> Any:
            RUNTIME.record(name)
            if parse is not None:
                args = parse_args(name, parse, args)
            with RUNTIME.lock:
                try:
                    return function(*args)
                except SimError as error:
                    if out is not None:
                        return (*out, error.code)
                    if value is not _NO_VALUE:
                        return value
                    return error.code

        call.__name__ = function.__name__
        call.__doc__ = function.__doc__
        return call

    return wrap

"""Which NPUs this server may place instances on, as logical ids, and how a worker is shown its one NPU."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

from geserve import helper_process
from geserve.atc import host
from geserve.codecs import visible_devices

logger = logging.getLogger(__name__)

# /dev/davinciN are the physical chips mapped into this container; davinci_manager and friends are not chips.
_DEVICE_FILE = re.compile(r"^davinci(\d+)$")
VISIBLE_DEVICES = visible_devices.VARIABLE
# acl.init loads the driver; a healthy one answers in a few seconds, a wedged one never does.
PROBE_TIMEOUT_S = 30.0
# Run in a process of its own, so that this one (which forks and watches the workers) never initialises ACL.
# Device logs would otherwise hold acl.finalize up to 2 s (pyacl.md §1.1).
_PROBE = """
import json, os, sys
os.environ.setdefault("ASCEND_LOG_DEVICE_FLUSH_TIMEOUT", "0")
try:
    import acl
except Exception as error:
    print(json.dumps({"error": f"'import acl' failed: {type(error).__name__}: {error}"}))
    sys.exit(0)
ret = acl.init()
if ret not in (0, 100002):
    print(json.dumps({"error": f"acl.init failed with error {ret}: {acl.get_recent_err_msg()}"}))
    sys.exit(0)
count, ret = acl.rt.get_device_count()
answer = {"count": count} if ret == 0 else {"error": f"acl.rt.get_device_count failed with error {ret}"}
acl.finalize()
print(json.dumps(answer))
"""


class DeviceProbeError(Exception):
    """The runtime could not be asked how many devices it sees; the message says why."""


def parse_device_ids(text: str) -> tuple[int, ...]:
    """`--device-ids 0,1,3` (an empty string means none)."""
    ids = [int(item) for item in text.split(",") if item.strip()]
    if any(device < 0 for device in ids):
        raise ValueError(f"device ids must be non-negative, got '{text}'")
    return tuple(sorted(set(ids)))


def visible_entries(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """ASCEND_RT_VISIBLE_DEVICES as the runtime reads it (codecs.visible_devices), None when unset."""
    value = (os.environ if environ is None else environ).get(VISIBLE_DEVICES)
    return None if value is None else list(visible_devices.parse(value).kept)


def runtime_device_count(environ: Mapping[str, str] | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> int:
    """acl.rt.get_device_count() (the devices ASCEND_RT_VISIBLE_DEVICES leaves visible, pyacl.md §5), asked
    in a short-lived process of this interpreter, with this process's sys.path and environment as a worker
    gets them."""
    env = dict(os.environ if environ is None else environ)
    env["PYTHONPATH"] = os.pathsep.join([entry for entry in sys.path if entry] + [env.get("PYTHONPATH", "")])
    try:
        result = helper_process.run([sys.executable, "-c", _PROBE], timeout_s, env, "the NPU probe (acl.init)")
    except helper_process.ExpiredError:
        raise DeviceProbeError(f"the runtime did not answer within {timeout_s:g} s (a wedged driver?)") from None
    except OSError as error:
        raise DeviceProbeError(f"the probe process could not start: {error}") from None
    lines = result.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    if "count" in answer:
        return int(answer["count"])
    reason = answer.get("error") or f"the probe exited with {result.returncode}: {result.stderr.strip()[-500:]}"
    raise DeviceProbeError(str(reason))


def discover_devices(
    dev: Path = Path("/dev"),
    environ: Mapping[str, str] | None = None,
    probe_timeout_s: float = PROBE_TIMEOUT_S,
) -> tuple[int, ...]:
    """Logical NPU ids 0..n-1, as acl.rt.set_device takes them. n is what the runtime counts when pyACL is
    importable; else, or when asking it fails (with a warning saying why), the ids ASCEND_RT_VISIBLE_DEVICES
    keeps when it is set, else the /dev/davinciN chips (whatever their physical numbers)."""
    environ = os.environ if environ is None else environ
    # Not held against the /dev/davinciN files: a driver may show the runtime other devices than those files.
    entries = visible_entries(environ)
    _warn_dropped(environ)
    if host.has_pyacl():
        try:
            return tuple(range(runtime_device_count(environ, probe_timeout_s)))
        except DeviceProbeError as error:
            logger.warning(
                "could not count NPUs with pyACL (acl.rt.get_device_count): %s; counting %s instead",
                error,
                f"the ids of {VISIBLE_DEVICES}" if entries is not None else f"the davinci chips in {dev}",
            )
    if entries is not None:
        return tuple(range(len(entries)))
    try:
        chips = [entry.name for entry in dev.iterdir() if _DEVICE_FILE.match(entry.name)]
    except OSError:
        return ()
    return tuple(range(len(chips)))


def _warn_dropped(environ: Mapping[str, str]) -> None:
    value = environ.get(VISIBLE_DEVICES)
    if value is None:
        return
    parsed = visible_devices.parse(value)
    if parsed.refused:
        logger.warning(
            "%s=%r hides every NPU: the Ascend runtime refuses the whole list when %s, and then sees no device; "
            "list each id once, in ascending order (e.g. '0,1')",
            VISIBLE_DEVICES,
            value,
            parsed.refused,
        )
    elif parsed.dropped:
        logger.warning(
            "%s=%r: the Ascend runtime reads only the ids before %r (ids are ascending decimal numbers separated "
            "by commas, with no spaces or other characters), so the NPUs visible are %s",
            VISIBLE_DEVICES,
            value,
            parsed.dropped,
            list(parsed.kept) or "none",
        )


def worker_visible_devices(logical_id: int, environ: Mapping[str, str] | None = None) -> str:
    """The ASCEND_RT_VISIBLE_DEVICES a worker for `logical_id` gets, so that it sees that NPU alone
    (as its device 0). The variable takes ids of this process's view: a logical id, or the entry at
    that position when this process was itself restricted."""
    entries = visible_entries(environ)
    if entries is not None and logical_id < len(entries):
        return entries[logical_id]
    return str(logical_id)

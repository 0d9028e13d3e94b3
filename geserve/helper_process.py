"""Short-lived helper processes that never hold start-up longer than their time limit, even stuck in a driver."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# For a killed process to exit. One stuck in the driver (uninterruptible sleep, D state) ignores even SIGKILL
# until the driver lets go: it is left behind then, rather than waited for, which subprocess.run's timeout does.
REAP_S = 2.0
# Processes left behind: kept referenced, so that they are not reported (or waited for) as garbage.
_ABANDONED: list[subprocess.Popen[str]] = []


class ExpiredError(Exception):
    """The process did not finish within its time limit; it and its process group were killed."""


@dataclass(frozen=True, slots=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str


def run(argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None, what: str = "") -> Finished:
    """Run `argv` in a session of its own, capturing its output; raises ExpiredError after `timeout_s`, OSError when it
    cannot start."""
    process = subprocess.Popen(
        list(argv), env=None if env is None else dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # its own session: the group id is its pid
        try:
            process.wait(REAP_S)
        except subprocess.TimeoutExpired:
            _ABANDONED.append(process)
            logger.warning(
                "%s (pid %d) did not exit %gs after SIGKILL (stuck in the driver?); leaving it behind",
                what or argv[0], process.pid, REAP_S,
            )  # fmt: skip
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()
        raise ExpiredError from None
    return Finished(process.returncode, stdout, stderr)

"""Helper processes (the NPU and chip probes) are bounded by their time limit, whatever they started or however stuck."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from geserve import helper_process


def test_an_expired_process_and_the_processes_it_started_are_killed_promptly(tmp_path: Path) -> None:
    child = tmp_path / "child.pid"
    started = time.monotonic()
    # The grandchild keeps the output pipe open: killing the direct child alone, then reading to the end (what
    # subprocess.run's timeout does), would wait for it for 300 s.
    with pytest.raises(helper_process.ExpiredError):
        helper_process.run(["sh", "-c", f"sleep 300 & echo $! > {child}; wait"], 0.5)
    assert time.monotonic() - started < 5
    pid = int(child.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the grandchild outlived the time limit"
        time.sleep(0.05)


def test_a_process_that_does_not_die_is_left_behind_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Stands for a process in uninterruptible sleep in the driver, which SIGKILL does not end.
    monkeypatch.setattr(helper_process.os, "killpg", lambda pid, signum: None)
    monkeypatch.setattr(helper_process, "REAP_S", 0.2)
    started = time.monotonic()
    with pytest.raises(helper_process.ExpiredError):
        helper_process.run(["sleep", "30"], 0.3, what="the NPU probe")
    assert time.monotonic() - started < 5
    assert "the NPU probe (pid" in caplog.text and "leaving it behind" in caplog.text
    pid = int(caplog.text.split("(pid ")[1].split(")")[0])
    os.kill(pid, 9)


def test_a_finished_process_gives_its_status_and_output() -> None:
    done = helper_process.run(["sh", "-c", "echo out; echo err >&2; exit 3"], 10)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")

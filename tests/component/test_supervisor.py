"""ProcessSupervisor on its own: each process it starts gets a channel of its own, failed with the reason it died."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from geserve.errors import UnavailableError
from geserve.workers.client import InstanceState
from geserve.workers.messages import BlsCall, BlsReply, InstanceSpec, Loaded, LoadFailed
from geserve.workers.runs import RunId
from geserve.workers.shm import create_segment, unlink_quietly
from geserve.workers.streams import ResponseStream
from geserve.workers.supervisor import ProcessSupervisor, RestartPolicy
from tests.component import test_workers


def no_bls(call: BlsCall, reply: Callable[[BlsReply], None]) -> None:
    raise AssertionError(f"unexpected BLS call {call}")


@pytest.fixture
def output_arena() -> Iterator[str]:
    """The output arena a worker process leaves its batches' outputs in, made by its owner (a ProcessWorker does)."""
    name = RunId.current().segment_name("out")
    create_segment(name, 4096).close()
    yield name
    unlink_quietly(name)


def spec(tmp_path: Path, output_arena: str, backend: str = "identity") -> InstanceSpec:
    return replace(test_workers.spec(tmp_path, backend=backend), output_arena=output_arena)


async def until(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


async def test_a_restarted_process_gets_a_new_channel_and_the_old_ones_waiters_get_the_reason(
    tmp_path: Path, output_arena: str
) -> None:
    ups: list[int] = []
    given = spec(tmp_path, output_arena)
    supervisor = ProcessSupervisor(given, RestartPolicy(first_delay_s=0.05), no_bls, lambda: ups.append(1))
    assert isinstance(await supervisor.start(given), Loaded)
    assert (supervisor.state.value, supervisor.alive, supervisor.incarnation) == ("ready", True, 1)
    first, first_pid = supervisor.channel, supervisor.pid
    assert first is not None and first_pid is not None
    stream = ResponseStream()
    first.open_streams({0: stream})
    os.kill(first_pid, signal.SIGKILL)
    [(_, error, final)] = [item async for item in stream.responses()]
    assert final and isinstance(error, UnavailableError)
    assert error.message == "instance 'echo_0' of model 'echo' version 1 exited unexpectedly (exit code -9)"
    assert not first.open
    await until(lambda: supervisor.alive)
    assert ups == [1] and supervisor.incarnation == 2 and supervisor.reason == ""
    assert supervisor.channel is not first and supervisor.pid not in (None, first_pid)
    second = supervisor.channel
    assert second is not None and second.open
    await supervisor.stop(timeout_s=10)
    assert supervisor.state is InstanceState.STOPPED and not second.open and not supervisor.alive
    assert supervisor.exited_message() == "instance 'echo_0' of model 'echo' version 1 is stopped"


async def test_a_process_that_cannot_load_says_why(tmp_path: Path, output_arena: str) -> None:
    supervisor = ProcessSupervisor(spec(tmp_path, output_arena), RestartPolicy(), no_bls, lambda: None)
    result = await supervisor.start(spec(tmp_path, output_arena, backend="nonexistent"))
    assert isinstance(result, LoadFailed) and "unknown backend 'nonexistent'" in result.message
    assert supervisor.state is InstanceState.STARTING and not supervisor.alive
    await supervisor.stop(timeout_s=10)
    process = supervisor.process
    assert process is not None and process._closed  # type: ignore[attr-defined]

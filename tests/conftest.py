"""Shared fixtures: one geserve process serving the shipped model_repository for the e2e tests."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import MODEL_REPOSITORY, GeserveProcess, suite_segments

# The segments the suite's checks count: its own servers' and workers', not another live geserve's.
geserve_segments = suite_segments


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind() -> Iterator[None]:
    """Every shared-memory segment geserve creates during the run is gone at its end, crash tests included (another
    geserve running on the machine meanwhile does not count)."""
    before = geserve_segments()
    yield
    left = geserve_segments() - before
    assert not left, f"shared memory left behind: {sorted(left)}"


@pytest.fixture(autouse=True)
def collect_earlier_clients(request: pytest.FixtureRequest) -> None:
    """Clients earlier tests left to the cycle collector are collected now, on the main thread. Collected on a
    thread a test starts (its own, or a client library's), a tritonclient HTTP client's __del__ cannot get its
    gevent hub, and pytest reports that unraisable error against whichever test was running. The sockets those
    clients leave open are theirs to close, not the server's, so their ResourceWarning is not an error here: raised
    inside a finaliser it would fail whichever test happened to run the collection."""
    if {"e2e", "deploy"} & set(request.node.path.parts):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    """geserve serving model_repository/ exactly as `make run` does, on free ports."""
    log = tmp_path_factory.mktemp("server") / "geserve.log"
    process = GeserveProcess(log, f"--model-repository={MODEL_REPOSITORY}").wait_live()
    yield process
    status = process.stop()
    assert status == 0, f"geserve exited with {status} on SIGTERM:\n{process.log()}"


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    return folder


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., GeserveProcess]]:
    """Start `python -m geserve` with the given flags; every process is stopped at teardown."""
    started: list[GeserveProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, new_session: bool = False) -> GeserveProcess:
        process = GeserveProcess(tmp_path / f"geserve-{len(started)}.log", *args, env=env, new_session=new_session)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()

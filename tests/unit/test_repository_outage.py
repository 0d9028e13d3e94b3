"""A store that hangs or fails: requests' threads stay free, the index answers from its last listing, polls log once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.batching.sequence import SequenceInstances
from geserve.core.repository import ModelRepository
from geserve.errors import InternalError
from geserve.repository import remote
from geserve.repository.scan import ModelSource
from geserve.settings import ControlMode, RepositorySettings
from tests.fakes.object_store import StandInStore

URL = "s3://127.0.0.1:9000/bucket/repo"
MODELS = {"repo/a/config.pbtxt": b'name: "a"', "repo/b/config.pbtxt": b'name: "b"'}


class _NoWorkers:
    """Nothing loads in these tests: a load that got this far would be a fault."""

    segment_prefix = "unused"

    def complete(self, config: mc.ModelConfig, source: ModelSource, versions: list[int]) -> None:
        raise AssertionError(f"nothing loads here, not '{config.name}'")

    async def create(
        self, source: ModelSource, config: mc.ModelConfig, version: int
    ) -> tuple[SequenceInstances, mc.ModelConfig]:
        raise AssertionError(f"nothing loads here, not '{config.name}'")


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[StandInStore]:
    """The store every mirror's client talks to; hung calls are released at the end, so no thread outlives the test."""
    stand_in = StandInStore(MODELS)
    monkeypatch.setattr(remote, "_client", lambda location, credential: stand_in)
    monkeypatch.setenv(remote.MOUNT_DIRECTORY_VARIABLE, str(tmp_path))
    monkeypatch.delenv(remote.CREDENTIAL_PATH_VARIABLE, raising=False)
    yield stand_in
    stand_in.release.set()


def _repository(mode: ControlMode = ControlMode.EXPLICIT, poll_secs: float = 15.0) -> ModelRepository:
    """Explicit mode with no --load-model lists the store at startup and loads nothing."""
    return ModelRepository(RepositorySettings(remotes=(URL,), control_mode=mode, poll_secs=poll_secs), _NoWorkers())


def _names(index: list[dict[str, str]]) -> set[str]:
    return {entry["name"] for entry in index}


async def _eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.01)


async def test_a_hung_store_leaves_the_default_executor_free(store: StandInStore) -> None:
    loop = asyncio.get_running_loop()
    # A small host's default pool, which requests' work off the loop (BYTES validation, large copies) shares.
    loop.set_default_executor(ThreadPoolExecutor(4))
    repository = _repository()
    await repository.load_startup()
    store.hanging = True
    calls = [asyncio.ensure_future(repository.index()) for _ in range(8)]
    calls += [asyncio.ensure_future(repository.load("a")) for _ in range(8)]
    await _eventually(lambda: store.hung >= 1)
    assert await asyncio.wait_for(loop.run_in_executor(None, lambda: "served"), 2) == "served"
    # The repository's own threads are not all taken either: loads waiting for the store hold none.
    assert _names(await asyncio.wait_for(repository.index(), 2)) == {"a", "b"}
    assert store.hung == 1  # one sync in the store at a time
    store.release.set()
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
    assert all(isinstance(result, list) and _names(result) == {"a", "b"} for result in results[:8])
    assert all(isinstance(result, InternalError) for result in results[8:])
    assert "failed to load 'a', failed to read model repository" in str(results[8])
    # Every call to the store ran on the repository's own threads.
    assert store.threads and all(name.startswith("geserve-repository_") for name in store.threads), store.threads
    await repository.shutdown()


async def test_the_index_answers_from_the_last_listing_while_the_store_hangs(store: StandInStore) -> None:
    repository = _repository()
    await repository.load_startup()
    store.hanging = True
    for _ in range(5):
        assert _names(await asyncio.wait_for(repository.index(), 2)) == {"a", "b"}
    await _eventually(lambda: store.hung == 1)
    await asyncio.sleep(0.1)
    assert store.hung == 1  # one listing under way, not one per call
    store.release.set()
    await _eventually(lambda: repository._refresh is None)
    # The listing that failed left the last one in place.
    assert _names(await asyncio.wait_for(repository.index(), 2)) == {"a", "b"}
    store.hanging = False
    store.objects["repo/c/config.pbtxt"] = b'name: "c"'
    await _eventually(lambda: repository._refresh is None)
    await repository.index()  # answered from the last listing; lists the store for the next call
    await _eventually(lambda: repository._refresh is None)
    assert _names(await repository.index()) == {"a", "b", "c"}
    await repository.shutdown()


async def test_the_first_index_waits_for_a_listing_when_none_is_known(store: StandInStore) -> None:
    repository = _repository()
    store.failure = "Could not connect to the endpoint URL"
    with pytest.raises(remote.RemoteRepositoryError):
        await repository.load_startup()
    with pytest.raises(InternalError, match="Could not connect to the endpoint URL"):
        await repository.index()
    store.failure = None
    assert _names(await repository.index()) == {"a", "b"}
    await repository.shutdown()


def _lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == "geserve.core.repository"]


async def test_a_failing_poll_logs_once_per_error_and_once_on_recovery(
    store: StandInStore, caplog: pytest.LogCaptureFixture
) -> None:
    store.objects = {}  # no model: the polls load nothing
    repository = _repository(ControlMode.POLL, poll_secs=0.01)
    await repository.load_startup()
    caplog.set_level(logging.INFO, logger="geserve.core.repository")
    caplog.clear()  # the startup's own lines, kept where an earlier test left the logger at INFO
    store.failure = "Could not connect to the endpoint URL"
    repository.start_polling()
    await asyncio.sleep(0.3)  # about 30 polls, every one failing
    failures = [record for record in _lines(caplog) if "polling the model repository failed" in record.getMessage()]
    assert len(failures) == 1
    assert not failures[0].exc_info  # the error's message, not a traceback
    assert failures[0].getMessage() == (
        f"polling the model repository failed: failed to read model repository '{URL}': "
        "Could not connect to the endpoint URL"
    )
    store.failure = "An error occurred (AccessDenied) when calling the ListObjectsV2 operation: Access Denied"
    await asyncio.sleep(0.3)
    store.failure = None
    await asyncio.sleep(0.3)
    store.failure = "Could not connect to the endpoint URL"
    await asyncio.sleep(0.3)
    await repository.shutdown()
    messages = [record.getMessage() for record in _lines(caplog)]
    assert [message.split(": ", 2)[-1] if "failed" in message else message for message in messages] == [
        "Could not connect to the endpoint URL",
        "An error occurred (AccessDenied) when calling the ListObjectsV2 operation: Access Denied",
        "object storage reachable again",
        "Could not connect to the endpoint URL",
    ]

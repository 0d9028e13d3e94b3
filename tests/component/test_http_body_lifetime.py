"""What the HTTP front-end holds once it has answered: nothing of a request body it read in place."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest

from geserve.core.api import InferenceAPI
from geserve.http.connections import TransportHooks
from geserve.listeners import Listener, http_listener
from geserve.settings import HttpSettings, Restriction, Settings
from tests.support import binary_infer_request

# 1 MiB of FP32 data: far above the size from which bodies are read in place.
ELEMENTS = 1 << 18


class TrackedBodies:
    """Allocates bodies read in place as numpy arrays and remembers each weakly."""

    def __init__(self) -> None:
        self.bodies: list[weakref.ref[np.ndarray]] = []

    def __call__(self, size: int) -> memoryview:
        array = np.empty(size, dtype=np.uint8)
        self.bodies.append(weakref.ref(array))
        return array.data

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.bodies)


@pytest.fixture
def no_collector() -> Iterator[None]:
    """Reference counting alone must free a body: a cycle would wait for a collection that may come late."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(params=["open", "restricted"])
async def listening(
    service: InferenceAPI, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[Listener, TrackedBodies]]:
    """The HTTP listener, open or with inference restricted (answered 403 before the body is read)."""
    tracked = TrackedBodies()
    restrictions = {"inference": Restriction("x-key", "yes")} if request.param == "restricted" else {}
    settings = Settings(http=HttpSettings(address="127.0.0.1", port=0, restrictions=restrictions))
    listener = http_listener(service, settings, TransportHooks(allocate_body=tracked))
    listener.bind()
    assert await listener.start()
    yield listener, tracked
    await listener.stop()


def infer_request(data: np.ndarray) -> bytes:
    return b"".join(binary_infer_request(data.reshape(1, -1)))


async def response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(":", 1) for line in lines if line)
    length = int({name.lower(): value for name, value in headers.items()}["content-length"])
    return int(status_line.split()[1]), await reader.readexactly(length)


@pytest.mark.usefixtures("no_collector")
async def test_a_body_read_in_place_is_freed_once_answered(listening: tuple[Listener, TrackedBodies]) -> None:
    listener, tracked = listening
    assert listener.socket is not None
    port = listener.socket.getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = np.arange(ELEMENTS, dtype=np.float32)
    expected = 403 if listener.server.config.app._restrictions else 200
    for _ in range(3):
        writer.write(infer_request(data))
        status, _ = await response(reader)
        assert status == expected
    writer.write(infer_request(data) * 3)  # pipelined: one answered while the next is read
    for _ in range(3):
        status, _ = await response(reader)
        assert status == expected
    assert len(tracked.bodies) == 6
    # The connection stays open, idle: a keep-alive client must not pin what it sent.
    await asyncio.sleep(0.05)
    assert tracked.alive() == 0
    writer.close()
    await writer.wait_closed()

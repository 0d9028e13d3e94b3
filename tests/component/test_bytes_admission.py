"""BYTES inputs at admission: a bounded element count, and large ones split off the event loop."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from geserve.codecs import bytes as bytes_codec
from geserve.core import validation
from geserve.errors import InvalidArgumentError
from geserve.frontdoor.service import FrontDoor
from geserve.residency import SharedTensor
from geserve.settings import ServerSettings
from geserve.types import InferInput, InferRequest
from tests.component.conftest import in_process_server
from tests.support import write_identity_model

LIMIT = 50_000


@pytest.fixture
async def strings(tmp_path: Path) -> AsyncIterator[FrontDoor]:
    """`strings`: identity over BYTES [-1], with at most LIMIT elements per BYTES input."""
    write_identity_model(tmp_path, "strings", dtype="TYPE_STRING", dims="-1", max_batch_size=0)
    served = await in_process_server(tmp_path, ServerSettings(max_bytes_elements=LIMIT))
    yield served.door
    await served.shutdown()


def framed(count: int, element: bytes = b"x") -> InferRequest:
    data = bytes_codec.serialize(np.array([element] * count, dtype=object))
    return InferRequest("strings", "", (InferInput("INPUT0", "BYTES", (count,), memoryview(data)),))


async def test_more_elements_than_the_limit_are_refused_and_the_next_request_served(
    strings: FrontDoor,
) -> None:
    with pytest.raises(InvalidArgumentError) as error:
        await strings.infer(framed(LIMIT + 1))
    assert error.value.message == (
        f"inference input 'INPUT0' for model 'strings' has {LIMIT + 1} BYTES elements, more than the {LIMIT} "
        "allowed; see --max-bytes-tensor-elements"
    )
    response = await strings.infer(framed(LIMIT))
    assert len(response.outputs[0].data) == LIMIT


async def test_large_bytes_inputs_are_split_on_a_thread_small_ones_on_the_loop(
    strings: FrontDoor, monkeypatch: pytest.MonkeyPatch
) -> None:
    where: list[bool] = []
    validate = validation.validate_inputs

    def recording(*args: object, **kwargs: object) -> dict[str, SharedTensor]:
        where.append(threading.current_thread() is threading.main_thread())
        return validate(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(validation, "validate_inputs", recording)
    await strings.infer(framed(10))
    await strings.infer(framed(LIMIT, b"xxxx"))  # 400 KB of framing: tens of thousands of objects to make
    assert where == [True, False]

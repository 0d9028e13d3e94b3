"""sequence_batching.oldest.preserve_ordering through tritonclient: responses leave in request order."""

from __future__ import annotations

import queue
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.support import GeserveProcess

pytestmark = pytest.mark.e2e
MODEL = Path(__file__).resolve().parents[1] / "python_models" / "answers_backwards"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("ordering")
    repository = root / "models"
    for name, preserve in (("in_order", "true"), ("as_answered", "false")):
        shutil.copytree(MODEL, repository / name)
        config = repository / name / "config.pbtxt"
        text = config.read_text().replace('"answers_backwards"', f'"{name}"').replace("PRESERVE", preserve)
        config.write_text(text)
    process = GeserveProcess(root / "geserve.log", f"--model-repository={repository}").wait_live()
    yield process
    assert process.stop() == 0, process.log()


def _responses(server: GeserveProcess, model: str) -> list[tuple[str, int]]:
    """Two one-request sequences sent on one stream (one batch, the model answers the second first): the
    (request id, OUT) of each response in the order they arrived."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    answers: queue.Queue[tuple[grpcclient.InferResult | None, Exception | None]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    for sequence_id, value in ((11, 1), (12, 2)):
        tensor = grpcclient.InferInput("IN", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
        client.async_stream_infer(
            model,
            [tensor],
            request_id=f"r{value}",
            sequence_id=sequence_id,
            sequence_start=True,
            sequence_end=True,
        )
    arrived = []
    for _ in range(2):
        result, error = answers.get(timeout=120)
        assert error is None, error
        assert result is not None
        response = result.get_response()
        arrived.append((response.id, int(result.as_numpy("OUT")[0][0])))
    client.stop_stream()
    client.close()
    return arrived


def test_without_preserve_ordering_responses_come_as_the_model_sends_them(server: GeserveProcess) -> None:
    assert _responses(server, "as_answered") == [("r2", 2), ("r1", 1)]


def test_preserve_ordering_answers_in_request_order(server: GeserveProcess) -> None:
    assert _responses(server, "in_order") == [("r1", 1), ("r2", 2)]

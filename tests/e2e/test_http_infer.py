"""Inference over HTTP with the stock tritonclient (sync and asyncio), binary and JSON tensors."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient

from tests.support import MODEL_REPOSITORY, GeserveProcess

pytestmark = pytest.mark.e2e


def simple_inputs(
    left: np.ndarray, right: np.ndarray, binary: bool = True, module: object = httpclient
) -> list[httpclient.InferInput]:
    inputs = []
    for name, array in (("INPUT0", left), ("INPUT1", right)):
        tensor = httpclient.InferInput(name, list(array.shape), "INT32")
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    return inputs


@pytest.fixture
def client(server: GeserveProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url)


@pytest.mark.parametrize("binary_in", [True, False], ids=["binary-in", "json-in"])
@pytest.mark.parametrize("binary_out", [True, False], ids=["binary-out", "json-out"])
def test_simple_sums_and_differences(
    client: httpclient.InferenceServerClient, binary_in: bool, binary_out: bool
) -> None:
    left = np.arange(32, dtype=np.int32).reshape(2, 16)
    right = np.full((2, 16), 7, dtype=np.int32)
    outputs = [httpclient.InferRequestedOutput(name, binary_data=binary_out) for name in ("OUTPUT0", "OUTPUT1")]
    result = client.infer("simple", simple_inputs(left, right, binary_in), outputs=outputs, request_id="r-1")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), left + right)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), left - right)
    response = result.get_response()
    assert response["id"] == "r-1"
    assert response["model_name"] == "simple"
    assert response["model_version"] == "1"
    for output in response["outputs"]:
        assert output["shape"] == [2, 16]
        assert output["datatype"] == "INT32"
        # An output carries `parameters` only when binary (perf_analyzer breaks on an empty one).
        assert ("parameters" in output) == binary_out
        assert ("data" in output) == (not binary_out)


def test_outputs_default_to_binary_when_none_requested(client: httpclient.InferenceServerClient) -> None:
    left = np.arange(16, dtype=np.int32).reshape(1, 16)
    result = client.infer("simple", simple_inputs(left, left))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), left * 2)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros_like(left))
    assert all(o["parameters"]["binary_data_size"] == 64 for o in result.get_response()["outputs"])


def test_only_requested_outputs_in_order(client: httpclient.InferenceServerClient) -> None:
    left = np.arange(16, dtype=np.int32).reshape(1, 16)
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT1"),
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=False),
    ]
    result = client.infer("simple", simple_inputs(left, left + 1), outputs=outputs)
    assert [o["name"] for o in result.get_response()["outputs"]] == ["OUTPUT1", "OUTPUT0"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.full((1, 16), -1, dtype=np.int32))


def test_explicit_version(client: httpclient.InferenceServerClient) -> None:
    left = np.ones((1, 16), dtype=np.int32)
    result = client.infer("simple", simple_inputs(left, left), model_version="1")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), left * 2)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_simple_string(client: httpclient.InferenceServerClient, binary: bool) -> None:
    numbers = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = []
    for name, array in (("INPUT0", numbers), ("INPUT1", np.full_like(numbers, 3))):
        tensor = httpclient.InferInput(name, [1, 16], "BYTES")
        tensor.set_data_from_numpy(np.array([[str(x).encode() for x in row] for row in array], dtype=object), binary)
        inputs.append(tensor)
    outputs = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in ("OUTPUT0", "OUTPUT1")]
    result = client.infer("simple_string", inputs, outputs=outputs)
    sums = result.as_numpy("OUTPUT0")
    differences = result.as_numpy("OUTPUT1")
    assert sums.shape == (1, 16)
    assert [int(x) for x in sums.reshape(-1)] == [x + 3 for x in range(16)]
    assert [int(x) for x in differences.reshape(-1)] == [x - 3 for x in range(16)]


def test_digits_classifies_real_digits(client: httpclient.InferenceServerClient) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.data.astype(np.float32)
    correct = 0
    for start in range(0, len(images), 32):
        batch = images[start : start + 32]
        tensor = httpclient.InferInput("pixels", list(batch.shape), "FP32")
        tensor.set_data_from_numpy(batch)
        probabilities = client.infer("digits", [tensor]).as_numpy("probabilities")
        assert probabilities.shape == (len(batch), 10)
        np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-4)
        correct += int((probabilities.argmax(axis=1) == digits.target[start : start + 32]).sum())
    # Held-out accuracy is ~0.97; over the whole set (mostly training data) it is higher.
    assert correct / len(images) > 0.95


def test_digits_sample_from_readme(client: httpclient.InferenceServerClient) -> None:
    sample = np.load(MODEL_REPOSITORY / "digits" / "sample_digit.npy")
    label = int((MODEL_REPOSITORY / "digits" / "sample_label.txt").read_text())
    tensor = httpclient.InferInput("pixels", list(sample.shape), "FP32")
    tensor.set_data_from_numpy(sample, binary_data=False)
    result = client.infer("digits", [tensor])
    assert int(result.as_numpy("probabilities").argmax()) == label


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_request_and_response(client: httpclient.InferenceServerClient, algorithm: str) -> None:
    left = np.arange(64, dtype=np.int32).reshape(4, 16)
    result = client.infer(
        "simple",
        simple_inputs(left, left),
        request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), left * 2)


async def test_asyncio_client_concurrent_requests_get_their_own_answers(server: GeserveProcess) -> None:
    async with aiohttpclient.InferenceServerClient(server.url) as client:
        assert await client.is_server_ready()
        assert (await client.get_model_metadata("simple"))["name"] == "simple"
        assert (await client.get_model_config("simple"))["max_batch_size"] == 8

        async def one(index: int) -> None:
            batch = 1 + index % 8
            left = np.arange(batch * 16, dtype=np.int32).reshape(batch, 16) + index * 1000
            right = np.full((batch, 16), index, dtype=np.int32)
            inputs = []
            for name, array in (("INPUT0", left), ("INPUT1", right)):
                tensor = aiohttpclient.InferInput(name, list(array.shape), "INT32")
                tensor.set_data_from_numpy(array, binary_data=index % 2 == 0)
                inputs.append(tensor)
            result = await client.infer("simple", inputs, request_id=str(index))
            assert result.get_response()["id"] == str(index)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), left + right)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), left - right)

        await asyncio.gather(*(one(index) for index in range(64)))

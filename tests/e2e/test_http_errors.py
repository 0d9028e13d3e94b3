"""Every bad request gets Triton's status and message, and the next good request still succeeds."""

from __future__ import annotations

import gzip
import http.client
import struct
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess

pytestmark = pytest.mark.e2e

GOOD_LEFT = np.arange(16, dtype=np.int32).reshape(1, 16)


@pytest.fixture
def client(server: GeserveProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url)


def assert_still_serving(client: httpclient.InferenceServerClient) -> None:
    inputs = [make_input(n, GOOD_LEFT, "INT32") for n in ("INPUT0", "INPUT1")]
    result = client.infer("simple", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), GOOD_LEFT * 2)


def post(server: GeserveProcess, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        connection.request("POST", path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
        content_type = response.getheader("Content-Type", "")
        return response.status, orjson.loads(data) if content_type.startswith("application/json") else data
    finally:
        connection.close()


def json_input(name: str, datatype: str, shape: list[int], data: Any) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


def good_json_inputs() -> list[dict[str, Any]]:
    return [json_input(n, "INT32", [1, 16], list(range(16))) for n in ("INPUT0", "INPUT1")]


def infer_error(
    client: httpclient.InferenceServerClient, model: str, inputs: list[Any], **kwargs: Any
) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as error:
        client.infer(model, inputs, **kwargs)
    return error.value


def make_input(name: str, array: np.ndarray, datatype: str, binary: bool = True) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def test_unknown_model(client: httpclient.InferenceServerClient) -> None:
    error = infer_error(client, "missing_model", [make_input("INPUT0", GOOD_LEFT, "INT32")])
    assert (error.status(), error.message()) == ("400", "Request for unknown model: 'missing_model' is not found")
    assert_still_serving(client)


def test_unknown_version(client: httpclient.InferenceServerClient) -> None:
    inputs = [make_input(n, GOOD_LEFT, "INT32") for n in ("INPUT0", "INPUT1")]
    error = infer_error(client, "simple", inputs, model_version="3")
    assert error.status() == "404"
    assert error.message() == "Request for unknown model: 'simple' version 3 is not found"
    assert_still_serving(client)


def test_missing_input_with_request_id_prefix(client: httpclient.InferenceServerClient) -> None:
    error = infer_error(client, "simple", [make_input("INPUT0", GOOD_LEFT, "INT32")], request_id="req-7")
    assert error.status() == "400"
    assert error.message() == (
        "[request id: req-7] expected 2 inputs but got 1 inputs for model 'simple'. Got input(s) ['INPUT0'], "
        "but missing required input(s) ['INPUT1']. Please provide all required input(s)."
    )
    assert_still_serving(client)


def test_unexpected_input(client: httpclient.InferenceServerClient) -> None:
    inputs = [make_input(n, GOOD_LEFT, "INT32") for n in ("INPUT0", "INPUT1", "INPUT9")]
    error = infer_error(client, "simple", inputs)
    assert error.message() == "unexpected inference input 'INPUT9' for model 'simple'"
    assert_still_serving(client)


def test_wrong_datatype(client: httpclient.InferenceServerClient) -> None:
    inputs = [make_input("INPUT0", GOOD_LEFT.astype(np.float32), "FP32"), make_input("INPUT1", GOOD_LEFT, "INT32")]
    error = infer_error(client, "simple", inputs)
    assert error.message() == "inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'"
    assert_still_serving(client)


def test_wrong_shape(client: httpclient.InferenceServerClient) -> None:
    small = np.zeros((1, 3), dtype=np.int32)
    error = infer_error(client, "simple", [make_input("INPUT0", small, "INT32"), make_input("INPUT1", small, "INT32")])
    assert error.message() == "unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got [1,3]"
    assert_still_serving(client)


def test_batch_larger_than_max_batch_size(client: httpclient.InferenceServerClient) -> None:
    big = np.zeros((9, 16), dtype=np.int32)
    error = infer_error(client, "simple", [make_input("INPUT0", big, "INT32"), make_input("INPUT1", big, "INT32")])
    assert error.message() == "inference request batch-size must be <= 8 for 'simple'"
    assert_still_serving(client)


def test_batch_sizes_differ_between_inputs(client: httpclient.InferenceServerClient) -> None:
    inputs = [make_input("INPUT0", np.zeros((2, 16), np.int32), "INT32"), make_input("INPUT1", GOOD_LEFT, "INT32")]
    error = infer_error(client, "simple", inputs)
    assert error.message() == "input 'INPUT1' batch size does not match other inputs for 'simple'"
    assert_still_serving(client)


def test_duplicate_and_unknown_requested_outputs(client: httpclient.InferenceServerClient) -> None:
    inputs = [make_input(n, GOOD_LEFT, "INT32") for n in ("INPUT0", "INPUT1")]
    outputs = [httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("OUTPUT0")]
    assert (
        infer_error(client, "simple", inputs, outputs=outputs).message() == "output 'OUTPUT0' already exists in request"
    )
    assert_still_serving(client)
    outputs = [httpclient.InferRequestedOutput("OUTPUT7")]
    assert infer_error(client, "simple", inputs, outputs=outputs).message() == (
        "unexpected inference output 'OUTPUT7' for model 'simple'"
    )
    assert_still_serving(client)


def test_byte_size_mismatch(server: GeserveProcess, client: httpclient.InferenceServerClient) -> None:
    header = {
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "parameters": {"binary_data_size": 60}},
            {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "parameters": {"binary_data_size": 64}},
        ]
    }
    json_header = orjson.dumps(header)
    body = json_header + bytes(60) + bytes(64)
    status, answer = post(
        server, "/v2/models/simple/infer", body, {"Inference-Header-Content-Length": str(len(json_header))}
    )
    assert status == 400
    assert answer["error"] == "input byte size mismatch for input 'INPUT0' for model 'simple'. Expected 64, got 60"
    assert_still_serving(client)


def test_binary_sizes_beyond_the_body(server: GeserveProcess, client: httpclient.InferenceServerClient) -> None:
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "parameters": {"binary_data_size": 1 << 40}}
            ]
        }
    )
    status, answer = post(
        server, "/v2/models/simple/infer", header + bytes(8), {"Inference-Header-Content-Length": str(len(header))}
    )
    assert status == 400 and "unexpected end of binary data for input 'INPUT0'" in answer["error"]
    assert_still_serving(client)


@pytest.mark.parametrize("header_length", ["100000", "-1", "abc", "\u00b2", "\u00b9\u00b2"])
def test_bad_inference_header_length(
    server: GeserveProcess, client: httpclient.InferenceServerClient, header_length: str
) -> None:
    body = orjson.dumps({"inputs": good_json_inputs()})
    status, answer = post(server, "/v2/models/simple/infer", body, {"Inference-Header-Content-Length": header_length})
    assert status == 400 and "inference header size" in answer["error"]
    assert_still_serving(client)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "failed to parse the request JSON buffer"),
        (b"", "failed to parse the request JSON buffer"),
        (b"[1, 2]", "the inference request JSON must be an object"),
        (b'{"inputs": {}}', "the inference request must hold an 'inputs' array"),
        (b'{"id": 5, "inputs": []}', "'id' of the inference request must be a string"),
        (b'{"inputs": [{"name": "INPUT0"}]}', "input 'INPUT0' must have a string 'datatype'"),
        (
            b'{"inputs": [{"name": "INPUT0", "datatype": "INT33", "shape": [1], "data": [1]}]}',
            "invalid datatype 'INT33'",
        ),
        (
            b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [-1], "data": [1]}]}',
            "must not hold negative",
        ),
        (b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16]}]}', "exactly one of 'data'"),
        (b'{"inputs": [' + b"[" * 5000 + b"]" * 5000 + b"]}", "failed to parse the request JSON buffer"),
        # Lone surrogate escapes in names, ids and strings: no response could encode them.
        (b'{"id": "\\ud800", "inputs": []}', "no low surrogate in string"),
        (b'{"inputs": [{"name": "\\udfff", "datatype": "INT32", "shape": [1], "data": [1]}]}', "surrogate"),
        (b'{"inputs": [], "outputs": [{"name": "OUTPUT0\\ud800"}]}', "no low surrogate in string"),
        (b'{"inputs": [], "parameters": {"k": "\\ud800"}, "x": NaN}', "no low surrogate in string"),
    ],
)
def test_malformed_request_json(
    server: GeserveProcess, client: httpclient.InferenceServerClient, body: bytes, message: str
) -> None:
    status, answer = post(server, "/v2/models/simple/infer", body)
    assert status == 400
    assert message in answer["error"]
    assert_still_serving(client)


@pytest.mark.parametrize(
    ("datatype", "data", "message"),
    [
        ("INT32", list(range(15)), "Shape does not match true shape of 'data' field"),
        ("INT32", ["a"] * 16, "expected INT32 values"),
        ("INT32", [2**40] * 16, "value out of range for INT32"),
        ("INT32", [[1, 2], [3]], "unable to parse 'data' of input 'INPUT0'"),
        ("INT32", [True] * 16, "expected INT32 values, got 'b' elements"),
        ("INT32", [1] * 15 + [False], "expected INT32 values, got 'b' elements"),
        ("FP32", [0.5] * 15 + [True], "expected FP32 values, got 'b' elements"),
    ],
)
def test_bad_json_tensor_data(
    server: GeserveProcess, client: httpclient.InferenceServerClient, datatype: str, data: Any, message: str
) -> None:
    inputs = [json_input("INPUT0", datatype, [1, 16], data), good_json_inputs()[1]]
    status, answer = post(server, "/v2/models/simple/infer", orjson.dumps({"inputs": inputs}))
    assert status == 400
    assert message in answer["error"]
    assert_still_serving(client)


def test_fp16_is_refused_in_json(server: GeserveProcess, client: httpclient.InferenceServerClient) -> None:
    body = orjson.dumps({"inputs": [json_input("pixels", "FP16", [1, 64], [0.0] * 64)]})
    status, answer = post(server, "/v2/models/digits/infer", body)
    assert status == 400
    assert answer["error"].startswith("receiving FP16 data via JSON is not supported")
    assert_still_serving(client)


def test_reserved_and_typed_parameters(server: GeserveProcess, client: httpclient.InferenceServerClient) -> None:
    body = orjson.dumps({"parameters": {"triton_x": 1}, "inputs": good_json_inputs()})
    status, answer = post(server, "/v2/models/simple/infer", body)
    assert status == 400 and answer["error"].startswith("parameter keys starting with 'triton_' are reserved")
    body = orjson.dumps({"parameters": {"priority": "high"}, "inputs": good_json_inputs()})
    status, answer = post(server, "/v2/models/simple/infer", body)
    assert status == 400 and "'priority'" in answer["error"]
    # Custom parameters are accepted and passed on.
    body = orjson.dumps({"parameters": {"my_key": "v", "priority": 1, "timeout": 5000}, "inputs": good_json_inputs()})
    status, answer = post(server, "/v2/models/simple/infer", body)
    assert status == 200 and answer["outputs"][0]["data"] == [2 * x for x in range(16)]
    assert_still_serving(client)


def post_binary_strings(server: GeserveProcess, blob: bytes) -> tuple[int, Any]:
    """A simple_string request whose INPUT0 ([1, 16] BYTES) is `blob`, sent as binary data; INPUT1 is good JSON."""
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "datatype": "BYTES",
                    "shape": [1, 16],
                    "parameters": {"binary_data_size": len(blob)},
                },
                json_input("INPUT1", "BYTES", [1, 16], ["1"] * 16),
            ]
        }
    )
    return post(
        server, "/v2/models/simple_string/infer", header + blob, {"Inference-Header-Content-Length": str(len(header))}
    )


def test_malformed_bytes_framing(server: GeserveProcess, client: httpclient.InferenceServerClient) -> None:
    status, answer = post_binary_strings(server, struct.pack("<I", 100) + b"12")
    assert status == 400 and "BYTES tensor data is truncated" in answer["error"]
    one_element = struct.pack("<I", 1) + b"5"
    status, answer = post_binary_strings(server, one_element)
    assert status == 400
    assert (
        answer["error"] == "expected 16 string elements for inference input 'INPUT0' for model 'simple_string', got 1"
    )
    assert_still_serving(client)


def test_model_that_cannot_parse_its_strings_fails_only_that_request(
    server: GeserveProcess, client: httpclient.InferenceServerClient
) -> None:
    inputs = [json_input(n, "BYTES", [1, 16], ["not a number"] * 16) for n in ("INPUT0", "INPUT1")]
    status, answer = post(server, "/v2/models/simple_string/infer", orjson.dumps({"inputs": inputs}))
    assert status == 500
    assert "model 'simple_string' failed to execute" in answer["error"]
    assert_still_serving(client)


def test_bad_compression(server: GeserveProcess, client: httpclient.InferenceServerClient) -> None:
    body = orjson.dumps({"inputs": good_json_inputs()})
    status, answer = post(server, "/v2/models/simple/infer", b"garbage", {"Content-Encoding": "gzip"})
    assert status == 400 and "failed to decompress the gzip request body" in answer["error"]
    status, answer = post(server, "/v2/models/simple/infer", body, {"Content-Encoding": "br"})
    assert status == 400 and "unsupported Content-Encoding 'br'" in answer["error"]
    status, answer = post(server, "/v2/models/simple/infer", gzip.compress(body), {"Content-Encoding": "gzip"})
    assert status == 200 and answer["outputs"][1]["data"] == [0] * 16
    assert_still_serving(client)


def test_raw_binary_request(server: GeserveProcess, client: httpclient.InferenceServerClient) -> None:
    sample = np.arange(64, dtype=np.float32)
    status, answer = post(server, "/v2/models/digits/infer", sample.tobytes(), {"Inference-Header-Content-Length": "0"})
    assert status == 200
    header_length = len(answer) - 40
    header = orjson.loads(answer[:header_length])
    assert header["outputs"] == [
        {"name": "probabilities", "datatype": "FP32", "shape": [1, 10], "parameters": {"binary_data_size": 40}}
    ]
    assert np.frombuffer(answer[header_length:], dtype=np.float32).sum() == pytest.approx(1.0, rel=1e-4)
    status, answer = post(server, "/v2/models/simple/infer", bytes(64), {"Inference-Header-Content-Length": "0"})
    assert status == 400
    assert answer["error"] == (
        "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'simple' model configuration"
    )
    assert_still_serving(client)


def test_nan_and_infinity_survive_json(client: httpclient.InferenceServerClient) -> None:
    pixels = np.zeros((1, 64), dtype=np.float32)
    pixels[0, 0] = np.nan
    tensor = make_input("pixels", pixels, "FP32", binary=False)
    result = client.infer(
        "digits", [tensor], outputs=[httpclient.InferRequestedOutput("probabilities", binary_data=False)]
    )
    assert np.isnan(result.as_numpy("probabilities")).all()
    assert_still_serving(client)


def test_bytes_element_with_a_lone_surrogate(server: GeserveProcess, client: httpclient.InferenceServerClient) -> None:
    strings = b'["\\ud800"' + b', "1"' * 15 + b"]"
    ones = b'["1"' + b', "1"' * 15 + b"]"
    body = (
        b'{"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 16], "data": ' + strings + b"}, "
        b'{"name": "INPUT1", "datatype": "BYTES", "shape": [1, 16], "data": ' + ones + b"}]}"
    )
    status, answer = post(server, "/v2/models/simple_string/infer", body)
    assert status == 400 and "no low surrogate in string" in answer["error"], answer
    assert_still_serving(client)


@pytest.mark.parametrize("version", ["%C2%B2", "%D9%A3", "1%C2%B2"])
def test_non_ascii_digits_are_not_a_version(
    server: GeserveProcess, client: httpclient.InferenceServerClient, version: str
) -> None:
    status, _ = post(
        server, f"/v2/models/simple/versions/{version}/infer", orjson.dumps({"inputs": good_json_inputs()})
    )
    assert status in (400, 404)
    assert_still_serving(client)

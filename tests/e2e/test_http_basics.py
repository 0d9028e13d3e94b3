"""Health, metadata and config over HTTP with the stock tritonclient, against a real geserve."""

from __future__ import annotations

import orjson
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, http_status

pytestmark = pytest.mark.e2e


@pytest.fixture
def client(server: GeserveProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url)


def test_health(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    for model in ("simple", "simple_string", "digits"):
        assert client.is_model_ready(model)
        assert client.is_model_ready(model, "1")
    assert not client.is_model_ready("simple", "2")


def test_server_metadata(client: httpclient.InferenceServerClient) -> None:
    metadata = client.get_server_metadata()
    assert metadata["name"] == "triton"
    assert metadata["version"]
    assert metadata["extensions"] == [
        "classification",
        "model_repository",
        "model_repository(unload_dependents)",
        "schedule_policy",
        "sequence",
        "model_configuration",
        "system_shared_memory",
        "binary_tensor_data",
        "parameters",
        "statistics",
        "trace",
        "logging",
        "generate",
    ]


def test_model_metadata_has_batch_dimension(client: httpclient.InferenceServerClient) -> None:
    tensor = {"datatype": "INT32", "shape": [-1, 16]}
    assert client.get_model_metadata("simple") == {
        "name": "simple",
        "versions": ["1"],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": "INPUT0", **tensor}, {"name": "INPUT1", **tensor}],
        "outputs": [{"name": "OUTPUT0", **tensor}, {"name": "OUTPUT1", **tensor}],
    }
    assert client.get_model_metadata("simple", "1")["versions"] == ["1"]
    digits = client.get_model_metadata("digits")
    assert digits["platform"] == "onnxruntime"
    assert digits["inputs"] == [{"name": "pixels", "datatype": "FP32", "shape": [-1, 64]}]
    assert digits["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]}]


def test_model_config_is_tritons_json(client: httpclient.InferenceServerClient) -> None:
    config = client.get_model_config("simple")
    tensor = {"data_type": "TYPE_INT32", "dims": [16], "is_shape_tensor": False, "is_non_linear_format_io": False}
    expected_input = {**tensor, "format": "FORMAT_NONE", "allow_ragged_batch": False, "optional": False}
    assert config["name"] == "simple"
    assert config["platform"] == "onnxruntime_onnx"
    assert config["backend"] == "onnxruntime"
    assert config["max_batch_size"] == 8
    assert config["version_policy"] == {"latest": {"num_versions": 1}}
    assert config["input"] == [{"name": "INPUT0", **expected_input}, {"name": "INPUT1", **expected_input}]
    assert config["output"] == [{"name": name, **tensor, "label_filename": ""} for name in ("OUTPUT0", "OUTPUT1")]
    assert config["instance_group"] == [
        {
            "name": "simple",
            "kind": "KIND_CPU",
            "count": 1,
            "gpus": [],
            "secondary_devices": [],
            "profile": [],
            "passive": False,
            "host_policy": "",
        }
    ]
    assert config["default_model_filename"] == "model.onnx"
    assert config["model_transaction_policy"] == {"decoupled": False}
    assert config["parameters"] == {}
    # No scheduler configured: perf_analyzer reads the key's presence as the scheduler type.
    assert "dynamic_batching" not in config and "sequence_batching" not in config
    assert client.get_model_config("simple", "1") == config


def test_model_config_completed_from_onnx_graph(client: httpclient.InferenceServerClient) -> None:
    config = client.get_model_config("digits")
    assert config["max_batch_size"] == 32
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [("pixels", "TYPE_FP32", [64])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [("probabilities", "TYPE_FP32", [10])]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 0


def test_unknown_model_and_version(client: httpclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as error:
        client.get_model_metadata("no_such_model")
    assert error.value.status() == "400"
    assert error.value.message() == "Request for unknown model: 'no_such_model' is not found"
    with pytest.raises(InferenceServerException) as error:
        client.get_model_config("simple", "7")
    assert error.value.status() == "404"
    assert error.value.message().startswith("Request for unknown model: 'simple' version 7")
    # The HTTP client reads readiness from the status code alone.
    assert not client.is_model_ready("no_such_model")
    assert client.is_model_ready("simple")


def _get(url: str) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read()


def test_routing_texts_as_triton(server: GeserveProcess) -> None:
    base = f"http://{server.url}"
    assert _get(f"{base}/v2/nothing/here") == (404, b'{"error":"Not Found"}')
    assert _get(f"{base}/v2/models/simple/versions/latest") == (404, b'{"error":"Not Found"}')
    status, body = _get(f"{base}/v2/models/simple/infer")
    assert (status, orjson.loads(body)) == (405, {"error": "Method Not Allowed"})
    status, body = _get(f"{base}/v2/models/simple/ready")
    assert (status, body) == (200, b"")
    # Unknown query strings are ignored.
    assert http_status(f"{base}/v2/models/simple?verbose=true&x=1") == 200
    assert _get(f"{base}/v2/models/simple/versions/3/ready") == (400, b'{"error":"Model version not ready"}')

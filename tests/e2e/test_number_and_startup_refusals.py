"""Numbers past what int() reads, an out-of-range log verbosity, and an ensemble named at startup: each a clear
answer (400 / INVALID_ARGUMENT, or a loaded ensemble), and the server serves the next request."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import MODEL_REPOSITORY, GeserveProcess, copy_model, write_identity_model

pytestmark = pytest.mark.e2e

DIGITS = "9" * 5000  # past Python's int() limit of 4300 digits


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("numbers")
    write_identity_model(root / "models", "echo")
    process = GeserveProcess(root / "geserve.log", f"--model-repository={root / 'models'}").wait_live()
    yield process
    assert process.stop() == 0, process.log()
    assert "Traceback" not in process.log()


def _post(server: GeserveProcess, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def _echo_served(server: GeserveProcess) -> None:
    client = httpclient.InferenceServerClient(server.url)
    try:
        tensor = httpclient.InferInput("INPUT0", [1, 2], "FP32")
        tensor.set_data_from_numpy(np.array([[1.5, -2.0]], dtype=np.float32))
        assert client.infer("echo", [tensor]).as_numpy("OUTPUT0").tolist() == [[1.5, -2.0]]
    finally:
        client.close()


def test_a_5000_digit_inference_header_length_is_a_400(server: GeserveProcess) -> None:
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}).encode()
    status, text = _post(server, "/v2/models/echo/infer", body, {"Inference-Header-Content-Length": DIGITS})
    assert status == 400, text
    assert "inference header size should be in range" in text and len(text) < 500
    _echo_served(server)


def test_a_5000_digit_version_is_a_400(server: GeserveProcess) -> None:
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}).encode()
    status, text = _post(server, f"/v2/models/echo/versions/{DIGITS}/infer", body, {})
    assert status == 400, text
    assert "failed to parse model version" in text and len(text) < 500
    _echo_served(server)


@pytest.mark.parametrize("level", [2**32, 2**40, int(DIGITS[:30])])
def test_an_out_of_range_log_verbose_level_is_refused_and_grpc_log_settings_still_answer(
    server: GeserveProcess, level: int
) -> None:
    http_client = httpclient.InferenceServerClient(server.url)
    grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        before = http_client.get_log_settings()
        with pytest.raises(InferenceServerException, match=r"log_verbose_level' \(at most 4294967295\)") as raised:
            http_client.update_log_settings({"log_verbose_level": level})
        assert raised.value.status() == "400"
        assert http_client.get_log_settings() == before  # nothing changed
        settings = grpc_client.get_log_settings(as_json=True)["settings"]
        assert int(settings["log_verbose_level"]["uint32_param"]) == before["log_verbose_level"]
        updated = grpc_client.update_log_settings({"log_verbose_level": 0}, as_json=True)["settings"]
        assert int(updated["log_verbose_level"].get("uint32_param", 0)) == 0
    finally:
        http_client.close()
        grpc_client.close()
    _echo_served(server)


def test_a_5000_digit_log_verbose_level_in_json_is_a_400(server: GeserveProcess) -> None:
    body = f'{{"log_verbose_level": {DIGITS}}}'.encode()
    status, text = _post(server, "/v2/logging", body, {"Content-Type": "application/json"})
    assert status == 400, text
    _echo_served(server)


def test_load_model_of_an_ensemble_at_startup_loads_its_steps(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    for name in ("digits", "digits_preprocess", "digits_postprocess", "digits_ensemble"):
        copy_model(name, repository)
    copy_model("simple", repository)  # not named: stays unloaded
    server = GeserveProcess(
        tmp_path / "geserve.log",
        f"--model-repository={repository}",
        "--model-control-mode=explicit",
        "--load-model=digits_ensemble",
    ).wait_live()
    try:
        client = httpclient.InferenceServerClient(server.url)
        for name in ("digits", "digits_preprocess", "digits_postprocess", "digits_ensemble"):
            assert client.is_model_ready(name), name
        assert not client.is_model_ready("simple")
        pixels = np.load(MODEL_REPOSITORY / "digits" / "sample_digit.npy")
        image = np.round(pixels.reshape(1, 8, 8) * 255 / 16).astype(np.uint8)
        tensor = httpclient.InferInput("IMAGE", [1, 8, 8], "UINT8")
        tensor.set_data_from_numpy(image)
        expected = (MODEL_REPOSITORY / "digits" / "sample_label.txt").read_text().strip().encode()
        assert client.infer("digits_ensemble", [tensor]).as_numpy("LABEL")[0, 0] == expected
        client.close()
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.parametrize("declared", ["1" + "0" * 19, DIGITS])
@pytest.mark.parametrize("path", ["/v2/repository/models/echo/load", "/v2/models/echo/infer"])
def test_a_content_length_past_any_limit_is_refused_before_the_body(
    server: GeserveProcess, declared: str, path: str
) -> None:
    # The body never comes: the answer must not wait for it (nor for the body timeout).
    try:
        status, text = _post(server, path, b"{}", {"Content-Length": declared})
    except (ConnectionError, http.client.HTTPException):  # the HTTP parser refused the header and closed
        status, text = 400, ""
    assert status == 400, text
    assert len(text) < 500
    _echo_served(server)

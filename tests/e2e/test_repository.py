"""Repository loading in a real process: failures, exit-on-error, readiness, auto-complete, versions, limits."""

from __future__ import annotations

import gzip
import http.client
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import MODEL_REPOSITORY, GeserveProcess, copy_model, http_status, write_identity_model

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]


Launch = Callable[..., GeserveProcess]


def test_bad_config_fails_startup_naming_file_and_line(launch: Launch, repository: Path) -> None:
    copy_model("simple", repository)
    broken = write_identity_model(repository, "broken")
    (broken / "config.pbtxt").write_text('name: "broken"\nbackend: "identity"\nmax_batch_size: [oops\n')
    server = launch(f"--model-repository={repository}")
    assert server.wait_exit() != 0
    log = server.log()
    assert f"failed to load 'broken': failed to parse {broken / 'config.pbtxt'} at line 3" in log
    server.stop()


def test_exit_on_error_false_serves_the_rest(launch: Launch, repository: Path) -> None:
    copy_model("simple", repository)
    mismatched = write_identity_model(repository, "renamed")
    (mismatched / "config.pbtxt").write_text((mismatched / "config.pbtxt").read_text().replace('"renamed"', '"other"'))
    (repository / "empty_model" / "1").mkdir(parents=True)
    write_identity_model(repository, "no_versions", versions=())
    server = launch(f"--model-repository={repository}", "--exit-on-error=false").wait_live()
    try:
        client = httpclient.InferenceServerClient(server.url)
        assert client.is_server_live()
        assert not client.is_server_ready()  # strict readiness: a model failed
        assert client.is_model_ready("simple")
        assert not client.is_model_ready("renamed")
        with pytest.raises(InferenceServerException) as error:
            client.get_model_metadata("renamed")
        assert error.value.status() == "404"
        assert error.value.message() == "Request for unknown model: 'renamed' has no available versions"
        log = server.log()
        assert "unexpected 'name' in model configuration" in log
        assert "at least one version must be available under the version policy of model 'no_versions'" in log
        assert "unable to determine the backend" in log  # empty_model
        left = np.ones((1, 16), dtype=np.int32)
        inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(left)
        np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), left * 2)
    finally:
        assert server.stop() == 0


def test_non_strict_readiness(launch: Launch, repository: Path) -> None:
    copy_model("simple", repository)
    (repository / "empty_model" / "1").mkdir(parents=True)
    server = launch(f"--model-repository={repository}", "--exit-on-error=false", "--strict-readiness=false").wait_live()
    try:
        assert httpclient.InferenceServerClient(server.url).is_server_ready()
    finally:
        server.stop()


def test_config_mismatching_the_model_file_names_both(launch: Launch, repository: Path) -> None:
    model = copy_model("simple", repository)
    (model / "config.pbtxt").write_text((model / "config.pbtxt").read_text().replace("TYPE_INT32", "TYPE_FP32", 1))
    server = launch(f"--model-repository={repository}")
    assert server.wait_exit() != 0
    assert "input 'INPUT0' is TYPE_FP32 in the config but TYPE_INT32 in the model file" in server.log()
    server.stop()


def test_missing_config_is_completed_from_onnx(launch: Launch, repository: Path) -> None:
    model = copy_model("simple", repository, "autocompleted")
    (model / "config.pbtxt").unlink()
    server = launch(f"--model-repository={repository}").wait_live()
    try:
        client = httpclient.InferenceServerClient(server.url)
        config = client.get_model_config("autocompleted")
        assert config["name"] == "autocompleted"
        assert config["backend"] == "onnxruntime"
        assert config["max_batch_size"] == 4  # Triton's default-max-batch-size for a batchable graph
        assert "dynamic_batching" in config
        assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
            ("INPUT0", "TYPE_INT32", [16]),
            ("INPUT1", "TYPE_INT32", [16]),
        ]
        metadata = client.get_model_metadata("autocompleted")
        assert metadata["inputs"][0]["shape"] == [-1, 16]
    finally:
        server.stop()


def test_disable_auto_complete(launch: Launch, repository: Path) -> None:
    model = copy_model("simple", repository, "unconfigured")
    (model / "config.pbtxt").unlink()
    server = launch(f"--model-repository={repository}", "--disable-auto-complete-config")
    assert server.wait_exit() != 0
    assert "model 'unconfigured': model file inputs ['INPUT0', 'INPUT1'] are missing from the config" in server.log()
    server.stop()


def test_version_policies(launch: Launch, repository: Path) -> None:
    write_identity_model(
        repository, "latest_two", versions=(1, 2, 3), extra="version_policy: { latest: { num_versions: 2 } }"
    )
    write_identity_model(repository, "all_versions", versions=(1, 3), extra="version_policy: { all: {} }")
    write_identity_model(
        repository, "specific", versions=(1, 2, 3), extra="version_policy: { specific: { versions: [1, 3] } }"
    )
    write_identity_model(repository, "default_latest", versions=(1, 2, 10))
    (repository / "default_latest" / "07").mkdir()  # a leading zero is not a version folder
    server = launch(f"--model-repository={repository}").wait_live()
    try:
        client = httpclient.InferenceServerClient(server.url)
        assert client.get_model_metadata("latest_two")["versions"] == ["2", "3"]
        assert client.get_model_metadata("all_versions")["versions"] == ["1", "3"]
        assert client.get_model_metadata("specific")["versions"] == ["1", "3"]
        assert client.get_model_metadata("default_latest")["versions"] == ["10"]
        assert not client.is_model_ready("latest_two", "1")
        assert client.is_model_ready("specific", "1")
        assert not client.is_model_ready("specific", "2")
        data = np.array([[1.5, -2.0]], dtype=np.float32)
        tensor = httpclient.InferInput("INPUT0", [1, 2], "FP32")
        tensor.set_data_from_numpy(data)
        result = client.infer("specific", [tensor], model_version="1")
        assert result.get_response()["model_version"] == "1"
        result = client.infer("specific", [tensor])
        assert result.get_response()["model_version"] == "3"  # unversioned requests go to the highest
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)
    finally:
        server.stop()


def test_model_in_two_repositories_is_unavailable(launch: Launch, tmp_path: Path, repository: Path) -> None:
    second = tmp_path / "second"
    second.mkdir()
    copy_model("simple", repository)
    copy_model("simple", second)
    copy_model("digits", second)
    server = launch(f"--model-repository={repository}", f"--model-store={second}", "--exit-on-error=false").wait_live()
    try:
        client = httpclient.InferenceServerClient(server.url)
        assert client.is_model_ready("digits")
        assert not client.is_model_ready("simple")
        assert "model 'simple' appears in multiple repositories" in server.log()
    finally:
        server.stop()


def test_missing_repository_fails_startup(launch: Launch, tmp_path: Path) -> None:
    server = launch(f"--model-repository={tmp_path / 'nowhere'}")
    assert server.wait_exit() != 0
    assert "does not exist" in server.log()
    server.stop()


def _post(port: int, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", "/v2/models/simple/infer", body=body, headers=headers)
        response = connection.getresponse()
        return response.status, orjson.loads(response.read())
    finally:
        connection.close()


def test_http_max_input_size_also_bounds_decompressed_bodies(launch: Launch, repository: Path) -> None:
    copy_model("simple", repository)
    server = launch(f"--model-repository={repository}", "--http-max-input-size=4096").wait_live()
    try:
        good = orjson.dumps(
            {
                "inputs": [
                    {"name": n, "datatype": "INT32", "shape": [1, 16], "data": [1] * 16} for n in ("INPUT0", "INPUT1")
                ]
            }
        )
        status, answer = _post(server.http_port, good + b" " * 5000, {})
        assert status == 400
        assert "exceeds the maximum allowed value of 4096 bytes" in answer["error"]
        bomb = gzip.compress(good + b" " * 100_000)
        assert len(bomb) < 4096
        status, answer = _post(server.http_port, bomb, {"Content-Encoding": "gzip"})
        assert status == 400 and "exceeds the maximum allowed value of 4096 bytes" in answer["error"]
        status, answer = _post(server.http_port, good, {})
        assert status == 200 and answer["outputs"][0]["data"] == [2] * 16
    finally:
        server.stop()


def test_identity_backend_and_wrong_method(launch: Launch, repository: Path) -> None:
    write_identity_model(repository, "echo", dtype="TYPE_INT64", dims="2, -1", max_batch_size=0)
    shutil.copytree(MODEL_REPOSITORY / "digits", repository / "digits")
    server = launch(f"--model-repository={repository}").wait_live()
    try:
        client = httpclient.InferenceServerClient(server.url)
        assert client.get_model_metadata("echo")["inputs"][0]["shape"] == [2, -1]
        data = np.arange(6, dtype=np.int64).reshape(2, 3)
        tensor = httpclient.InferInput("INPUT0", [2, 3], "INT64")
        tensor.set_data_from_numpy(data)
        np.testing.assert_array_equal(client.infer("echo", [tensor]).as_numpy("OUTPUT0"), data)
        assert http_status(f"http://{server.url}/v2/models/echo/versions/1/ready") == 200
    finally:
        server.stop()

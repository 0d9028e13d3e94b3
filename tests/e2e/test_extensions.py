"""Logging, trace, classification and restricted-API extensions through tritonclient, HTTP and gRPC."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.e2e.test_trace_file import HTTP_NAMES
from tests.support import GeserveProcess, copy_model, write_identity_model

pytestmark = pytest.mark.e2e

Launch = Callable[..., GeserveProcess]
LABELS = ["cat", "dog", "owl", "fox", "eel"]


@pytest.fixture(scope="module")
def ext_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("extensions")
    repository = root / "models"
    copy_model("simple", repository)
    labelled = write_identity_model(repository, "scores", dims="5", max_batch_size=4)
    config = labelled / "config.pbtxt"
    text = config.read_text()
    outputs = text.index("output [")
    labelled_output = text[outputs:].replace("dims: [ 5 ] }", 'dims: [ 5 ] label_filename: "labels.txt" }', 1)
    config.write_text(text[:outputs] + labelled_output)
    (labelled / "labels.txt").write_text("\n".join(LABELS) + "\n")
    unbatched = write_identity_model(repository, "scores_flat", dims="5", max_batch_size=0)
    process = GeserveProcess(root / "geserve.log", f"--model-repository={repository}")
    yield process.wait_live()
    assert process.stop() == 0, process.log()
    assert unbatched.exists()


def _simple(server: GeserveProcess, module: Any = httpclient, **kwargs: Any) -> Any:
    url = server.url if module is httpclient else f"127.0.0.1:{server.grpc_port}"
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(data)
    result = module.InferenceServerClient(url).infer("simple", inputs, **kwargs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data * 2)
    return result


# -- logging ---------------------------------------------------------------------------------------


def test_logging_settings_change_live_and_refuse_the_log_file(ext_server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(ext_server.url)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{ext_server.grpc_port}")
    assert http.get_log_settings() == {
        "log_file": "",
        "log_info": True,
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,
        "log_format": "default",
    }
    updated = http.update_log_settings({"log_verbose_level": 2, "log_format": "ISO8601"})
    assert updated["log_verbose_level"] == 2 and updated["log_format"] == "ISO8601"
    settings = grpc.get_log_settings(as_json=True)["settings"]
    assert settings["log_verbose_level"]["uint32_param"] == 2
    assert settings["log_format"]["string_param"] == "ISO8601"
    grpc.update_log_settings({"log_verbose_level": 0, "log_format": "default"})
    assert http.get_log_settings()["log_verbose_level"] == 0
    with pytest.raises(InferenceServerException) as error:
        http.update_log_settings({"log_file": "/tmp/geserve-owned.log"})
    assert error.value.status() == "501"
    assert error.value.message() == "log file location can not be updated through network protocol"
    with pytest.raises(InferenceServerException) as error:
        grpc.update_log_settings({"log_file": "/root/.bashrc"})
    assert error.value.status() == "StatusCode.UNIMPLEMENTED"
    for bad in ({"log_info": "yes"}, {"log_verbose_level": -1}, {"log_format": "xml"}, {"log_colour": True}):
        with pytest.raises(InferenceServerException) as error:
            http.update_log_settings(bad)
        assert error.value.status() == "400"
    assert not Path("/tmp/geserve-owned.log").exists()
    assert http.get_log_settings()["log_info"] is True  # nothing changed by the bad requests
    _simple(ext_server)


# -- trace -----------------------------------------------------------------------------------------


def _traces(server: GeserveProcess, request_id: str) -> list[dict[str, Any]]:
    found = []
    for line in server.log().splitlines():
        match = re.search(r"trace\.py:\d+\] trace (\{.*\})$", line)
        if match:
            record = json.loads(match.group(1))
            if record["request_id"] == request_id:
                found.append(record)
    return found


def test_trace_timestamps_per_model_settings_and_refusals(ext_server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(ext_server.url)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{ext_server.grpc_port}")
    defaults = http.get_trace_settings()
    assert defaults["trace_level"] == ["OFF"] and defaults["trace_rate"] == "1000"
    assert defaults["trace_file"] == "" and defaults["trace_count"] == "-1"
    settings = http.update_trace_settings(
        model_name="simple", settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "2"}
    )
    assert settings["trace_level"] == ["TIMESTAMPS"] and settings["trace_rate"] == "1"
    assert http.get_trace_settings()["trace_level"] == ["OFF"]  # the global setting is unchanged
    for index in range(3):
        _simple(ext_server, request_id=f"traced-{index}")
    time.sleep(0.2)
    first = _traces(ext_server, "traced-0")
    assert len(first) == 1
    names = [stamp["name"] for stamp in first[0]["timestamps"]]
    assert names == HTTP_NAMES
    stamps = [stamp["ns"] for stamp in first[0]["timestamps"]]
    assert stamps == sorted(stamps)
    assert first[0]["model_name"] == "simple" and first[0]["model_version"] == "1"
    assert _traces(ext_server, "traced-1") and not _traces(ext_server, "traced-2")  # trace_count 2
    with pytest.raises(InferenceServerException) as error:
        http.update_trace_settings(settings={"trace_file": "/tmp/overwrite-me"})
    assert error.value.status() == "501"
    assert error.value.message() == "trace file location can not be updated through network protocol"
    with pytest.raises(InferenceServerException) as error:
        grpc.update_trace_settings(settings={"trace_file": "/tmp/overwrite-me"})
    assert error.value.status() == "StatusCode.UNIMPLEMENTED"
    with pytest.raises(InferenceServerException) as error:
        http.update_trace_settings(settings={"trace_rate": "zero"})
    assert error.value.status() == "400"
    cleared = grpc.update_trace_settings(model_name="simple", settings={"trace_level": None}, as_json=True)
    assert cleared["settings"]["trace_level"]["value"] == ["OFF"]  # back to the global value
    _simple(ext_server, request_id="untraced")
    assert not _traces(ext_server, "untraced")


# -- classification --------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_classification_top_k_with_labels(ext_server: GeserveProcess, protocol: str) -> None:
    module: Any = httpclient if protocol == "http" else grpcclient
    url = ext_server.url if protocol == "http" else f"127.0.0.1:{ext_server.grpc_port}"
    client = module.InferenceServerClient(url)
    scores = np.array([[0.1, 0.7, 0.05, 0.9, 0.2], [5, 4, 3, 2, 1]], dtype=np.float32)
    tensor = module.InferInput("INPUT0", [2, 5], "FP32")
    tensor.set_data_from_numpy(scores)
    result = client.infer("scores", [tensor], outputs=[module.InferRequestedOutput("OUTPUT0", class_count=3)])
    top = result.as_numpy("OUTPUT0")
    assert top.shape == (2, 3)
    assert top.tolist() == [
        [b"0.900000:3:fox", b"0.700000:1:dog", b"0.200000:4:eel"],
        [b"5.000000:0:cat", b"4.000000:1:dog", b"3.000000:2:owl"],
    ]
    flat = module.InferInput("INPUT0", [5], "FP32")
    flat.set_data_from_numpy(scores[0])
    result = client.infer("scores_flat", [flat], outputs=[module.InferRequestedOutput("OUTPUT0", class_count=2)])
    assert result.as_numpy("OUTPUT0").tolist() == [b"0.900000:3", b"0.700000:1"]  # no label file, no batch dim


# -- restricted APIs -------------------------------------------------------------------------------


def test_restricted_apis_need_their_header(launch: Launch, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    copy_model("simple", repository)
    server = launch(
        f"--model-repository={repository}",
        "--http-restricted-api=model-repository,logging:admin-key=s3cret",
        "--http-restricted-api=inference:infer-key=abc",
        "--grpc-restricted-protocol=model-repository:admin-key=s3cret",
    ).wait_live()
    http = httpclient.InferenceServerClient(server.url)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    for headers in (None, {"admin-key": "wrong"}, {"admin-key": "s3cre"}, {"Admin-Key": "s3cretx"}):
        with pytest.raises(InferenceServerException) as error:
            http.get_model_repository_index(headers=headers)
        assert error.value.status() == "403"
        assert error.value.message() == "This API is restricted, expecting header 'admin-key'"
    assert http.get_model_repository_index(headers={"admin-key": "s3cret"})
    request = urllib.request.Request(f"http://{server.url}/v2/logging")
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(request, timeout=10)
    with http_error.value:
        assert http_error.value.code == 403
    with pytest.raises(InferenceServerException) as error:
        _simple(server)
    assert error.value.status() == "403"
    assert error.value.message() == "This API is restricted, expecting header 'infer-key'"
    _simple(server, headers={"infer-key": "abc"})
    assert http.is_server_live() and http.get_model_metadata("simple")["name"] == "simple"  # unrestricted groups
    with pytest.raises(InferenceServerException) as error:
        grpc.get_model_repository_index()
    assert error.value.status() == "StatusCode.UNAVAILABLE"
    assert error.value.message() == "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'"
    index = grpc.get_model_repository_index(headers={"triton-grpc-protocol-admin-key": "s3cret"}, as_json=True)
    assert index["models"][0]["name"] == "simple"
    _simple(server, module=grpcclient)  # inference is restricted over HTTP only
    assert server.stop() == 0


def test_bad_restriction_flags_stop_startup(launch: Launch, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    copy_model("simple", repository)
    for flag, message in (
        ("--http-restricted-api=everything:k=v", "unknown API 'everything'"),
        ("--http-restricted-api=inference", "expects <api>[,<api>...]:<key>=<value>"),
    ):
        server = launch(f"--model-repository={repository}", flag)
        assert server.wait_exit() != 0
        assert message in server.log()
        server.stop()

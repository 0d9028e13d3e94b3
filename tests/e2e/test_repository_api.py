"""The model repository extension and model control modes, through tritonclient over HTTP and gRPC."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import MODEL_REPOSITORY, GeserveProcess, copy_model, server_pids, write_identity_model

pytestmark = pytest.mark.e2e

Launch = Callable[..., GeserveProcess]
EXPLICIT_ONLY = "explicit model load / unload is not allowed if polling is enabled"


def _simple_inputs(module: object, value: int = 1) -> tuple[list[object], np.ndarray]:
    data = np.full((1, 16), value, dtype=np.int32)
    inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]  # type: ignore[attr-defined]
    for tensor in inputs:
        tensor.set_data_from_numpy(data)  # type: ignore[attr-defined]
    return inputs, data


def _infer_simple(client: httpclient.InferenceServerClient, model: str = "simple", value: int = 1) -> None:
    inputs, data = _simple_inputs(httpclient, value)
    result = client.infer(model, inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data * 2)


def _post(server: GeserveProcess, path: str, body: dict[str, object] | None = None) -> tuple[int, object]:
    request = urllib.request.Request(f"http://{server.url}{path}", data=json.dumps(body or {}).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def explicit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("explicit")
    repository = root / "models"
    for name in ("simple", "simple_string"):
        copy_model(name, repository)
    process = GeserveProcess(
        root / "geserve.log", f"--model-repository={repository}", "--model-control-mode=explicit", "--load-model=simple"
    ).wait_live()
    yield process
    assert process.stop() == 0, process.log()


def _repository(server: GeserveProcess) -> Path:
    return server.log_path.parent / "models"


def test_explicit_mode_loads_only_the_named_models_and_indexes_all(explicit: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(explicit.url)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{explicit.grpc_port}")
    index = http.get_model_repository_index()
    assert {"name": "simple", "version": "1", "state": "READY"} in index
    assert {"name": "simple_string"} in index
    status, ready_only = _post(explicit, "/v2/repository/index", {"ready": True})
    assert status == 200 and [entry["name"] for entry in ready_only] == ["simple"]
    grpc_index = grpc.get_model_repository_index(as_json=True)["models"]
    assert {"name": "simple", "version": "1", "state": "READY"} in grpc_index
    assert not http.is_model_ready("simple_string")
    assert http.is_server_ready()  # models never loaded do not count against readiness


def test_load_unload_and_reload_over_http_and_grpc(explicit: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(explicit.url)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{explicit.grpc_port}")
    http.load_model("simple_string")
    assert http.is_model_ready("simple_string")
    http.unload_model("simple_string")
    assert not http.is_model_ready("simple_string")
    assert {"name": "simple_string", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"} in (
        http.get_model_repository_index()
    )
    with pytest.raises(InferenceServerException) as error:
        http.get_model_metadata("simple_string")
    assert error.value.message().startswith("Request for unknown model: 'simple_string'")
    grpc.load_model("simple_string")
    assert grpc.is_model_ready("simple_string")
    grpc.unload_model("simple_string", unload_dependents=True)
    assert not grpc.is_model_ready("simple_string")
    _infer_simple(http)


def test_config_override_is_completed_from_the_model_file(explicit: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(explicit.url)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{explicit.grpc_port}")
    http.load_model("simple", config=json.dumps({"max_batch_size": "16"}))  # a numeric string, as in Triton's example
    config = http.get_model_config("simple")
    assert config["max_batch_size"] == 16
    assert [t["name"] for t in config["input"]] == ["INPUT0", "INPUT1"]
    _infer_simple(http)
    grpc.load_model("simple", config=json.dumps({"max_batch_size": 8}))
    assert grpc.get_model_config("simple", as_json=True)["config"]["max_batch_size"] == 8
    http.load_model("simple")  # back to config.pbtxt
    assert http.get_model_config("simple")["max_batch_size"] == 8


def test_file_overrides_load_into_a_fresh_model_folder(explicit: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(explicit.url)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{explicit.grpc_port}")
    onnx = (MODEL_REPOSITORY / "simple" / "1" / "model.onnx").read_bytes()
    config = json.dumps({"backend": "onnxruntime", "max_batch_size": 4})
    http.load_model("uploaded", config=config, files={"file:1/model.onnx": onnx})
    _infer_simple(http, "uploaded", value=3)
    assert not (_repository(explicit) / "uploaded").exists()  # never written into the repository
    grpc.load_model("uploaded_grpc", config=config, files={"file:1/model.onnx": onnx})
    _infer_simple(http, "uploaded_grpc", value=4)
    for name in ("uploaded", "uploaded_grpc"):
        http.unload_model(name)


@pytest.mark.parametrize(
    ("name", "parameters", "status", "message"),
    [
        ("..", {}, 400, "must not be empty or contain path traversal characters"),
        ("nope", {}, 500, "failed to load 'nope', failed to poll from model repository"),
        (
            "escape",
            {"config": "{}", "file:../../outside.onnx": "AAAA"},
            400,
            "must name a file inside the model folder",
        ),
        ("escape", {"config": "{}", "file:/etc/passwd": "AAAA"}, 400, "must name a file inside the model folder"),
        ("escape", {"file:1/model.onnx": "AAAA"}, 400, "file overrides need a 'config' parameter too"),
        ("escape", {"config": "{not json"}, 400, "the 'config' parameter is not a model config"),
        ("escape", {"config": "{}", "file:1/model.onnx": "%%%"}, 400, "is not valid base64"),
        ("simple", {"config": "[]"}, 400, "the 'config' parameter must be a JSON object"),
        ("simple", {"config": '"text"'}, 400, "the 'config' parameter must be a JSON object"),
        ("simple", {"config": '{"instance_group": [{"count": -3}]}'}, 400, "asks for -3 instances"),
        ("simple", {"config": '{"instance_group": [{"count": 100000}]}'}, 400, "asks for 100000 instances"),
        ("long", {"config": "{}", f"file:1/{'a' * 300}.onnx": "AAAA"}, 500, "name longer than 255 bytes"),
        ("nul", {"config": "{}", "file:1/a\u0000b.onnx": "AAAA"}, 500, "contains a NUL character"),
        ("deep", {"config": "{}", "file:" + "d/" * 2000 + "m.onnx": "AAAA"}, 500, "is longer than 1024 bytes"),
        ("deep", {"config": "{}", "file:" + "d/" * 40 + "m.onnx": "AAAA"}, 500, "is more than 32 folders deep"),
    ],
)
def test_load_refusals_then_a_good_request(
    explicit: GeserveProcess, name: str, parameters: dict[str, str], status: int, message: str
) -> None:
    answer_status, answer = _post(explicit, f"/v2/repository/models/{name}/load", {"parameters": parameters})
    assert answer_status == status
    assert isinstance(answer, dict) and message in answer["error"]
    assert "geserve-model-" not in answer["error"]  # never the server's own temporary paths
    assert not list(Path("/").glob("outside.onnx"))
    _infer_simple(httpclient.InferenceServerClient(explicit.url))


def test_grpc_refuses_traversal_names_and_repository_names(explicit: GeserveProcess) -> None:
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{explicit.grpc_port}")
    with pytest.raises(InferenceServerException) as error:
        grpc.load_model("../simple")
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "path traversal" in error.value.message()
    status, answer = _post(explicit, "/v2/repository/other/index")
    assert status == 501 and answer == {"error": "'repository_name' specification is not supported"}
    _infer_simple(httpclient.InferenceServerClient(explicit.url))


def test_an_override_name_past_name_max_is_what_tritons_example_expects(explicit: GeserveProcess) -> None:
    """Triton's simple_grpc_model_control example: INTERNAL, "failed to poll from model repository", still live."""
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{explicit.grpc_port}")
    with pytest.raises(InferenceServerException) as error:
        grpc.load_model("simple", config="{}", files={"file:" + "A" * 256: b"a"})
    assert error.value.status() == "StatusCode.INTERNAL"
    assert "failed to poll from model repository" in error.value.message()
    assert grpc.is_server_live() and grpc.is_model_ready("simple")
    _infer_simple(httpclient.InferenceServerClient(explicit.url))


def test_failed_reload_keeps_the_old_model_serving(explicit: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(explicit.url)
    config_file = _repository(explicit) / "simple" / "config.pbtxt"
    original = config_file.read_text()
    config_file.write_text(original.replace("TYPE_INT32", "TYPE_FP32", 1))
    try:
        with pytest.raises(InferenceServerException) as error:
            http.load_model("simple")
        assert "failed to load 'simple'" in error.value.message()
        assert http.is_model_ready("simple")
        _infer_simple(http)
    finally:
        config_file.write_text(original)


def _hammer(server: GeserveProcess, stop: threading.Event, failures: list[str], counts: list[int]) -> None:
    client = httpclient.InferenceServerClient(server.url)
    value = 0
    try:
        while not stop.is_set():
            value = (value + 1) % 1000
            try:
                _infer_simple(client, value=value)
                counts[0] += 1
            except Exception as error:
                failures.append(repr(error))
    finally:
        client.close()  # on its own thread, before the server goes: no socket is left to the collector


def test_reload_under_concurrent_load_fails_nothing(explicit: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(explicit.url)
    stop = threading.Event()
    failures: list[str] = []
    counts = [[0], [0], [0]]
    threads = [threading.Thread(target=_hammer, args=(explicit, stop, failures, counts[i])) for i in range(3)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(3):
            time.sleep(0.3)
            http.load_model("simple")
        time.sleep(0.3)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert failures == []
    assert sum(count[0] for count in counts) > 20


def test_none_mode_refuses_load_and_unload(launch: Launch, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    copy_model("simple", repository)
    server = launch(f"--model-repository={repository}").wait_live()
    http = httpclient.InferenceServerClient(server.url)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    for call in (lambda: http.load_model("simple"), lambda: http.unload_model("simple")):
        with pytest.raises(InferenceServerException) as error:
            call()
        assert error.value.status() == "503"
        assert error.value.message() == EXPLICIT_ONLY
    with pytest.raises(InferenceServerException) as error:
        grpc.load_model("simple")
    assert error.value.status() == "StatusCode.UNAVAILABLE" and error.value.message() == EXPLICIT_ONLY
    assert http.get_model_repository_index() == [{"name": "simple", "version": "1", "state": "READY"}]
    _infer_simple(http)
    assert server.stop() == 0


def test_poll_mode_follows_the_repository_without_failing_requests(launch: Launch, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    copy_model("simple", repository)
    server = launch(f"--model-repository={repository}", "--model-control-mode=poll", "--repository-poll-secs=1")
    server.wait_live()
    http = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as error:
        http.load_model("simple")
    assert error.value.message() == EXPLICIT_ONLY

    def wait_until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)

    copy_model("simple_string", repository)
    wait_until(lambda: http.is_model_ready("simple_string"))

    stop = threading.Event()
    failures: list[str] = []
    counts = [0]
    thread = threading.Thread(target=_hammer, args=(server, stop, failures, counts))
    thread.start()
    try:
        config = repository / "simple" / "config.pbtxt"
        config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 6"))
        wait_until(lambda: http.get_model_config("simple")["max_batch_size"] == 6)
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join()
    assert failures == []
    assert counts[0] > 5

    shutil.rmtree(repository / "simple_string")
    wait_until(lambda: not http.is_model_ready("simple_string"))
    assert {"name": "simple_string", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"} in (
        http.get_model_repository_index()
    )
    http.close()
    assert server.stop() == 0


def test_file_descriptors_do_not_grow_across_reloads(launch: Callable[..., GeserveProcess], tmp_path: Path) -> None:
    """Each load starts a worker with pipes and shared memory; each unload must give all of it back."""
    repository = tmp_path / "models"
    write_identity_model(repository, "cycled", dtype="TYPE_INT32", dims="4", max_batch_size=4)
    server = launch(f"--model-repository={repository}", "--model-control-mode=explicit").wait_live()
    http = httpclient.InferenceServerClient(server.url)

    def open_descriptors() -> int:  # of every process of the server's own, the one that starts workers included
        return sum(len(list(Path(f"/proc/{pid}/fd").iterdir())) for pid in server_pids(server))

    def cycle(times: int) -> None:
        for _ in range(times):
            http.load_model("cycled")
            http.unload_model("cycled")
        deadline = time.monotonic() + 10
        while http.get_model_repository_index()[0].get("state") == "UNLOADING" and time.monotonic() < deadline:
            time.sleep(0.05)

    cycle(3)  # warm-up: lazily created executors and listeners
    time.sleep(0.5)
    before = open_descriptors()
    cycle(10)  # a descriptor kept per cycle would show as 10
    time.sleep(0.5)
    after = open_descriptors()
    assert after - before <= 3, f"{before} file descriptors before 10 load/unload cycles, {after} after"
    http.close()


ENSEMBLE = """
name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
ensemble_scheduling {{ step [ {{
  model_name: "{step}" model_version: -1
  input_map {{ key: "INPUT0" value: "INPUT0" }}
  output_map {{ key: "OUTPUT0" value: "OUTPUT0" }}
}} ] }}
"""


def test_explicit_mode_loads_the_steps_of_named_ensembles_only(launch: Launch, repository: Path) -> None:
    """--load-model simple leaves the steps of the repository's other ensembles unloaded; naming an ensemble loads
    its steps too (and an ensemble of ensembles, theirs)."""
    write_identity_model(repository, "simple")
    for step in ("step_a", "step_b"):
        write_identity_model(repository, step)
    for name, step in (("ens_a", "step_a"), ("ens_b", "step_b"), ("outer", "ens_b")):
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(ENSEMBLE.format(name=name, step=step))
    server = launch(f"--model-repository={repository}", "--model-control-mode=explicit", "--load-model=simple")
    server.wait_live()
    ready = {
        entry["name"]
        for entry in httpclient.InferenceServerClient(server.url).get_model_repository_index()
        if entry.get("state") == "READY"
    }
    assert ready == {"simple"}, ready
    assert server.stop() == 0
    server = launch(f"--model-repository={repository}", "--model-control-mode=explicit", "--load-model=outer")
    server.wait_live()
    ready = {
        entry["name"]
        for entry in httpclient.InferenceServerClient(server.url).get_model_repository_index()
        if entry.get("state") == "READY"
    }
    assert ready == {"outer", "ens_b", "step_b"}, ready
    assert server.stop() == 0

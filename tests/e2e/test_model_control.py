"""pb_utils.load_model / unload_model / is_model_ready, Logger levels on the class, and BLS requests with a trace,
flags and preferred memory, from python models, through tritonclient (HTTP and gRPC)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, write_identity_model

pytestmark = pytest.mark.e2e
PYTHON_MODELS = Path(__file__).resolve().parents[1] / "python_models"
EXPLICIT_ONLY = "explicit model load / unload is not allowed if polling is enabled"
PASSTHROUGH_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy() * 2)]
            )
            for request in requests
        ]
"""
IDENTITY_JSON = json.dumps(
    {
        "backend": "identity",
        "max_batch_size": 0,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
    }
)


def _repository(root: Path) -> Path:
    repository = root / "models"
    repository.mkdir()
    for name in ("model_control", "loads_in_init", "loads_itself"):
        shutil.copytree(PYTHON_MODELS / name, repository / name)
    for name in ("loaded_by_init", "echo", "spare"):
        write_identity_model(repository, name, max_batch_size=0)
    return repository


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("model_control")
    repository = _repository(root)
    process = GeserveProcess(
        root / "geserve.log",
        f"--model-repository={repository}",
        "--model-control-mode=explicit",
        "--load-model=model_control",
        "--load-model=loads_in_init",
        "--log-verbose=1",
    ).wait_live()
    yield process
    assert process.stop() == 0, process.log()


def _clients(server: GeserveProcess) -> list[tuple[Any, Any]]:
    return [
        (httpclient.InferenceServerClient(server.url, network_timeout=120), httpclient),
        (grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}"), grpcclient),
    ]


def _tensor(module: Any, name: str, array: np.ndarray, datatype: str) -> Any:
    tensor = module.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _control(client: Any, module: Any, action: str, target: str, argument: str = "") -> Any:
    inputs = [
        _tensor(module, name, np.array([value.encode()], dtype=np.object_), "BYTES")
        for name, value in (("ACTION", action), ("TARGET", target), ("ARGUMENT", argument))
    ]
    return client.infer("model_control", inputs)


def _ready(client: Any, module: Any, target: str, version: str = "") -> bool:
    return bool(_control(client, module, "ready", target, version).as_numpy("READY")[0])


def _infer(client: Any, module: Any, model: str, data: np.ndarray) -> np.ndarray:
    result = client.infer(model, [_tensor(module, "INPUT0", data, "FP32")])
    return np.asarray(result.as_numpy("OUTPUT0"))


def test_a_model_loaded_from_initialize_serves(explicit_server: GeserveProcess) -> None:
    data = np.arange(4, dtype=np.float32)
    for client, module in _clients(explicit_server):
        assert client.is_model_ready("loads_in_init") and client.is_model_ready("loaded_by_init")
        assert _infer(client, module, "loads_in_init", data).tolist() == data.tolist()
        assert _infer(client, module, "loaded_by_init", data).tolist() == data.tolist()
        assert _ready(client, module, "loaded_by_init")


def test_load_ready_and_unload_from_execute(explicit_server: GeserveProcess) -> None:
    data = np.ones(3, dtype=np.float32)
    for client, module in _clients(explicit_server):
        assert not _ready(client, module, "echo") and not client.is_model_ready("echo")
        _control(client, module, "load", "echo")
        assert _ready(client, module, "echo") and _ready(client, module, "echo", "1")
        assert not _ready(client, module, "echo", "2")
        assert client.is_model_ready("echo")
        assert _infer(client, module, "echo", data).tolist() == data.tolist()
        _control(client, module, "unload", "echo")
        assert not _ready(client, module, "echo") and not client.is_model_ready("echo")
        with pytest.raises(InferenceServerException):
            _infer(client, module, "echo", data)
        assert not _ready(client, module, "does_not_exist")


def test_load_with_a_config_and_files(explicit_server: GeserveProcess) -> None:
    data = np.arange(3, dtype=np.float32)
    for client, module in _clients(explicit_server):
        _control(client, module, "load", "spare", IDENTITY_JSON)
        assert _infer(client, module, "spare", data).tolist() == data.tolist()
        _control(client, module, "load_files", "made_up", PASSTHROUGH_MODEL)
        assert _ready(client, module, "made_up") and client.is_model_ready("made_up")
        assert _infer(client, module, "made_up", data).tolist() == (2 * data).tolist()
        _control(client, module, "unload", "made_up")
        assert not _ready(client, module, "made_up")
        _control(client, module, "unload", "spare")


def test_load_errors_reach_the_model_and_it_serves_on(explicit_server: GeserveProcess) -> None:
    for client, module in _clients(explicit_server):
        with pytest.raises(InferenceServerException) as error:
            _control(client, module, "load", "does_not_exist")
        assert "Failed to load model: failed to load 'does_not_exist', failed to poll from model repository" in (
            error.value.message()
        )
        with pytest.raises(InferenceServerException) as error:
            _control(client, module, "ready", "echo", "one")
        assert "failed to get model version from specified version string 'one'" in error.value.message()
        assert not _ready(client, module, "echo")


def test_a_model_loading_itself_from_initialize_fails_instead_of_waiting(explicit_server: GeserveProcess) -> None:
    for client, module in _clients(explicit_server):
        with pytest.raises(InferenceServerException) as error:
            client.load_model("loads_itself")
        assert "model 'loads_itself' cannot be loaded or unloaded from its own initialize" in error.value.message()
        assert not client.is_model_ready("loads_itself")
        assert _ready(client, module, "loaded_by_init")


def test_logger_levels_on_the_class(explicit_server: GeserveProcess) -> None:
    for client, module in _clients(explicit_server):
        assert bool(_control(client, module, "log", "", f"said by {module.__name__}").as_numpy("READY")[0])
    log = explicit_server.log()
    for name in ("tritonclient.http", "tritonclient.grpc"):
        # Triton's layout: the level's letter first (verbose lines are I), then the model's own file and line.
        for level, letter in (("INFO", "I"), ("WARNING", "W"), ("ERROR", "E"), ("VERBOSE", "I")):
            assert any(
                f"said by {name} at {level}" in line and line.startswith(letter) and " model.py:" in line
                for line in log.splitlines()
            ), level
        assert f"said by {name} at LogLevel.WARNING" in log


def test_bls_with_trace_flags_and_cpu_memory(explicit_server: GeserveProcess) -> None:
    for client, module in _clients(explicit_server):
        _control(client, module, "load", "echo")
        result = _control(client, module, "bls", "echo", "cpu")
        assert result.as_numpy("OUTPUT0").tolist() == [0, 1, 2]
        _control(client, module, "unload", "echo")


def test_gpu_memory_and_unknown_keywords_are_refused(explicit_server: GeserveProcess) -> None:
    for client, module in _clients(explicit_server):
        _control(client, module, "load", "echo")
        with pytest.raises(InferenceServerException) as error:
            _control(client, module, "bls", "echo", "gpu")
        assert "TritonModelException: InferenceRequest(): preferred_memory TRITONSERVER_MEMORY_GPU (device 0)" in (
            error.value.message()
        )
        assert "not supported by geserve" in error.value.message()
        with pytest.raises(InferenceServerException) as error:
            _control(client, module, "bls", "echo", "bogus")
        assert "TypeError" in error.value.message() and "'bogus'" in error.value.message()
        assert _control(client, module, "bls", "echo", "cpu").as_numpy("OUTPUT0").tolist() == [0, 1, 2]
        _control(client, module, "unload", "echo")


def test_load_and_unload_need_explicit_mode(tmp_path: Path) -> None:
    repository = _repository(tmp_path)
    shutil.rmtree(repository / "loads_in_init")
    shutil.rmtree(repository / "loads_itself")  # its load fails, which stops a server loading everything
    server = GeserveProcess(tmp_path / "geserve.log", f"--model-repository={repository}").wait_live()
    try:
        for client, module in _clients(server):
            for action in ("load", "unload"):
                with pytest.raises(InferenceServerException) as error:
                    _control(client, module, action, "echo")
                verb = "load" if action == "load" else "unload"
                assert f"Failed to {verb} model: {EXPLICIT_ONLY}" in error.value.message()
            assert _ready(client, module, "echo") and not _ready(client, module, "does_not_exist")
            assert _infer(client, module, "echo", np.ones(2, dtype=np.float32)).tolist() == [1, 1]
    finally:
        assert server.stop() == 0, server.log()

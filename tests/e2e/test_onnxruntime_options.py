"""The ONNX Runtime options Triton's onnxruntime backend reads, through a real server and tritonclient."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.fakes.op_library import build_op_library
from tests.support import GeserveProcess, copy_model

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

TUNED = """
optimization {{ graph {{ level: 1 }} }}
model_operations {{ op_library_filename: "{library}" }}
parameters {{ key: "execution_mode" value: {{ string_value: "1" }} }}
parameters {{ key: "inter_op_thread_count" value: {{ string_value: "1" }} }}
parameters {{ key: "intra_op_thread_count" value: {{ string_value: "1" }} }}
parameters {{ key: "enable_mem_pattern" value: {{ string_value: "0" }} }}
parameters {{ key: "enable_mem_arena" value: {{ string_value: "1" }} }}
parameters {{ key: "arena_extend_strategy" value: {{ string_value: "1" }} }}
parameters {{ key: "memory.enable_memory_arena_shrinkage" value: {{ string_value: "cpu:0" }} }}
"""
OPENVINO = 'optimization { execution_accelerators { cpu_execution_accelerator { name: "openvino" } } }'
WRONG_MODE = 'parameters { key: "execution_mode" value: { string_value: "3" } }'


def _variant(repository: Path, model: str, extra: str) -> None:
    config = copy_model("simple", repository, model) / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "simple"', f'name: "{model}"') + extra)


@pytest.fixture(scope="module")
def ort_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GeserveProcess, Path]]:
    root = tmp_path_factory.mktemp("ort_options")
    library, marker = build_op_library(root / "ops")
    repository = root / "models"
    _variant(repository, "tuned", TUNED.format(library=library))
    _variant(repository, "bad_ops", f'model_operations {{ op_library_filename: "{root}/missing.so" }}')
    _variant(repository, "openvino", OPENVINO)
    _variant(repository, "wrong_mode", WRONG_MODE)
    process = GeserveProcess(
        root / "geserve.log", f"--model-repository={repository}", "--model-control-mode=explicit", "--load-model=tuned"
    ).wait_live()
    yield process, marker
    assert process.stop() == 0, process.log()


def _infer(client: httpclient.InferenceServerClient, model: str) -> None:
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(data * 3)
    result = client.infer(model, inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data * 6)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), data * 0)


def _load_error(server: GeserveProcess, model: str) -> str:
    http = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as error:
        http.load_model(model)
    assert not http.is_model_ready(model)
    _infer(http, "tuned")  # the server keeps serving
    return str(error.value.message())


def test_tuned_model_registers_its_op_library_and_infers(ort_server: tuple[GeserveProcess, Path]) -> None:
    server, marker = ort_server
    _infer(httpclient.InferenceServerClient(server.url), "tuned")
    lines = marker.read_text().splitlines()
    assert lines and set(lines) == {"registered"}  # once per session the instance created


def test_missing_op_library_fails_the_load(ort_server: tuple[GeserveProcess, Path]) -> None:
    server, _ = ort_server
    message = _load_error(server, "bad_ops")
    assert "onnx runtime error 1: Failed to load library" in message and "missing.so" in message


def test_openvino_accelerator_needs_its_provider(ort_server: tuple[GeserveProcess, Path]) -> None:
    server, _ = ort_server
    available = ort.get_available_providers()
    if "OpenVINOExecutionProvider" in available:
        httpclient.InferenceServerClient(server.url).load_model("openvino")
        _infer(httpclient.InferenceServerClient(server.url), "openvino")
        return
    message = _load_error(server, "openvino")
    assert (
        "cpu_execution_accelerator 'openvino' needs ONNX Runtime's OpenVINOExecutionProvider, which this onnxruntime "
        f"does not have (available providers: {', '.join(available)})"
    ) in message


def test_wrong_execution_mode_fails_with_tritons_text(ort_server: tuple[GeserveProcess, Path]) -> None:
    server, _ = ort_server
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    with pytest.raises(InferenceServerException) as error:
        grpc.load_model("wrong_mode")
    assert "Expected values for  execution_mode are 0 or 1 but got 3 ." in error.value.message()
    _infer(httpclient.InferenceServerClient(server.url), "tuned")

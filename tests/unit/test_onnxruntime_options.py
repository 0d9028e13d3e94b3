"""The ONNX Runtime options a model config asks for, read as Triton's onnxruntime backend reads them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from google.protobuf import text_format

from geserve._generated import model_config_pb2 as mc
from geserve.backends import onnxruntime_options
from geserve.backends.onnxruntime import OnnxRuntimeBackend
from geserve.backends.onnxruntime_options import SessionSetup, session_setup
from geserve.errors import ModelLoadError
from tests.fakes.op_library import build_op_library
from tests.support import MODEL_REPOSITORY

CPU_ONLY = ["CPUExecutionProvider"]
SIMPLE = MODEL_REPOSITORY / "simple"


def _config(text: str = "", **parameters: str) -> mc.ModelConfig:
    config = text_format.Parse(text, mc.ModelConfig(name="m"))
    for key, value in parameters.items():
        config.parameters[key.replace("__", ".")].string_value = value
    return config


def _setup(text: str = "", available: list[str] | None = None, **parameters: str) -> SessionSetup:
    return session_setup(_config(text, **parameters), 0, available or CPU_ONLY)


def _refused(text: str = "", available: list[str] | None = None, **parameters: str) -> str:
    with pytest.raises(ModelLoadError) as error:
        _setup(text, available, **parameters)
    return error.value.message


@pytest.fixture(autouse=True)
def fresh_cpu_arena(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts as a fresh worker process would: no CPU arena configured yet."""
    monkeypatch.setattr(onnxruntime_options, "_cpu_arena_strategy", [])
    yield


@pytest.mark.parametrize(
    ("text", "level"),
    [
        ("", ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
        ("optimization { graph { level: -1 } }", ort.GraphOptimizationLevel.ORT_ENABLE_BASIC),
        ("optimization { graph { level: 0 } }", ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
        ("optimization { graph { level: 1 } }", ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED),
        ("optimization { graph { level: 2 } }", ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
    ],
)
def test_graph_level_maps_as_triton_maps_it(text: str, level: ort.GraphOptimizationLevel) -> None:
    assert _setup(text).options.graph_optimization_level == level


def test_execution_mode_and_thread_counts_set_the_session_options() -> None:
    options = _setup(execution_mode="1", intra_op_thread_count="3", inter_op_thread_count="2").options
    assert options.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (3, 2)
    assert _setup(execution_mode="0").options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL


def test_wrong_execution_mode_and_numbers_fail_with_tritons_text() -> None:
    assert _refused(execution_mode="3") == (
        "model 'm': Invalid configuration value provided. Expected values for  execution_mode are 0 or 1 but got 3 ."
    )
    assert "failed to convert 'many' to integral number" in _refused(intra_op_thread_count="many")


def test_memory_arena_and_pattern_switches() -> None:
    options = _setup(enable_mem_arena="0", enable_mem_pattern="false").options
    assert not options.enable_cpu_mem_arena and not options.enable_mem_pattern
    options = _setup(enable_mem_arena="on", enable_mem_pattern="1").options
    assert options.enable_cpu_mem_arena and options.enable_mem_pattern
    assert (
        _refused(enable_mem_pattern="maybe")
        == "model 'm': parameter 'enable_mem_pattern': failed to convert 'maybe' to boolean"
    )


def test_arena_extend_strategy_configures_the_cpu_arena_the_session_uses() -> None:
    options = _setup(arena_extend_strategy="1").options
    assert options.get_session_config_entry("session.use_env_allocators") == "1"
    assert onnxruntime_options._cpu_arena_strategy == ["kSameAsRequested"]
    assert "differs from the kSameAsRequested" in _refused(arena_extend_strategy="0")
    assert _refused(arena_extend_strategy="2") == "model 'm': unsupported arena_extend_strategy value '2' is requested"


def test_cuda_options_come_from_the_parameters_and_the_cuda_accelerator() -> None:
    text = """
    instance_group { kind: KIND_GPU }
    optimization { execution_accelerators { gpu_execution_accelerator { name: "cuda"
        parameters { key: "cudnn_conv_use_max_workspace" value: "0" } } } }
    """
    setup = _setup(text, ["CUDAExecutionProvider", *CPU_ONLY], arena_extend_strategy="1", gpu_mem_limit="1024")
    assert setup.providers == [
        (
            "CUDAExecutionProvider",
            {
                "device_id": "0",
                "arena_extend_strategy": "kSameAsRequested",
                "gpu_mem_limit": "1024",
                "cudnn_conv_use_max_workspace": "0",
            },
        ),
        "CPUExecutionProvider",
    ]
    assert not onnxruntime_options._cpu_arena_strategy  # the CUDA arena's strategy, not the CPU one's


def test_tensorrt_parameters_map_to_ort_options_as_in_triton() -> None:
    text = """
    instance_group { kind: KIND_GPU }
    optimization { execution_accelerators { gpu_execution_accelerator { name: "tensorrt"
        parameters { key: "precision_mode" value: "FP16" }
        parameters { key: "max_workspace_size_bytes" value: "1073741824" }
        parameters { key: "trt_engine_cache_enable" value: "1" } } } }
    """
    available = ["TensorrtExecutionProvider", "CUDAExecutionProvider", *CPU_ONLY]
    provider, options = _setup(text, available).providers[0]
    assert provider == "TensorrtExecutionProvider"
    assert options == {
        "device_id": "0",
        "trt_fp16_enable": "1",
        "trt_max_workspace_size": "1073741824",
        "trt_engine_cache_enable": "1",
    }
    wrong = text.replace('"max_workspace_size_bytes"', '"workspace"')
    assert _refused(wrong, available) == (
        "model 'm': unknown parameter 'workspace' is provided for TensorRT Execution Accelerator"
    )


def test_openvino_accelerator_uses_the_provider_where_onnxruntime_has_it() -> None:
    text = 'optimization { execution_accelerators { cpu_execution_accelerator { name: "openvino" } } }'
    setup = _setup(text, ["OpenVINOExecutionProvider", *CPU_ONLY])
    assert setup.providers == [("OpenVINOExecutionProvider", {"device_type": "CPU"}), "CPUExecutionProvider"]


@pytest.mark.parametrize(
    ("field", "name", "provider"),
    [
        ("cpu_execution_accelerator", "openvino", "OpenVINOExecutionProvider"),
        ("gpu_execution_accelerator", "tensorrt", "TensorrtExecutionProvider"),
        ("gpu_execution_accelerator", "cuda", "CUDAExecutionProvider"),
    ],
)
def test_accelerator_without_its_provider_is_refused_naming_what_is_available(
    field: str, name: str, provider: str
) -> None:
    text = f'instance_group {{ kind: KIND_GPU }} optimization {{ execution_accelerators {{ {field} {{ name: "{name}" }} }} }}'
    assert _refused(text, ["AzureExecutionProvider", *CPU_ONLY]) == (
        f"model 'm': {field} '{name}' needs ONNX Runtime's {provider}, which this onnxruntime does not have "
        "(available providers: AzureExecutionProvider, CPUExecutionProvider)"
    )


def test_unknown_accelerator_fails_with_tritons_text() -> None:
    text = 'optimization { execution_accelerators { cpu_execution_accelerator { name: "turbo" } } }'
    assert _refused(text) == "model 'm': unknown Execution Accelerator 'turbo' is requested"


def test_arena_shrinkage_is_a_run_option_for_arenas_the_session_has() -> None:
    run_options = _setup(memory__enable_memory_arena_shrinkage="cpu:0").run_options
    assert run_options.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
    assert _setup().run_options is None
    assert "'gpu:0' is not a device whose arena this session has" in _refused(
        memory__enable_memory_arena_shrinkage="gpu:0"
    )
    assert "'cpu:0' is not a device" in _refused(memory__enable_memory_arena_shrinkage="cpu:0", enable_mem_arena="0")


def test_device_allocator_for_initializers_is_a_session_config_entry() -> None:
    options = _setup(session__use_device_allocator_for_initializers="1").options
    assert options.get_session_config_entry("session.use_device_allocator_for_initializers") == "1"


def test_op_library_is_registered_and_a_bad_path_fails(tmp_path: Path) -> None:
    library, marker = build_op_library(tmp_path / "ops")
    _setup(f'model_operations {{ op_library_filename: "{library}" }}')
    assert marker.read_text() == "registered\n"
    message = _refused(f'model_operations {{ op_library_filename: "{tmp_path}/missing.so" }}')
    assert message.startswith(f"model 'm': onnx runtime error 1: Failed to load library {tmp_path}/missing.so")


def test_backend_runs_with_the_options_and_run_options() -> None:
    config = text_format.Parse((SIMPLE / "config.pbtxt").read_text(), mc.ModelConfig())
    config.optimization.graph.level = 2
    for key, value in (("execution_mode", "1"), ("memory.enable_memory_arena_shrinkage", "cpu:0")):
        config.parameters[key].string_value = value
    backend = OnnxRuntimeBackend()
    backend.load(config, SIMPLE / "1" / "model.onnx", 0)
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    outputs = backend.execute({"INPUT0": data, "INPUT1": data}, ["OUTPUT0", "OUTPUT1"])
    np.testing.assert_array_equal(outputs["OUTPUT0"], data * 2)
    np.testing.assert_array_equal(outputs["OUTPUT1"], data * 0)
    backend.unload()


def test_gpu_accelerators_apply_to_gpu_instances_only_as_in_triton() -> None:
    text = 'optimization { execution_accelerators { gpu_execution_accelerator { name: "cuda" } } }'
    assert _setup(text, ["CUDAExecutionProvider", *CPU_ONLY]).providers == ["CPUExecutionProvider"]
    # ... and need not exist for a CPU-only model to load, as with Triton on a host without them
    tensorrt = 'optimization { execution_accelerators { gpu_execution_accelerator { name: "tensorrt" } } }'
    assert _setup(tensorrt, CPU_ONLY).providers == ["CPUExecutionProvider"]


def test_shared_sessions_are_not_possible_and_the_log_says_so(caplog: pytest.LogCaptureFixture) -> None:
    _setup(share_session_between_instances="true")
    assert "share_session_between_instances is ignored: each instance runs in its own worker process" in caplog.text
    caplog.clear()
    _setup(share_session_between_instances="false")
    assert not caplog.text

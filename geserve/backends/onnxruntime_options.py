"""ONNX Runtime session options, run options and providers from a model config, read as Triton's backend reads them."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from geserve._generated import model_config_pb2 as mc
from geserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

# Triton's optimization.graph.level -> ORT's GraphOptimizationLevel name; any other level enables all.
GRAPH_LEVELS = {-1: "ORT_ENABLE_BASIC", 1: "ORT_ENABLE_EXTENDED", 2: "ORT_DISABLE_ALL"}
ARENA_EXTEND_STRATEGIES = {0: "kNextPowerOfTwo", 1: "kSameAsRequested"}
CUDNN_CONV_ALGO_SEARCH = {0: "EXHAUSTIVE", 1: "HEURISTIC", 2: "DEFAULT"}
# Execution accelerator names Triton's backend knows -> the ORT provider each needs.
CPU_ACCELERATORS = {"openvino": "OpenVINOExecutionProvider"}
GPU_ACCELERATORS = {"tensorrt": "TensorrtExecutionProvider", "cuda": "CUDAExecutionProvider"}
# Triton's TensorRT accelerator keys whose ORT option has another name; the others keep theirs.
_TENSORRT_RENAMED = {
    "max_workspace_size_bytes": "trt_max_workspace_size",
    "int8_calibration_table_name": "trt_int8_calibration_table_name",
    "int8_use_native_calibration_table": "trt_int8_use_native_calibration_table",
}
_TENSORRT_PRECISIONS = {"FP16": "trt_fp16_enable", "BF16": "trt_bf16_enable", "INT8": "trt_int8_enable", "FP32": ""}
_ORT_ERROR = re.compile(r"\[ONNXRuntimeError\] : (\d+) : \w+ : (.*)", re.DOTALL)
_SHRINK_ENTRY = re.compile(r"(cpu|gpu):(\d+)")
_BOOLEANS = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}


@dataclass(frozen=True, slots=True)
class SessionSetup:
    """What an InferenceSession is created with, and the run options every run passes."""

    options: Any  # onnxruntime.SessionOptions
    providers: list[Any]
    run_options: Any | None  # onnxruntime.RunOptions


def session_setup(config: mc.ModelConfig, device_id: int, available: Sequence[str]) -> SessionSetup:
    """The session a model's instance gets; raises ModelLoadError with Triton's text for values Triton refuses."""
    import onnxruntime as ort

    reader = _Parameters(config)
    options = ort.SessionOptions()
    level = config.optimization.graph.level if config.optimization.HasField("graph") else 0
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, GRAPH_LEVELS.get(level, "ORT_ENABLE_ALL"))
    mode = reader.integer("execution_mode", 0)
    if mode not in (0, 1):
        raise reader.error(
            f"Invalid configuration value provided. Expected values for  execution_mode are 0 or 1 but got {mode} ."
        )
    options.execution_mode = ort.ExecutionMode.ORT_PARALLEL if mode else ort.ExecutionMode.ORT_SEQUENTIAL
    threads = (("intra_op_thread_count", "intra_op_num_threads"), ("inter_op_thread_count", "inter_op_num_threads"))
    for key, attribute in threads:
        count = reader.integer(key, 0)
        if count > 0:  # 0 (or less) lets ORT pick, as in Triton
            setattr(options, attribute, count)
    # Spinning pool threads would compete for the cores the front-end needs between batches.
    spinning = "1" if reader.integer("allow_spinning", 0) else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
    options.add_session_config_entry("session.inter_op.allow_spinning", spinning)
    initializers = reader.text("session.use_device_allocator_for_initializers")
    if initializers is not None:
        options.add_session_config_entry("session.use_device_allocator_for_initializers", initializers)
    arena = reader.boolean("enable_mem_arena")
    if arena is not None:
        options.enable_cpu_mem_arena = arena
    pattern = reader.boolean("enable_mem_pattern")
    if pattern is not None:
        options.enable_mem_pattern = pattern
    if reader.boolean("share_session_between_instances"):
        logger.warning(
            "model '%s': parameter share_session_between_instances is ignored: each instance runs in its own "
            "worker process, with its own session",
            config.name,
        )
    on_gpu = any(group.kind == mc.ModelInstanceGroup.KIND_GPU for group in config.instance_group)
    providers = _providers(config, reader, device_id, on_gpu, available)
    strategy = reader.choice("arena_extend_strategy", ARENA_EXTEND_STRATEGIES)
    if strategy is not None and options.enable_cpu_mem_arena and not _uses(providers, "CUDAExecutionProvider"):
        _use_cpu_arena(config.name, strategy, options)
    for library in config.model_operations.op_library_filename:
        try:
            options.register_custom_ops_library(library)
        except Exception as error:  # ORT raises its own exception types
            raise reader.error(ort_error_text(error)) from None
    return SessionSetup(options, providers, _run_options(reader, options, providers))


def ort_error_text(error: Exception) -> str:
    """An ORT exception as Triton's backend words ORT errors: 'onnx runtime error <code>: <message>'."""
    found = _ORT_ERROR.match(str(error))
    return f"onnx runtime error {found.group(1)}: {found.group(2)}" if found else f"onnx runtime error: {error}"


def _providers(
    config: mc.ModelConfig, reader: _Parameters, device_id: int, on_gpu: bool, available: Sequence[str]
) -> list[Any]:
    """GPU accelerators (GPU instances only, as in Triton), CUDA where present, CPU accelerators, then CPU."""
    accelerators = config.optimization.execution_accelerators
    providers: list[Any] = []
    cuda_options = _cuda_options(reader, device_id)
    for accelerator in accelerators.gpu_execution_accelerator:
        if not on_gpu:
            continue  # Triton's backend reads GPU accelerators for GPU instances only: CPU-only models load anyway
        provider = _provider_for(reader, "gpu_execution_accelerator", accelerator.name, GPU_ACCELERATORS, available)
        if accelerator.name == "cuda":
            cuda_options.update(accelerator.parameters)
        else:
            providers.append((provider, _tensorrt_options(reader, dict(accelerator.parameters), device_id)))
    if on_gpu and "CUDAExecutionProvider" in available:
        providers.append(("CUDAExecutionProvider", cuda_options))
    for accelerator in accelerators.cpu_execution_accelerator:
        provider = _provider_for(reader, "cpu_execution_accelerator", accelerator.name, CPU_ACCELERATORS, available)
        providers.append((provider, {"device_type": "CPU", **accelerator.parameters}))
    providers.append("CPUExecutionProvider")
    return providers


def _provider_for(reader: _Parameters, field: str, name: str, known: dict[str, str], available: Sequence[str]) -> str:
    provider = known.get(name)
    if provider is None:
        raise reader.error(f"unknown Execution Accelerator '{name}' is requested")
    if provider not in available:
        raise reader.error(
            f"{field} '{name}' needs ONNX Runtime's {provider}, which this onnxruntime does not have "
            f"(available providers: {', '.join(available)})"
        )
    return provider


def _cuda_options(reader: _Parameters, device_id: int) -> dict[str, str]:
    """The CUDA provider options Triton reads from model parameters (validated on every instance kind)."""
    options = {"device_id": str(device_id)}
    search = reader.choice("cudnn_conv_algo_search", CUDNN_CONV_ALGO_SEARCH)
    if search is not None:
        options["cudnn_conv_algo_search"] = search
    strategy = reader.choice("arena_extend_strategy", ARENA_EXTEND_STRATEGIES)
    if strategy is not None:
        options["arena_extend_strategy"] = strategy
    for key in ("gpu_mem_limit", "do_copy_in_default_stream"):
        value = reader.text(key)
        if value is not None:
            options[key] = value
    return options


def _tensorrt_options(reader: _Parameters, parameters: dict[str, str], device_id: int) -> dict[str, str]:
    options = {"device_id": str(device_id)}
    for key, value in parameters.items():
        if key == "precision_mode":
            if value not in _TENSORRT_PRECISIONS:
                raise reader.error(f"unsupported precision mode '{value}' is requested")
            if _TENSORRT_PRECISIONS[value]:
                options[_TENSORRT_PRECISIONS[value]] = "1"
        elif key in _TENSORRT_RENAMED:
            options[_TENSORRT_RENAMED[key]] = value
        elif key.startswith("trt_"):
            options[key] = value
        else:
            raise reader.error(f"unknown parameter '{key}' is provided for TensorRT Execution Accelerator")
    return options


def _uses(providers: list[Any], name: str) -> bool:
    return any((item[0] if isinstance(item, tuple) else item) == name for item in providers)


# The CPU arena registered in this process's ORT environment, by extend strategy: one per process.
_cpu_arena_strategy: list[str] = []


def _use_cpu_arena(model: str, strategy: str, options: Any) -> None:
    """A CPU session's arena is configured only through an allocator registered in the ORT environment, which
    every session of the process shares (a process worker serves one instance, so one model)."""
    import onnxruntime as ort

    if not _cpu_arena_strategy:
        memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(memory, ort.OrtArenaCfg({"arena_extend_strategy": _arena_code(strategy)}))
        _cpu_arena_strategy.append(strategy)
    elif _cpu_arena_strategy[0] != strategy:
        raise ModelLoadError(
            f"model '{model}': arena_extend_strategy {strategy} differs from the {_cpu_arena_strategy[0]} of the CPU "
            "arena that models in this process share; run instances in worker processes to give each its own"
        )
    options.add_session_config_entry("session.use_env_allocators", "1")


def _arena_code(strategy: str) -> int:
    return next(code for code, name in ARENA_EXTEND_STRATEGIES.items() if name == strategy)


def _run_options(reader: _Parameters, options: Any, providers: list[Any]) -> Any | None:
    """Triton sets memory.enable_memory_arena_shrinkage on every run; a device the session has no arena on fails
    the load here rather than every request."""
    import onnxruntime as ort

    shrinkage = reader.text("memory.enable_memory_arena_shrinkage")
    if shrinkage is None:
        return None
    for entry in filter(None, shrinkage.split(";")):
        found = _SHRINK_ENTRY.fullmatch(entry.strip())
        has_arena = found is not None and (
            options.enable_cpu_mem_arena if found.group(1) == "cpu" else _uses(providers, "CUDAExecutionProvider")
        )
        if not has_arena:
            raise reader.error(
                f"memory.enable_memory_arena_shrinkage '{shrinkage}': '{entry}' is not a device whose arena this "
                "session has (cpu:0 with enable_mem_arena, gpu:<id> on CUDA; entries separated by ';')"
            )
    run_options = ort.RunOptions()
    run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", shrinkage)
    return run_options


class _Parameters:
    """A config's string parameters, parsed as Triton's backend utilities parse them."""

    def __init__(self, config: mc.ModelConfig) -> None:
        self._config = config

    def error(self, text: str) -> ModelLoadError:
        return ModelLoadError(f"model '{self._config.name}': {text}")

    def text(self, key: str) -> str | None:
        parameter = self._config.parameters.get(key)
        return None if parameter is None else parameter.string_value

    def integer(self, key: str, default: int) -> int:
        value = self.text(key)
        if value is None:
            return default
        try:
            return int(value)
        except ValueError:
            raise self.error(f"parameter '{key}': failed to convert '{value}' to integral number") from None

    def boolean(self, key: str) -> bool | None:
        value = self.text(key)
        if value is None:
            return None
        parsed = _BOOLEANS.get(value.lower())
        if parsed is None:
            raise self.error(f"parameter '{key}': failed to convert '{value}' to boolean")
        return parsed

    def choice(self, key: str, names: dict[int, str]) -> str | None:
        if self.text(key) is None:
            return None
        code = self.integer(key, 0)
        if code not in names:
            raise self.error(f"unsupported {key} value '{code}' is requested")
        return names[code]

"""A stand-in for CANN's `atc`: checks its command line as ATC's docs define it and writes a real-format `.om`.

Flags follow the ATC user guide's parameter overview (`--flag=value` or `--flag value`, `-flag` read as
`--flag`, `soc-version` as `soc_version`); --model, --framework, --output and --soc_version are required
for --mode=0. --input_shape is `name:d,d;name2:d,...` with names the ONNX graph's inputs; --dynamic_batch_size
takes 2-100 unique gears and needs `-1` as the first dim of every input, and nowhere else, and excludes
--dynamic_image_size, --dynamic_dims and --input_shape_range. Ops outside the default ONNX domain are
refused as ATC refuses ops it has no kernel for. The `.om` is written by om_writer with the ONNX file as its
twin (`<output>.om` and `<output>.om.twin.onnx`, ATC appending `.om`), named and shaped as ATC names them:
inputs unchanged, outputs `<node>:<index>:<onnx name>` at the largest gear, the runtime-filled gear input last.
Each run appends its argv (JSON) to $FAKE_ATC_LOG when set, so tests can count compiles, writes the python3 it
finds (as ATC's operator compiler would run it) to $FAKE_ATC_PYTHON_LOG when set, writes its pid to a
file in $FAKE_ATC_PID_DIR when set, waits until the file $FAKE_ATC_GATE exists when set (a test releases it),
and first sleeps $FAKE_ATC_DELAY_S seconds when set.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import onnx
from onnx import helper, shape_inference

from geserve.backends.acl.description import DYNAMIC_TENSOR_NAME
from tests.fakes.acl.om import twin_path
from tests.fakes.om_writer import write_om

REQUIRED = ("model", "framework", "output", "soc_version")
# The flags this stand-in knows, grouped as the ATC user guide's parameter overview ("参数概览", atctool
# atlasatcparam_16_0003) groups them; written from the docs, not from geserve's own list, so a flag geserve
# passes that ATC lacks fails here too.
BASIC = ("mode", "model", "weight", "framework", "output", "soc_version", "log")  # 基础功能参数
INPUT = (  # 输入相关: input_shape, dynamic gears (16_0018...), input_format (16_0015), input_fp16_nodes
    "input_shape",
    "dynamic_batch_size",
    "dynamic_image_size",
    "dynamic_dims",
    "input_shape_range",
    "input_format",
    "input_fp16_nodes",
    "is_input_adjust_hw_layout",
    "insert_op_conf",
)
OUTPUT = ("out_nodes", "output_type", "is_output_adjust_hw_layout")  # 输出相关 (output_type: 16_0030)
PRECISION = (  # 精度相关 (precision_mode: 16_0068)
    "precision_mode",
    "precision_mode_v2",
    "op_precision_mode",
    "op_select_implmode",
    "optypelist_for_implmode",
    "keep_dtype",
    "modify_mixlist",
    "customize_dtypes",
)
TUNING = (  # 调优/算子编译相关
    "enable_small_channel",
    "fusion_switch_file",
    "buffer_optimize",
    "compression_optimize_conf",
    "sparsity",
    "external_weight",
    "op_debug_level",
    "op_compiler_cache_mode",
    "op_compiler_cache_dir",
    "virtual_type",
    "status_check",
)
KNOWN = frozenset({*BASIC, *INPUT, *OUTPUT, *PRECISION, *TUNING})
# Constrained values. input_format per framework (16_0015): ONNX (5) takes NCHW, NCDHW or ND; with
# --insert_op_conf only NCHW or NHWC (so NCHW for ONNX).
INPUT_FORMATS = {"5": ("NCHW", "NCDHW", "ND")}
AIPP_INPUT_FORMATS = ("NCHW", "NHWC")
PRECISION_MODES = (  # 16_0068
    "force_fp32",
    "cube_fp16in_fp32out",
    "force_fp16",
    "allow_fp32_to_fp16",
    "must_keep_origin_dtype",
    "allow_mix_precision",
    "allow_mix_precision_fp16",
    "allow_mix_precision_bf16",
    "allow_fp32_to_bf16",
)
OUTPUT_TYPES = (  # 16_0030; also per node as node:index:TYPE;...
    "FP32",
    "FP16",
    "UINT8",
    "INT8",
    "UINT16",
    "INT16",
    "UINT32",
    "INT32",
    "UINT64",
    "INT64",
    "DOUBLE",
)
# Options whose value is a file ATC opens (their pages: insert_op_conf, fusion_switch_file, keep_dtype,
# modify_mixlist, customize_dtypes, compression_optimize_conf; op_precision_mode takes an .ini file path).
FILE_VALUED = (
    "insert_op_conf",
    "fusion_switch_file",
    "keep_dtype",
    "modify_mixlist",
    "customize_dtypes",
    "compression_optimize_conf",
    "op_precision_mode",
)
EXCLUSIVE_WITH_BATCH = ("dynamic_image_size", "dynamic_dims", "input_shape_range")
_NUMPY_NAMES = {1: "float32", 10: "float16", 6: "int32", 7: "int64", 2: "uint8", 3: "int8", 9: "bool", 11: "float64"}


class AtcError(Exception):
    pass


def parse_flags(argv: list[str]) -> dict[str, str]:
    flags: dict[str, str] = {}
    items = iter(argv)
    for item in items:
        if not item.startswith("-"):
            raise AtcError(f"E10001: unexpected argument '{item}'")
        name, sep, value = item.lstrip("-").partition("=")
        if not sep:
            value = next(items, "")
        name = name.replace("-", "_")
        if name not in KNOWN:
            raise AtcError(f"E10016: unknown parameter --{name}")
        if name in flags:
            raise AtcError(f"E10001: --{name} given twice")
        if not value:
            raise AtcError(f"E10004: --{name} needs a value")
        flags[name] = value
    return flags


def parse_shapes(text: str) -> dict[str, list[int]]:
    shapes = {}
    for part in text.split(";"):
        name, sep, dims = part.rpartition(":")
        if not sep or not name or not dims:
            raise AtcError(f"E10002: --input_shape entry '{part}' is not name:d1,d2,...")
        try:
            values = [int(d) for d in dims.split(",")]
        except ValueError:
            raise AtcError(f"E10002: --input_shape '{part}' has a dim that is not an integer") from None
        if any(v == 0 or v < -1 for v in values):
            raise AtcError(f"E10002: --input_shape '{part}': dims are positive or -1")
        shapes[name] = values
    return shapes


def parse_gears(text: str) -> list[int]:
    try:
        gears = [int(g) for g in text.split(",")]
    except ValueError:
        raise AtcError(f"E10003: --dynamic_batch_size '{text}' is not a comma-separated list of integers") from None
    if not 2 <= len(gears) <= 100 or len(set(gears)) != len(gears) or min(gears) < 1:
        raise AtcError(f"E10035: --dynamic_batch_size '{text}' needs 2-100 unique positive gears")
    return gears


def compile_model(flags: dict[str, str]) -> Path:
    missing = [f"--{name}" for name in REQUIRED if name not in flags]
    if missing:
        raise AtcError(f"E10008: required parameters {missing} are missing")
    if flags.get("mode", "0") != "0":
        raise AtcError("this stand-in compiles only --mode=0")
    if flags["framework"] != "5":
        raise AtcError(f"E10007: --framework={flags['framework']}: this stand-in compiles ONNX (5) only")
    if not flags["soc_version"].startswith("Ascend"):
        raise AtcError(f"E10004: --soc_version '{flags['soc_version']}' names no Ascend chip")
    check_values(flags)
    model = onnx.load(flags["model"])
    initializers = {tensor.name for tensor in model.graph.initializer}
    graph_inputs = [tensor for tensor in model.graph.input if tensor.name not in initializers]
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            raise AtcError(
                f"E11001: op '{node.name or node.op_type}' of type {node.domain}.{node.op_type} is not supported"
            )
    shapes = parse_shapes(flags["input_shape"]) if "input_shape" in flags else {}
    unknown = sorted(set(shapes) - {tensor.name for tensor in graph_inputs})
    if unknown:
        raise AtcError(f"E10001: --input_shape names {unknown}, which are not inputs of the model")
    check_ranks(graph_inputs, shapes)
    gears = parse_gears(flags["dynamic_batch_size"]) if "dynamic_batch_size" in flags else []
    if gears:
        clash = [name for name in EXCLUSIVE_WITH_BATCH if name in flags]
        if clash:
            raise AtcError(f"E10009: --dynamic_batch_size cannot be combined with {clash}")
        if len(shapes) != len(graph_inputs) or any(s[0] != -1 or -1 in s[1:] for s in shapes.values()):
            raise AtcError("E10018: --dynamic_batch_size needs -1 as the first dim of every input in --input_shape")
    elif any(-1 in s for s in shapes.values()):
        raise AtcError("E10018: --input_shape has -1 but no --dynamic_batch_size (or other gear flag) is given")
    dims = {tensor.name: shapes.get(tensor.name) or _static_dims(tensor) for tensor in graph_inputs}
    description = _describe(model, graph_inputs, dims, gears, flags)
    om = Path(flags["output"] + ".om")
    write_om(om, description)
    twin_path(om).write_bytes(Path(flags["model"]).read_bytes())
    return om


def check_values(flags: dict[str, str]) -> None:
    """The values the docs constrain: formats per framework, precision modes, output types, files that exist."""
    if "input_format" in flags:
        allowed = AIPP_INPUT_FORMATS if "insert_op_conf" in flags else INPUT_FORMATS.get(flags["framework"], ())
        if "insert_op_conf" in flags:
            allowed = tuple(f for f in allowed if f in INPUT_FORMATS.get(flags["framework"], allowed))
        if flags["input_format"] not in allowed:
            raise AtcError(f"E10001: --input_format={flags['input_format']} is not one of {list(allowed)} here")
    if "precision_mode" in flags and flags["precision_mode"] not in PRECISION_MODES:
        raise AtcError(f"E10001: --precision_mode={flags['precision_mode']} is not a precision mode")
    if "precision_mode" in flags and "precision_mode_v2" in flags:
        raise AtcError("E10001: --precision_mode and --precision_mode_v2 cannot be used together")
    if "output_type" in flags:
        value = flags["output_type"].strip('"')
        types = [part.rsplit(":", 1)[-1] for part in value.split(";")] if ":" in value else [value]
        wrong = [t for t in types if t not in OUTPUT_TYPES]
        if wrong:
            raise AtcError(f"E10001: --output_type={flags['output_type']}: {wrong} name no output type")
    for name in FILE_VALUED:
        if name in flags and not os.path.isfile(flags[name]):
            raise AtcError(f"E10001: --{name}={flags[name]}: the file does not exist")


def check_ranks(graph_inputs: list[Any], shapes: dict[str, list[int]]) -> None:
    """ATC's ONNX parser takes an --input_shape entry in place of the graph input's dims only at the graph input's
    rank; a graph input without a shape (or a scalar) takes any rank. Ascend/parser parser/onnx/onnx_data_parser.cc,
    OnnxDataParser::ParseInputFromUser (lines 97-126 at commit fc02ad7: PARAM_INVALID when `designated_dims.size()`
    differs from a non-empty `model_input_dims_v_`). It does not compare the dims themselves: those replace the
    graph's, and a fixed dim given another value fails only where the graph's shape inference disagrees (`_describe`)."""
    for tensor in graph_inputs:
        graph_rank = len(tensor.type.tensor_type.shape.dim)
        given = shapes.get(tensor.name)
        if given is not None and graph_rank and len(given) != graph_rank:
            raise AtcError(
                f"E10001: Value [{','.join(str(d) for d in given)}] for parameter [--input_shape] is invalid. Reason: "
                f"the rank of input '{tensor.name}' given by --input_shape ({len(given)}) does not match the "
                f"model's ({graph_rank})"
            )


def _static_dims(tensor: Any) -> list[int]:
    dims = [d.dim_value for d in tensor.type.tensor_type.shape.dim]
    if any(d <= 0 for d in dims):
        raise AtcError(f"E10001: input '{tensor.name}' has a dynamic dim and --input_shape does not give it")
    return dims


def _describe(
    model: Any, graph_inputs: list[Any], dims: dict[str, list[int]], gears: list[int], flags: dict[str, str]
) -> dict[str, Any]:
    largest = max(gears) if gears else None
    concrete = onnx.ModelProto()
    concrete.CopyFrom(model)
    for tensor in concrete.graph.input:
        if tensor.name in dims:
            shape = [largest if d == -1 else d for d in dims[tensor.name]]
            tensor.CopyFrom(helper.make_tensor_value_info(tensor.name, tensor.type.tensor_type.elem_type, shape))
    del concrete.graph.output[:]
    try:
        inferred = shape_inference.infer_shapes(concrete, strict_mode=True)
    except shape_inference.InferenceError as error:  # GE's InferShape pass fails the compile the same way
        raise AtcError(
            f"E19999: Inner Error! infer shape failed with the shapes --input_shape gives: {error}"
        ) from None
    known = {value.name: value for value in (*inferred.graph.value_info, *inferred.graph.output)}
    producers = {}
    for index, node in enumerate(model.graph.node):
        for position, name in enumerate(node.output):
            producers[name] = (node.name or f"{node.op_type}_{index}", position)
    fmt = flags.get("input_format", "ND")
    inputs = [
        {"name": t.name, "dtype": _NUMPY_NAMES[t.type.tensor_type.elem_type], "dims": dims[t.name], "format": fmt}
        for t in graph_inputs
    ]
    if gears:
        inputs.append({"name": DYNAMIC_TENSOR_NAME, "dtype": "int32", "dims": [1], "format": "ND"})
    outputs = []
    for tensor in model.graph.output:
        value = known[tensor.name]
        node, position = producers[tensor.name]
        outputs.append(
            {
                "name": f"{node}:{position}:{tensor.name}",
                "dtype": _NUMPY_NAMES[tensor.type.tensor_type.elem_type],
                "dims": [d.dim_value for d in value.type.tensor_type.shape.dim],
                "format": "ND",
            }
        )
    return {
        "name": Path(flags["output"]).name,
        "soc_version": flags["soc_version"],
        "inputs": inputs,
        "outputs": outputs,
        "dynamic": {"dynamic_batch": sorted(gears), "data_name_order": [t.name for t in graph_inputs]}
        if gears
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    log = os.environ.get("FAKE_ATC_LOG")
    if log:
        with open(log, "a") as stream:
            stream.write(json.dumps(arguments) + "\n")
    pids = os.environ.get("FAKE_ATC_PID_DIR")
    if pids:
        Path(pids, f"{os.getpid()}.pid").write_text(str(os.getpid()))
    report = os.environ.get("FAKE_ATC_PYTHON_LOG")
    if report:  # the interpreter ATC's operator compiler would run in: `python3` on PATH (see report_python)
        Path(report).write_text(json.dumps(report_python()))
    gate = os.environ.get("FAKE_ATC_GATE")
    while gate and not os.path.exists(gate):  # a compile that lasts until the test lets it finish
        time.sleep(0.05)
    time.sleep(float(os.environ.get("FAKE_ATC_DELAY_S", "0")))  # a real compile takes minutes
    try:
        om = compile_model(parse_flags(arguments))
    except Exception as error:  # ATC reports every failure, its own or the model's, as a failed run
        sys.stdout.write(f"ATC start working now, please wait for a moment.\n{error}\nATC run failed\n")
        return 1
    sys.stdout.write(f"ATC start working now, please wait for a moment.\nATC run success: {om}\n")
    return 0


def report_python() -> dict[str, Any]:
    """What ATC's operator compiler would run in: the `python3` on PATH (ATC runs `python3-config --prefix`, then
    TBE in that interpreter), its prefix and which of CANN's packages it imports, and this process's VIRTUAL_ENV."""
    import shutil
    import subprocess

    python3 = shutil.which("python3")
    found: dict[str, Any] = {"python3": python3, "virtual_env": os.environ.get("VIRTUAL_ENV")}
    if python3 is not None:
        probe = (
            "import importlib.util, json, sys; print(json.dumps({'prefix': sys.prefix, 'missing': [m for m in "
            "('numpy', 'decorator', 'attrs', 'psutil', 'scipy', 'sympy') if importlib.util.find_spec(m) is None]}))"
        )
        done = subprocess.run([python3, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
        found.update(json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-300:]})
    return found


def install(bin_dir: Path) -> Path:
    """An executable `atc` in `bin_dir` that runs this module with the test's interpreter."""
    root = Path(__file__).resolve().parents[2]
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "atc"
    script.write_text(
        f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(root)!r})\n"
        "from tests.fakes.atc import main\nsys.exit(main())\n"
    )
    script.chmod(0o755)
    return script


def install_cann(home: Path, version: str) -> Path:
    """A CANN toolkit folder as the installer leaves it: `<arch>-linux/ascend_toolkit_install.info`."""
    import platform

    info = home / f"{platform.machine()}-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir(parents=True, exist_ok=True)
    info.write_text(f"package_name=Ascend-cann-toolkit\nversion={version}\narch={platform.machine()}\n")
    return home

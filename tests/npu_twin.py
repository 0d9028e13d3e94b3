"""How the NPU tests hold an .om's answers against its ONNX twin: feeding the twin, and the fp16 tolerance."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from geserve.backends.acl import names

# ATC compiles in fp16 unless told otherwise. --precision_mode's default for inference is force_fp16, "算子支持
# fp16和fp32时,强制选择fp16" ("其他推理场景: force_fp16", CANN 6.3's option reference,
# https://hiascend.com/document/detail/zh/canncommercial/63RC2/devtools/auxiliarydevtool/aoepar_16_046.html; still
# "force_fp16(默认值)" in CANN 9.0's, .../canncommercial/900/devaids/aoe/aoepar_16_042.html, for the option ATC
# documents at .../canncommercial/latest/devaids/atctool/atlasatcparam_16_0068.html), and --precision_mode_v2's
# is fp16 (CANN 7.0 ATC, .../CANNCommunityEdition/700alpha003/infacldevg/atctool/atlasatc_16_0097.html). Training
# SoCs default to allow_fp32_to_fp16, which still runs matrix ops in fp16. So weights, inputs and intermediate
# results may each be rounded to fp16's 11-bit significand (2^-11 ~ 4.9e-4 per rounding), and a network compounds
# tens of such roundings and fp16 accumulations: 2 % of the value is the margin held here.
FP16_RTOL = 2e-2
# Elements near zero (a logit, a sum of terms that cancel) keep the error of the larger terms they were made of,
# which scales with the tensor, not with the element: the absolute margin is 2 % of the tensor's largest value.
FP16_ATOL_OF_SCALE = 2e-2
# fp16's smallest normal number: the floor of that scale, so that an all-zero reference does not demand exactness
# of rounding noise.
FP16_TINY = float(np.finfo(np.float16).tiny)

# onnxruntime's type strings (NodeArg.type) for the tensor types an .om can take or give.
ORT_DTYPES: dict[str, type[np.generic]] = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int8)": np.int8,
    "tensor(int16)": np.int16,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
}


class TwinArg(Protocol):
    """onnxruntime.NodeArg, as far as the comparison reads it."""

    @property
    def name(self) -> str: ...
    @property
    def type(self) -> str: ...
    @property
    def shape(self) -> Sequence[Any]: ...


class Twin(Protocol):
    """onnxruntime.InferenceSession, as far as the comparison uses it."""

    def get_inputs(self) -> Sequence[TwinArg]: ...
    def get_outputs(self) -> Sequence[TwinArg]: ...
    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]) -> Sequence[Any]: ...


def open_twin(path: str) -> Twin:
    import onnxruntime as ort

    session: Twin = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session


def first_device_id(devices: str) -> int:
    """The first logical id GESERVE_NPU_DEVICES lists, the device the tests open ('' means 0, as the server's)."""
    listed = [item.strip() for item in devices.split(",") if item.strip()]
    return int(listed[0]) if listed else 0


def twin_feed(twin: Twin, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The server's inputs as the twin takes them: by name, or by position where the twin names them otherwise
    (an .om keeps its graph's input names, a hand-written config may not), each cast to the twin's dtype (an
    .om compiled with fp16 inputs against the fp32 model it came from)."""
    twin_inputs = list(twin.get_inputs())
    if len(twin_inputs) != len(arrays):
        raise ValueError(f"the ONNX twin takes {len(twin_inputs)} inputs, the model {len(arrays)}: {sorted(arrays)}")
    if all(arg.name in arrays for arg in twin_inputs):
        values = [arrays[arg.name] for arg in twin_inputs]
    else:
        values = list(arrays.values())
    feed = {}
    for arg, value in zip(twin_inputs, values, strict=True):
        if arg.type not in ORT_DTYPES:
            raise ValueError(f"the ONNX twin's input '{arg.name}' is a {arg.type}, which no .om takes")
        feed[arg.name] = value.astype(ORT_DTYPES[arg.type], copy=False)
    return feed


def rows_per_run(twin: Twin, batch: int) -> int:
    """How many rows of a batch one twin run takes: all of them when the twin's first dim is dynamic, its fixed
    size when it has one (a twin exported with batch 1 beside an .om served with batches of N); 0 (the whole
    tensor) for a model without a batch dim."""
    if batch == 0:
        return 0
    fixed = {arg.shape[0] for arg in twin.get_inputs() if arg.shape and isinstance(arg.shape[0], int)}
    if not fixed:
        return batch
    if len(fixed) > 1:
        raise ValueError(f"the ONNX twin's inputs fix different batch sizes {sorted(fixed)}")
    rows = fixed.pop()
    if rows <= 0:
        raise ValueError(f"the ONNX twin's batch dim is fixed at {rows}")
    return rows


def run_twin(twin: Twin, arrays: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
    """The twin's outputs for the server's inputs, by the twin's output names, run in slices of rows_per_run rows
    and joined along the batch dim. A last slice shorter than the twin's fixed batch (a batch-8 twin beside gears
    1..8) is padded with copies of its last row, whose answers are dropped: rows of a batch are independent."""
    feed = twin_feed(twin, arrays)
    output_names = [arg.name for arg in twin.get_outputs()]
    rows = rows_per_run(twin, batch)
    if rows in (0, batch):
        return dict(zip(output_names, (np.asarray(value) for value in twin.run(None, feed)), strict=True))
    pieces: list[list[np.ndarray]] = [[] for _ in output_names]
    for start in range(0, batch, rows):
        taken = min(rows, batch - start)
        chunk = {name: _padded(value[start : start + taken], rows) for name, value in feed.items()}
        for index, value in enumerate(twin.run(None, chunk)):
            pieces[index].append(np.asarray(value)[:taken])
    return {name: np.concatenate(pieces[index], axis=0) for index, name in enumerate(output_names)}


def _padded(rows: np.ndarray, count: int) -> np.ndarray:
    if len(rows) == count:
        return rows
    return np.concatenate([rows, np.repeat(rows[-1:], count - len(rows), axis=0)], axis=0)


def by_config_names(config: Mapping[str, Any], values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The twin's outputs keyed by the config's output names: by that name, by the source name inside the full
    name ATC gave the output (`<node>:<index>:<onnx name>`), else by position."""
    onnx_names = list(values)
    parameters = config.get("parameters", {})
    result = {}
    for index, output in enumerate(config["output"]):
        name = output["name"]
        full = parameters.get(names.FULL_NAME_PARAMETER.format(name), {}).get("string_value", name)
        for candidate in (name, names.short_name(full)):
            if candidate is not None and candidate in values:
                result[name] = values[candidate]
                break
        else:
            result[name] = values[onnx_names[index]]
    return result


def assert_matches_twin(name: str, output: np.ndarray, reference: np.ndarray) -> None:
    """`output` (the NPU's) agrees with `reference` (onnxruntime's) within fp16 rounding; other types exactly."""
    assert output.shape == reference.shape, f"output '{name}': shape {output.shape}, the twin's {reference.shape}"
    if np.issubdtype(output.dtype, np.floating) or np.issubdtype(reference.dtype, np.floating):
        expected = reference.astype(np.float64)
        scale = max(float(np.max(np.abs(expected), initial=0.0)), FP16_TINY)
        np.testing.assert_allclose(
            output.astype(np.float64),
            expected,
            rtol=FP16_RTOL,
            atol=FP16_ATOL_OF_SCALE * scale,
            err_msg=f"output '{name}' against the ONNX twin",
        )
    else:
        np.testing.assert_array_equal(output, reference, err_msg=f"output '{name}' against the ONNX twin")

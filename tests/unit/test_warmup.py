"""model_warmup: samples built from the config as Triton builds them, and run on every instance."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geserve.batching.warmup import WarmupSample, warm_up
from geserve.core import warmup
from geserve.core.models import ModelVersion
from geserve.errors import InternalError, ModelLoadError
from geserve.repository.config import parse_config_text
from geserve.residency import SharedTensor
from geserve.workers.batch import Batch
from geserve.workers.messages import BatchResult
from tests.unit.builders import model_version

BATCHED = """
name: "m"
max_batch_size: 4
input [
  { name: "F" data_type: TYPE_FP32 dims: [ 2, -1 ] },
  { name: "S" data_type: TYPE_STRING dims: [ 2 ] },
  { name: "B" data_type: TYPE_BOOL dims: [ 3 ] }
]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""
SAMPLE = """
model_warmup [ {{
  name: "s" batch_size: {batch_size} count: {count}
  inputs {{ key: "F" value: {{ data_type: TYPE_FP32 dims: [ 2, 3 ] {f} }} }}
  inputs {{ key: "S" value: {{ data_type: TYPE_STRING dims: [ 2 ] {s} }} }}
  inputs {{ key: "B" value: {{ data_type: TYPE_BOOL dims: [ 3 ] random_data: true }} }}
  {extra}
}} ]
"""


def _model(
    batch_size: int = 2, count: int = 3, f: str = "zero_data: true", s: str = "zero_data: true", extra: str = ""
) -> ModelVersion:
    text = BATCHED + SAMPLE.format(batch_size=batch_size, count=count, f=f, s=s, extra=extra)
    return model_version(parse_config_text(text, "c"))


def _samples(tmp_path: Path, **fields: Any) -> list[WarmupSample]:
    return warmup.build_samples(_model(**fields), tmp_path)


def _load_error(tmp_path: Path, **fields: Any) -> str:
    with pytest.raises(ModelLoadError) as raised:
        _samples(tmp_path, **fields)
    return raised.value.message


def test_zero_and_random_data_make_batch_size_requests_of_one_row(tmp_path: Path) -> None:
    (sample,) = _samples(tmp_path, batch_size=2, count=3)
    assert (sample.name, sample.count, sample.batch_size, sample.output_names) == ("s", 3, 2, ("Y",))
    np.testing.assert_array_equal(sample.inputs["F"].array, np.zeros((1, 2, 3), np.float32))
    assert sample.inputs["S"].array.tolist() == [[b"", b""]]  # Triton's zero data for strings: empty elements
    assert sample.inputs["B"].shape == (1, 3) and sample.inputs["B"].dtype == np.bool_
    assert sample.inputs["B"].array.shape == (1, 3) and sample.inputs["B"].array.dtype == np.bool_
    batch = sample.batch()
    assert [len(blocks) for blocks in batch.inputs.values()] == [2, 2, 2]
    assert [info.rows for info in batch.requests] == [1, 1]


def test_count_zero_runs_once_and_batch_size_zero_is_skipped(tmp_path: Path) -> None:
    (sample,) = _samples(tmp_path, count=0)
    assert sample.count == 1
    assert _samples(tmp_path, batch_size=0) == []


def test_input_data_file_is_read_from_the_warmup_folder(tmp_path: Path) -> None:
    folder = tmp_path / "warmup"
    folder.mkdir()
    values = np.arange(6, dtype="<f4")
    (folder / "f.bin").write_bytes(values.tobytes() + b"extra bytes are not read")
    (folder / "s.bin").write_bytes(b"".join(struct.pack("<I", len(v)) + v for v in (b"ab", b"c")))
    (sample,) = _samples(tmp_path, f='input_data_file: "f.bin"', s='input_data_file: "s.bin"')
    np.testing.assert_array_equal(sample.inputs["F"].array, values.reshape(1, 2, 3))
    assert sample.inputs["S"].array.tolist() == [[b"ab", b"c"]]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"batch_size": 5}, "failed to run warmup sample 's': batch size 5 for 'm', max allowed is 4; "),
        ({"f": ""}, "warmup setting expects input 'F' to have input_data_type set"),
        (
            {
                "f": "zero_data: true",
                "extra": 'inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } }',
            },
            "unexpected inference input 'X' for model 'm'",
        ),
        (
            {"f": 'input_data_file: "short.bin"'},
            "warmup setting expects 24 bytes, but the data provided from short.bin only has 4 bytes",
        ),
        ({"f": 'input_data_file: "../config.pbtxt"'}, "must lie in the model's 'warmup' folder"),
    ],
)
def test_samples_triton_cannot_build_fail_the_load(tmp_path: Path, fields: dict[str, Any], message: str) -> None:
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "short.bin").write_bytes(b"1234")
    assert message in _load_error(tmp_path, **fields)


def test_missing_file_variable_dims_wrong_type_and_shape(tmp_path: Path) -> None:
    missing = _load_error(tmp_path, f='input_data_file: "absent.bin"')
    assert (
        missing == f"failed to open text file for read {tmp_path / 'warmup' / 'absent.bin'}: No such file or directory"
    )
    text = (
        BATCHED
        + """
model_warmup [ { name: "v" batch_size: 1 inputs { key: "F" value: { data_type: TYPE_FP32 dims: [ 2, -1 ] zero_data: true } } } ]
"""
    )
    with pytest.raises(ModelLoadError, match="expects all variable-size dimensions are specified for input 'F'"):
        warmup.build_samples(model_version(parse_config_text(text, "c")), tmp_path)
    text = (
        BATCHED
        + """
model_warmup [ { name: "u" batch_size: 1 inputs { key: "F" value: { dims: [ 2, 3 ] zero_data: true } } } ]
"""
    )
    with pytest.raises(
        ModelLoadError, match="inference input 'F' data-type is 'INVALID', but model 'm' expects 'FP32'"
    ):
        warmup.build_samples(model_version(parse_config_text(text, "c")), tmp_path)
    text = (
        BATCHED
        + """
model_warmup [ { name: "t" batch_size: 1
  inputs { key: "F" value: { data_type: TYPE_INT32 dims: [ 2, 3 ] zero_data: true } } } ]
"""
    )
    with pytest.raises(ModelLoadError, match="inference input 'F' data-type is 'INT32', but model 'm' expects 'FP32'"):
        warmup.build_samples(model_version(parse_config_text(text, "c")), tmp_path)
    text = (
        BATCHED
        + """
model_warmup [ { name: "t" batch_size: 1 inputs { key: "F" value: { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } } } ]
"""
    )
    with pytest.raises(
        ModelLoadError, match=r"unexpected shape for input 'F' for model 'm'. Expected \[-1,2,-1\], got \[1,3\]"
    ):
        warmup.build_samples(model_version(parse_config_text(text, "c")), tmp_path)


def test_a_model_without_batching_takes_one_request_of_the_dims_as_given(tmp_path: Path) -> None:
    text = """
name: "n" max_batch_size: 0
input [ { name: "I" data_type: TYPE_INT32 dims: [ 4 ] } ]
output [ { name: "O" data_type: TYPE_INT32 dims: [ 4 ] } ]
model_warmup [ { name: "one" batch_size: 1 inputs { key: "I" value: { data_type: TYPE_INT32 dims: [ 4 ] zero_data: true } } },
               { name: "two" batch_size: 2 inputs { key: "I" value: { data_type: TYPE_INT32 dims: [ 4 ] zero_data: true } } } ]
"""
    model = model_version(parse_config_text(text, "c"))
    with pytest.raises(
        ModelLoadError, match="failed to run warmup sample 'two': batch size 2 for 'n', max allowed is 0; "
    ):
        warmup.build_samples(model, tmp_path)
    del model.config.model_warmup[1]
    (sample,) = warmup.build_samples(model, tmp_path)
    assert sample.inputs["I"].shape == (4,)


def test_ensembles_refuse_model_warmup() -> None:
    config = parse_config_text('name: "e" platform: "ensemble" model_warmup [ { name: "w" batch_size: 1 } ]', "c")
    with pytest.raises(ModelLoadError, match="model_warmup can not be specified for ensemble 'e'"):
        warmup.refuse_for_ensemble(config)


class _Instances:
    """Instances that record which one ran each batch, and fail on request."""

    def __init__(self, size: int, failing: frozenset[int] = frozenset()) -> None:
        self.size = size
        self.runs: list[int] = []
        self._failing = failing

    def dispatch_to(self, index: int, batch: Batch) -> Coroutine[Any, Any, BatchResult]:
        return self._run(index, batch)

    async def _run(self, index: int, batch: Batch) -> BatchResult:
        self.runs.append(index)
        if index in self._failing:
            return BatchResult(tuple(InternalError("boom") for _ in batch.requests), 0, 0)
        return BatchResult(tuple({} for _ in batch.requests), 0, 0)


def _sample(name: str, count: int, batch_size: int = 2) -> WarmupSample:
    return WarmupSample(name, count, batch_size, {"I": SharedTensor.local(np.zeros((1, 2), np.float32))}, ("O",))


def test_every_instance_runs_every_sample_count_times() -> None:
    instances = _Instances(3)
    asyncio.run(warm_up("m", instances, [_sample("a", 2), _sample("b", 1)]))
    assert sorted(instances.runs) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_a_failing_sample_fails_with_every_request_error() -> None:
    instances = _Instances(2, failing=frozenset({1}))
    with pytest.raises(ModelLoadError) as raised:
        asyncio.run(warm_up("m", instances, [_sample("a", 3), _sample("b", 1)]))
    assert raised.value.message == "failed to run warmup sample 'a': boom; boom; "
    assert instances.runs.count(1) == 1  # the failing instance stops at its first failure
    assert instances.runs.count(0) == 4  # the others finish


def test_a_sequence_control_input_is_passed_as_given(tmp_path: Path) -> None:
    text = """
name: "q" max_batch_size: 2
input [ { name: "I" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "O" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching { control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ] }
model_warmup [ { name: "first" batch_size: 1
  inputs { key: "I" value: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } }
  inputs { key: "START" value: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } } ]
"""
    (sample,) = warmup.build_samples(model_version(parse_config_text(text, "c")), tmp_path)
    assert sample.inputs["I"].shape == (1, 1)
    assert sample.inputs["START"].shape == (1, 1) and sample.inputs["START"].dtype == np.int32
    assert sample.inputs["START"].array.tolist() == [[0]]


class _Streaming(_Instances):
    """A decoupled model's instance: each request answers on its stream, the second with an error."""

    async def _run(self, index: int, batch: Batch) -> BatchResult:
        self.runs.append(index)
        for request, stream in batch.streams.items():
            stream.put({"O": SharedTensor.local(np.zeros(1))}, None, False)
            stream.put(None, InternalError(f"stream {request} broke") if request == 1 else None, True)
        return BatchResult(tuple({} for _ in batch.requests), 0, 0)


def test_a_decoupled_sample_reads_every_stream_to_its_end() -> None:
    inputs = {"I": SharedTensor.local(np.zeros((1, 2), np.float32))}
    decoupled = WarmupSample("d", 1, 2, inputs, ("O",), decoupled=True)
    with pytest.raises(ModelLoadError) as raised:
        asyncio.run(warm_up("m", _Streaming(1), [decoupled]))
    assert raised.value.message == "failed to run warmup sample 'd': stream 1 broke; "

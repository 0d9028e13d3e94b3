"""Ragged batching, passive instances and KIND_MODEL, and the batching fields geserve refuses, through a real
geserve and tritonclient."""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, copy_model

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

# Reports, with each request's own doubled input, how many requests shared its execute.
RAGGED_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        seen = np.array([[len(requests)]], dtype=np.int32)
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            outputs = [pb_utils.Tensor("OUT", data * 2), pb_utils.Tensor("BATCH", seen)]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
"""

# The batch goes once three rows are queued (the preferred size), however their lengths differ.
RAGGED_CONFIG = """
name: "ragged"
backend: "python"
max_batch_size: 8
dynamic_batching { preferred_batch_size: [ 3 ] max_queue_delay_microseconds: 10000000 }
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
output [
  { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] }
]
"""

# Records what initialize was told in a file per instance, and answers with its instance's name and kind.
INSTANCE_MODEL = """
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        folder = Path(json.loads(args["model_config"])["parameters"]["record_dir"]["string_value"])
        self.name = args["model_instance_name"]
        self.kind = args["model_instance_kind"]
        record = {"kind": self.kind, "device_id": args["model_instance_device_id"]}
        (folder / f"{args['model_name']}.{self.name}.json").write_text(json.dumps(record))

    def execute(self, requests):
        name = np.array([self.name.encode()], dtype=np.object_)
        kind = np.array([self.kind.encode()], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("NAME", name), pb_utils.Tensor("KIND", kind)]) for _ in requests]
"""

INSTANCE_CONFIG = """
name: "{name}"
backend: "python"
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [
  {{ name: "NAME" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "KIND" data_type: TYPE_STRING dims: [ 1 ] }}
]
parameters {{ key: "record_dir" value {{ string_value: "{records}" }} }}
instance_group [ {groups} ]
{extra}
"""

INSTANCE_MODELS = {
    "passive": '{ name: "active" kind: KIND_CPU }, { name: "standby" kind: KIND_CPU passive: true }',
    "all_passive": '{ name: "standby" kind: KIND_CPU passive: true }',
    "kind_model": '{ name: "placed" kind: KIND_MODEL }',
}

# Models that must fail their load, and what the reason says.
LOAD_ERRORS = {
    "ragged_onnx": "model 'ragged_onnx': input 'INPUT0' sets allow_ragged_batch, which geserve's 'onnxruntime' "
    "backend does not support",
    "batch_input_python": "model 'batch_input_python': batch_input of kind BATCH_ACCUMULATED_ELEMENT_COUNT "
    "(target 'INDEX') is not supported by geserve's 'python' backend: as under Triton's python backend, execute "
    "receives each request with its own inputs",
    "kind_model_gpus": "instance group placed of model kind_model_gpus has kind KIND_MODEL but specifies one or "
    "more GPUs",
}


def _write_python_model(repository: Path, name: str, code: str, config: str) -> None:
    folder = repository / name
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(textwrap.dedent(code))
    (folder / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("records")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, records: Path) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("ragged")
    repository = root / "models"
    _write_python_model(repository, "ragged", RAGGED_MODEL, RAGGED_CONFIG)
    for name, groups in INSTANCE_MODELS.items():
        config = INSTANCE_CONFIG.format(name=name, records=records, groups=groups, extra="")
        _write_python_model(repository, name, INSTANCE_MODEL, config)
    ragged_onnx = copy_model("simple", repository, "ragged_onnx") / "config.pbtxt"
    text = ragged_onnx.read_text().replace('name: "simple"', 'name: "ragged_onnx"')
    ragged_onnx.write_text(text.replace("dims: [ 16 ]", "dims: [ 16 ]\n    allow_ragged_batch: true", 1))
    batch_input = RAGGED_CONFIG.replace('"ragged"', '"batch_input_python"') + (
        'batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "INDEX" data_type: TYPE_FP32 '
        'source_input: "IN" } ]'
    )
    _write_python_model(repository, "batch_input_python", RAGGED_MODEL, batch_input)
    gpus = INSTANCE_CONFIG.format(
        name="kind_model_gpus", records=records, groups='{ name: "placed" kind: KIND_MODEL gpus: [ 0 ] }', extra=""
    )
    _write_python_model(repository, "kind_model_gpus", INSTANCE_MODEL, gpus)
    process = GeserveProcess(
        root / "geserve.log", f"--model-repository={repository}", "--exit-on-error=false"
    ).wait_live()
    yield process
    assert process.stop() == 0, process.log()


def _ragged_input(length: int, start: float) -> httpclient.InferInput:
    data = np.arange(start, start + length, dtype=np.float32).reshape(1, length)
    tensor = httpclient.InferInput("IN", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data, binary_data=True)
    return tensor


def _infer_ragged(server: GeserveProcess, lengths: tuple[int, ...]) -> list[httpclient.InferResult]:
    client = httpclient.InferenceServerClient(server.url, concurrency=len(lengths))
    try:
        pending = [client.async_infer("ragged", [_ragged_input(n, 10.0 * i)]) for i, n in enumerate(lengths)]
        return [request.get_result() for request in pending]
    finally:
        client.close()


def test_requests_of_different_lengths_run_in_one_execute_each_with_its_own_values(server: GeserveProcess) -> None:
    lengths = (2, 5, 3)
    results = _infer_ragged(server, lengths)
    for index, (length, result) in enumerate(zip(lengths, results, strict=True)):
        expected = 2 * np.arange(10.0 * index, 10.0 * index + length, dtype=np.float32).reshape(1, length)
        np.testing.assert_array_equal(result.as_numpy("OUT"), expected)
        assert result.as_numpy("BATCH").tolist() == [[3]]


def test_batching_fields_geserve_cannot_serve_fail_their_load_naming_the_field(server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(server.url)
    index = {entry["name"]: entry for entry in http.get_model_repository_index()}
    for name, expected in LOAD_ERRORS.items():
        assert index[name]["state"] == "UNAVAILABLE", index[name]
        assert expected in index[name]["reason"], index[name]["reason"]
    with pytest.raises(InferenceServerException):
        http.infer("ragged_onnx", [_ragged_input(16, 0.0)])
    results = _infer_ragged(server, (4, 1, 2))  # the servable model still serves
    assert [result.as_numpy("OUT").shape for result in results] == [(1, 4), (1, 1), (1, 2)]


def _instance_infer(server: GeserveProcess, model: str) -> tuple[str, str]:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
    result = client.infer(model, [tensor])
    return result.as_numpy("NAME")[0].decode(), result.as_numpy("KIND")[0].decode()


def _initialized(records: Path, model: str) -> dict[str, dict[str, str]]:
    return {
        path.name.removeprefix(f"{model}.").removesuffix(".json"): json.loads(path.read_text())
        for path in records.glob(f"{model}.*.json")
    }


def test_a_passive_instance_is_initialized_but_never_executes(server: GeserveProcess, records: Path) -> None:
    assert set(_initialized(records, "passive")) == {"active_0", "standby_0"}
    answered = {_instance_infer(server, "passive")[0] for _ in range(6)}
    assert answered == {"active_0"}


def test_a_version_whose_instances_are_all_passive_is_ready_and_refuses_requests(
    server: GeserveProcess, records: Path
) -> None:
    assert set(_initialized(records, "all_passive")) == {"standby_0"}
    assert httpclient.InferenceServerClient(server.url).is_model_ready("all_passive")
    with pytest.raises(
        InferenceServerException,
        match=re.escape("model 'all_passive' has no instance that takes requests: every instance group is passive"),
    ):
        _instance_infer(server, "all_passive")
    assert _instance_infer(server, "passive")[0] == "active_0"


def test_kind_model_instances_are_told_model_and_device_0_as_triton_tells_them(
    server: GeserveProcess, records: Path
) -> None:
    assert _initialized(records, "kind_model") == {"placed_0": {"kind": "MODEL", "device_id": "0"}}
    assert _instance_infer(server, "kind_model") == ("placed_0", "MODEL")

"""Real `.om` files and configs as users write them, served through tritonclient against the pyACL simulator."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.e2e.test_ascend import start_on_simulated_npus
from tests.fakes.om_models import resnet50_description
from tests.fakes.om_writer import write_om
from tests.support import ROOT, GeserveProcess

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

SAMPLES = ROOT / "tests" / "data" / "om-samples"

DDNET_SHORT_NAMES = """
name: "ddnet_short"
backend: "ge"
max_batch_size: 1
input [
  { name: "Input" data_type: TYPE_FP32 dims: [ 32, 105 ] },
  { name: "Input_1" data_type: TYPE_FP32 dims: [ 32, 15, 2 ] }
]
output [ { name: "model_1/dense_2/Softmax" data_type: TYPE_FP32 dims: [ 21 ] } ]
instance_group [ { kind: KIND_GPU count: 1 } ]
"""
# The shape of the Triton GE backend's example configs: platform and backend both "ge", no
# max_batch_size, FORMAT_NCHW, short output names, model_path relative to the repository.
GE_BACKEND_CONFIG = """
name: "resnet50_v2"
platform: "ge"
backend: "ge"
input [
  {
    name: "input"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
  }
]
output [
  {
    name: "output"
    data_type: TYPE_FP32
    dims: [ 1000 ]
  }
]
dynamic_batching {
  preferred_batch_size: [ 4, 8, 16 ]
  max_queue_delay_microseconds: 100
}
instance_group [ { count: 1 kind: KIND_GPU } ]
parameters {
  key: "model_path"
  value: { string_value: "resnet50_v2/resnet50_v2.om" }
}
"""


def _documented_config() -> str:
    """The example config.pbtxt of docs/ascend.md, as printed there."""
    text = (ROOT / "docs" / "ascend.md").read_text()
    section = text[text.index("**Configure**") :]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block is not None
    return block.group(1)


def _repository(root: Path) -> Path:
    repository = root / "models"
    # The synthetic sample as the writer lays it out, with the `_dynamic_output_dims` GE writes.
    synthetic = json.loads((SAMPLES / "expected.json").read_text())["synthetic_dynbatch.om"]
    write_om(repository / "synthetic_written" / "1" / "model.om", synthetic)
    for name, file in (("synthetic", "synthetic_dynbatch.om"), ("ddnet_auto", "ddnet_out.om")):
        (repository / name / "1").mkdir(parents=True)
        shutil.copy(SAMPLES / file, repository / name / "1" / "model.om")
    (repository / "ddnet_short" / "1").mkdir(parents=True)
    shutil.copy(SAMPLES / "ddnet_out.om", repository / "ddnet_short" / "1" / "model.om")
    (repository / "ddnet_short" / "config.pbtxt").write_text(DDNET_SHORT_NAMES)
    write_om(repository / "resnet50_v2" / "resnet50_v2.om", resnet50_description([1, 2, 4, 8, 16], "resnet50_v2"))
    (repository / "resnet50_v2" / "1").mkdir(parents=True)
    (repository / "resnet50_v2" / "config.pbtxt").write_text(GE_BACKEND_CONFIG)
    write_om(repository / "resnet50" / "1" / "resnet50_bs16.om", resnet50_description([1, 2, 4, 8, 16], "resnet50_v2"))
    (repository / "resnet50" / "config.pbtxt").write_text(_documented_config())
    return repository


@pytest.fixture(scope="module")
def files_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("ascend-files")
    # The synthetic sample is refused at load; the others serve.
    process = start_on_simulated_npus(root, _repository(root), "--exit-on-error=false")
    yield process
    assert process.stop() == 0, process.log()


def _row_sums(x: np.ndarray) -> np.ndarray:
    """What the simulator answers without an ONNX twin: each output row filled with its input row's sum."""
    return x.reshape(x.shape[0], -1).sum(axis=1)


def _infer_both(server: GeserveProcess, model: str, inputs: dict[str, np.ndarray], output: str) -> list[np.ndarray]:
    http = httpclient.InferenceServerClient(server.url)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    http_inputs, grpc_inputs = [], []
    for name, array in inputs.items():
        http_inputs.append(httpclient.InferInput(name, list(array.shape), "FP32"))
        http_inputs[-1].set_data_from_numpy(array, binary_data=True)
        grpc_inputs.append(grpcclient.InferInput(name, list(array.shape), "FP32"))
        grpc_inputs[-1].set_data_from_numpy(array)
    return [
        http.infer(model, http_inputs).as_numpy(output),
        grpc.infer(model, grpc_inputs).as_numpy(output),
    ]


def test_synthetic_gear_model_is_configured_from_its_gears(files_server: GeserveProcess) -> None:
    config = httpclient.InferenceServerClient(files_server.url).get_model_config("synthetic_written")
    assert config["max_batch_size"] == 8
    assert config["dynamic_batching"]["preferred_batch_size"] == [1, 2, 4, 8]
    assert [(t["name"], t["dims"]) for t in config["output"]] == [("prob", [1000])]
    assert config["parameters"]["om_output_name.prob"]["string_value"] == "prob:0:prob"


def test_synthetic_gear_model_at_every_gear_and_between(files_server: GeserveProcess) -> None:
    """The synthetic sample's model as the writer lays it out, GE's `_dynamic_output_dims` included."""
    for rows in range(1, 9):
        x = np.random.default_rng(rows).normal(size=(rows, 3, 224, 224)).astype(np.float32)
        for answer in _infer_both(files_server, "synthetic_written", {"input": x}, "prob"):
            assert answer.shape == (rows, 1000)  # padding rows never reach the client
            np.testing.assert_allclose(answer, np.repeat(_row_sums(x)[:, None], 1000, axis=1), rtol=1e-6)


def test_the_synthetic_samples_own_dynamic_output_dims_refuse_it_at_load(files_server: GeserveProcess) -> None:
    """The sample's NetOutput names no dims for output 0 at any gear (its `_dynamic_output_dims` are not
    laid out as GE's "<gear>,<output>,<dims>"), so aclmdlGetCurOutputDims would fail every batch: the
    model is refused at load, saying why and how to fix it, and the other models keep serving."""
    http = httpclient.InferenceServerClient(files_server.url)
    assert not http.is_model_ready("synthetic")
    reason = {entry["name"]: entry.get("reason", "") for entry in http.get_model_repository_index()}["synthetic"]
    assert re.search(r"'[^']*synthetic/1/model\.om' has batch gears \[1, 2, 4, 8\]", reason), reason
    assert "give no dims for output 0 'prob:0:prob' at batch sizes 1, 2, 4, 8" in reason, reason
    assert "aclmdlGetCurOutputDims cannot give those outputs' shapes once a batch size is set" in reason, reason
    assert "compile the model again with ATC" in reason, reason
    x = np.zeros((2, 3, 224, 224), dtype=np.float32)
    request = httpclient.InferInput("input", list(x.shape), "FP32")
    request.set_data_from_numpy(x, binary_data=True)
    with pytest.raises(InferenceServerException, match="synthetic"):
        http.infer("synthetic", [request])
    y = np.random.default_rng(3).normal(size=(2, 3, 224, 224)).astype(np.float32)
    for answer in _infer_both(files_server, "synthetic_written", {"input": y}, "prob"):
        np.testing.assert_allclose(answer, np.repeat(_row_sums(y)[:, None], 1000, axis=1), rtol=1e-6)


@pytest.mark.parametrize("model", ["ddnet_short", "ddnet_auto"])
def test_ddnet_with_short_names_and_without_a_config(files_server: GeserveProcess, model: str) -> None:
    http = httpclient.InferenceServerClient(files_server.url)
    metadata = http.get_model_metadata(model)
    assert [(t["name"], t["shape"]) for t in metadata["inputs"]] == [
        ("Input", [-1, 32, 105]),
        ("Input_1", [-1, 32, 15, 2]),
    ]
    assert [(t["name"], t["shape"]) for t in metadata["outputs"]] == [("model_1/dense_2/Softmax", [-1, 21])]
    rng = np.random.default_rng(5)
    inputs = {
        "Input": rng.normal(size=(1, 32, 105)).astype(np.float32),
        "Input_1": rng.normal(size=(1, 32, 15, 2)).astype(np.float32),
    }
    for answer in _infer_both(files_server, model, inputs, "model_1/dense_2/Softmax"):
        assert answer.shape == (1, 21)
        np.testing.assert_allclose(answer, np.repeat(_row_sums(inputs["Input"])[:, None], 21, axis=1), rtol=1e-6)
    with pytest.raises(InferenceServerException, match="batch-size must be <= 1"):
        two = {name: np.concatenate([a, a]) for name, a in inputs.items()}
        _infer_both(files_server, model, two, "model_1/dense_2/Softmax")


@pytest.mark.parametrize("model", ["resnet50_v2", "resnet50"])
def test_configs_written_for_the_ge_backend_and_the_readme_load_as_they_are(
    files_server: GeserveProcess, model: str
) -> None:
    http = httpclient.InferenceServerClient(files_server.url)
    config = http.get_model_config(model)
    assert config["max_batch_size"] == 16  # completed from the gears where the config gives none
    assert [t["name"] for t in config["output"]] == ["output"]
    x = np.random.default_rng(1).normal(size=(1, 3, 224, 224)).astype(np.float32)
    for answer in _infer_both(files_server, model, {"input": x}, "output"):
        assert answer.shape == (1, 1000)
        np.testing.assert_allclose(answer[0], np.full(1000, _row_sums(x)[0]), rtol=1e-6)

"""model_warmup through a real server: samples run on every instance before READY, uncounted; bad ones fail the load."""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.fakes.om_models import affine_config, write_affine_om
from tests.support import GeserveProcess, config_text, copy_model, write_python_model

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

FAKES = Path(__file__).resolve().parents[1] / "fakes"
PYTHON_MODELS = Path(__file__).resolve().parents[1] / "python_models"

# Appends one line per execute to <record_dir>/<instance>.jsonl: how many requests came, and their IN.
RECORDER = """
import json
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        folder = config["parameters"]["record_dir"]["string_value"]
        self.record = os.path.join(folder, args["model_instance_name"] + ".jsonl")

    def execute(self, requests):
        arrays = [pb_utils.get_input_tensor_by_name(request, "IN").as_numpy() for request in requests]
        with open(self.record, "a") as record:
            record.write(json.dumps({"requests": len(requests), "IN": [a.tolist() for a in arrays]}) + "\\n")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", a)]) for a in arrays]
"""
# The recorder's tensors, and the ensemble's over it: IN comes back as OUT, in batches of up to 4.
RECORDER_INPUTS = [("IN", "TYPE_INT32", "3")]
RECORDER_OUTPUTS = [("OUT", "TYPE_INT32", "3")]
RECORDER_SETTINGS = """instance_group [ {{ kind: KIND_CPU count: {instances} }} ]
parameters {{ key: "record_dir" value {{ string_value: "{record_dir}" }} }}
model_warmup [ {warmup} ]"""
GOOD_WARMUP = """
  { name: "from_file" batch_size: 2 count: 3
    inputs { key: "IN" value: { data_type: TYPE_INT32 dims: [ 3 ] input_data_file: "in.bin" } } },
  { name: "zeros" batch_size: 1 inputs { key: "IN" value: { data_type: TYPE_INT32 dims: [ 3 ] zero_data: true } } }
"""
# Each fails the load of its model with Triton's text.
BAD_WARMUPS = {
    "bad_input": (
        'name: "s" batch_size: 1 inputs { key: "NOPE" value: { data_type: TYPE_INT32 dims: [ 3 ] zero_data: true } }',
        "unexpected inference input 'NOPE' for model 'bad_input'",
    ),
    "bad_shape": (
        'name: "s" batch_size: 1 inputs { key: "IN" value: { data_type: TYPE_INT32 dims: [ 2 ] zero_data: true } }',
        "unexpected shape for input 'IN' for model 'bad_shape'. Expected [-1,3], got [1,2]",
    ),
    "bad_type": (
        'name: "s" batch_size: 1 inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } }',
        "inference input 'IN' data-type is 'FP32', but model 'bad_type' expects 'INT32'",
    ),
    "bad_file": (
        'name: "s" batch_size: 1 inputs { key: "IN" value: { data_type: TYPE_INT32 dims: [ 3 ] input_data_file: "absent.bin" } }',
        "warmup/absent.bin: No such file or directory",
    ),
}
RAISES_WARMUP = """
model_warmup [ { name: "unlucky" batch_size: 1
  inputs { key: "IN" value: { data_type: TYPE_INT32 dims: [ 1 ] input_data_file: "thirteen.bin" } } } ]
"""
ENSEMBLE_CONFIG = config_text(
    "warm_ensemble",
    platform="ensemble",
    max_batch_size=4,
    inputs=RECORDER_INPUTS,
    outputs=RECORDER_OUTPUTS,
    extra="""ensemble_scheduling { step [ { model_name: "recorder" model_version: -1
  input_map { key: "IN" value: "IN" } output_map { key: "OUT" value: "OUT" } } ] }
model_warmup [ { name: "s" batch_size: 1 inputs { key: "IN" value: { data_type: TYPE_INT32 dims: [ 3 ] zero_data: true } } } ]""",
)
ONNX_WARMUP = """
instance_group [ { kind: KIND_CPU count: 1 } ]
model_warmup [ { name: "random" batch_size: 8 count: 2
  inputs { key: "INPUT0" value: { data_type: TYPE_INT32 dims: [ 16 ] random_data: true } }
  inputs { key: "INPUT1" value: { data_type: TYPE_INT32 dims: [ 16 ] random_data: true } } } ]
"""
ONNX_ONE_INPUT_WARMUP = """
model_warmup [ { name: "half" batch_size: 1
  inputs { key: "INPUT0" value: { data_type: TYPE_INT32 dims: [ 16 ] zero_data: true } } } ]
"""
GE_CONFIG = affine_config(
    "affine_warm",
    max_batch_size=8,
    extra="""instance_group [ { kind: KIND_GPU count: 1 gpus: [ 0 ] } ]
model_warmup [ { name: "gear" batch_size: 3 count: 2
  inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 4 ] random_data: true } } } ]""",
)
# repeat_int32 (decoupled) answers each request on its stream; IN and DELAY of different shapes get an error response.
REPEAT_WARMUP = """
model_warmup [ {{ name: "stream" batch_size: 1
  inputs {{ key: "IN" value: {{ data_type: TYPE_INT32 dims: [ 2 ] zero_data: true }} }}
  inputs {{ key: "DELAY" value: {{ data_type: TYPE_UINT32 dims: [ {delays} ] zero_data: true }} }}
  inputs {{ key: "WAIT" value: {{ data_type: TYPE_UINT32 dims: [ 1 ] zero_data: true }} }} }} ]
"""
# sequence_state reads its START and READY controls; a warmup request carries only the controls its sample names.
SEQUENCE_WARMUP = """
model_warmup [ {{ name: "seq" batch_size: 2 count: 2
  inputs {{ key: "INPUT" value: {{ data_type: TYPE_INT32 dims: [ 1 ] input_data_file: "seven.bin" }} }}
  {controls} }} ]
"""
CONTROLS = """
  inputs { key: "START" value: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } }
  inputs { key: "READY" value: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } }
"""
FILE_VALUES = [7, 8, 9]


def _recorder(repository: Path, name: str, record_dir: Path, warmup: str, instances: int = 1) -> None:
    settings = RECORDER_SETTINGS.format(record_dir=record_dir, warmup=warmup, instances=instances)
    config = config_text(
        name, backend="python", max_batch_size=4, inputs=RECORDER_INPUTS, outputs=RECORDER_OUTPUTS, extra=settings
    )
    folder = write_python_model(repository, name, RECORDER, config)
    (folder / "warmup").mkdir()
    (folder / "warmup" / "in.bin").write_bytes(np.array(FILE_VALUES, dtype="<i4").tobytes())


def _repository(root: Path) -> Path:
    repository = root / "models"
    records = root / "records"
    records.mkdir()
    _recorder(repository, "recorder", records, GOOD_WARMUP, instances=2)
    for name, (warmup, _) in BAD_WARMUPS.items():
        _recorder(repository, name, root / f"records-{name}", "{ " + warmup + " }")
    raises = repository / "raises"
    shutil.copytree(PYTHON_MODELS / "raises", raises)
    (raises / "config.pbtxt").write_text((raises / "config.pbtxt").read_text() + RAISES_WARMUP)
    (raises / "warmup").mkdir()
    (raises / "warmup" / "thirteen.bin").write_bytes(np.array([13], dtype="<i4").tobytes())
    (repository / "warm_ensemble" / "1").mkdir(parents=True)
    (repository / "warm_ensemble" / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    simple = copy_model("simple", repository)
    (simple / "config.pbtxt").write_text((simple / "config.pbtxt").read_text() + ONNX_WARMUP)
    for name, delays in (("repeat_warm", 2), ("repeat_bad", 3)):
        folder = copy_model("repeat_int32", repository, name)
        config = (folder / "config.pbtxt").read_text().replace('name: "repeat_int32"', f'name: "{name}"')
        (folder / "config.pbtxt").write_text(config + REPEAT_WARMUP.format(delays=delays))
    missing = copy_model("simple", repository, "simple_missing")
    config = (missing / "config.pbtxt").read_text().replace('name: "simple"', 'name: "simple_missing"')
    (missing / "config.pbtxt").write_text(config + ONNX_ONE_INPUT_WARMUP)
    for name, controls in (("sequence_warm", CONTROLS), ("sequence_uncontrolled", "")):
        folder = repository / name
        shutil.copytree(PYTHON_MODELS / "sequence_state", folder)
        config = (folder / "config.pbtxt").read_text().replace('name: "sequence_state"', f'name: "{name}"')
        (folder / "config.pbtxt").write_text(config + SEQUENCE_WARMUP.format(controls=controls))
        (folder / "warmup").mkdir()
        (folder / "warmup" / "seven.bin").write_bytes(np.array([7], dtype="<i4").tobytes())
    write_affine_om(repository / "affine_warm" / "1" / "model.om", gears=[1, 2, 4, 8])
    (repository / "affine_warm" / "config.pbtxt").write_text(GE_CONFIG)
    return repository


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("warmup")


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[GeserveProcess]:
    reports = root / "reports"
    reports.mkdir()
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]),
        "ACL_SIM_DEVICE_COUNT": "1",
        "ACL_SIM_REPORT_DIR": str(reports),
    }
    process = GeserveProcess(
        root / "geserve.log",
        f"--model-repository={_repository(root)}",
        "--exit-on-error=false",
        "--device-ids=0",
        env=env,
    ).wait_live()
    yield process
    process.stop()


def _client(server: GeserveProcess) -> httpclient.InferenceServerClient:
    client = httpclient.InferenceServerClient(server.url)
    for name in ("recorder", "simple", "affine_warm", "repeat_warm", "sequence_warm"):
        assert client.is_model_ready(name), server.log()
    return client


def _records(root: Path) -> dict[str, list[dict[str, object]]]:
    return {
        path.stem: [json.loads(line) for line in path.read_text().splitlines()] for path in (root / "records").iterdir()
    }


def _counts(client: httpclient.InferenceServerClient, model: str) -> tuple[int, int, int]:
    (stats,) = client.get_inference_statistics(model)["model_stats"]
    return stats["inference_count"], stats["execution_count"], stats["inference_stats"]["success"]["count"]


def _metric(server: GeserveProcess, family: str, model: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(f"{family}{{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_every_instance_runs_each_sample_count_times_before_ready(server: GeserveProcess, root: Path) -> None:
    _client(server)
    records = _records(root)
    assert sorted(records) == ["recorder_0_0", "recorder_0_1"]  # both instances, nothing else has run yet
    from_file = {"requests": 2, "IN": [[FILE_VALUES], [FILE_VALUES]]}
    zeros = {"requests": 1, "IN": [[[0, 0, 0]]]}
    for executions in records.values():
        assert executions == [from_file, from_file, from_file, zeros]


def test_warmup_is_not_counted_in_statistics_or_metrics(server: GeserveProcess, root: Path) -> None:
    client = _client(server)
    for model in ("recorder", "simple", "affine_warm"):
        assert _counts(client, model) == (0, 0, 0), model
    assert _metric(server, "nv_inference_count", "recorder") == 0
    assert _metric(server, "nv_inference_exec_count", "recorder") == 0
    tensor = httpclient.InferInput("IN", [1, 3], "INT32")
    tensor.set_data_from_numpy(np.array([[1, 2, 3]], dtype=np.int32))
    result = client.infer("recorder", [tensor])
    np.testing.assert_array_equal(result.as_numpy("OUT"), [[1, 2, 3]])
    assert _counts(client, "recorder") == (1, 1, 1)
    assert _metric(server, "nv_inference_count", "recorder") == 1
    assert sum(len(executions) for executions in _records(root).values()) == 2 * 4 + 1


def test_onnxruntime_model_warms_up_and_serves(server: GeserveProcess) -> None:
    client = _client(server)
    (entry,) = [entry for entry in client.get_model_repository_index() if entry["name"] == "simple_missing"]
    assert "expected 2 inputs but got 1 inputs for model 'simple_missing'" in entry["reason"], entry
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = httpclient.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    result = client.infer("simple", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data + data)


def test_each_bad_warmup_fails_its_load_and_the_rest_serve(server: GeserveProcess) -> None:
    client = _client(server)
    index = {entry["name"]: entry for entry in client.get_model_repository_index()}
    expected = {name: message for name, (_, message) in BAD_WARMUPS.items()}
    expected["raises"] = "failed to run warmup sample 'unlucky': "
    expected["repeat_bad"] = (
        "failed to run warmup sample 'stream': expected IN and DELAY shapes to match, got [2] and [3]; "
    )
    expected["sequence_uncontrolled"] = "failed to run warmup sample 'seq': "
    expected["warm_ensemble"] = "model_warmup can not be specified for ensemble 'warm_ensemble'"
    for name, message in expected.items():
        assert index[name]["state"] == "UNAVAILABLE", index[name]
        assert message in index[name]["reason"], index[name]
        assert not client.is_model_ready(name)
    assert "unlucky input" in index["raises"]["reason"]
    tensor = httpclient.InferInput("IN", [1, 3], "INT32")
    tensor.set_data_from_numpy(np.array([[4, 5, 6]], dtype=np.int32))
    np.testing.assert_array_equal(client.infer("recorder", [tensor]).as_numpy("OUT"), [[4, 5, 6]])


def test_a_sequence_starts_from_its_initial_state_after_warmup(server: GeserveProcess) -> None:
    client = _client(server)
    for step, total in enumerate([5, 11]):
        tensor = httpclient.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[5 + step]], dtype=np.int32))
        result = client.infer("sequence_warm", [tensor], sequence_id=42, sequence_start=step == 0)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT"), [[total]])
    assert _counts(client, "sequence_warm") == (2, 2, 2)


def test_the_om_model_ran_its_samples_on_the_device(server: GeserveProcess, root: Path) -> None:
    """Last: the simulator reports its executions when the server has stopped."""
    _client(server)
    assert server.stop() == 0, server.log()
    (report,) = [json.loads(path.read_text()) for path in (root / "reports").glob("acl-sim-*.json")]
    assert report["executions"] == 2, report
    assert report["rows_executed"] == [4, 4], report  # batch_size 3 runs on the 4-row gear

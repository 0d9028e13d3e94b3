"""The response cache through tritonclient: hits skip the model (HTTP and gRPC share one cache), an ensemble caches
at the top level, Triton's statistics and nv_cache_* metrics, and Triton's refusals at load and at start."""

from __future__ import annotations

import re
import textwrap
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.support import GeserveProcess, write_identity_model

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]
Launch = Callable[..., GeserveProcess]
CACHE = "--cache-config=local,size=1048576"

# Counts its executions: a response from the cache carries the count of the run that made it.
COUNTING_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.runs = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            self.runs += 1
            data = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            runs = np.array([self.runs], dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", data * 2), pb_utils.Tensor("RUNS", runs)]))
        return responses
"""

COUNTING_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }} ]
output [
  {{ name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] }},
  {{ name: "RUNS" data_type: TYPE_INT64 dims: [ 1 ] }}
]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
{extra}
"""

ENSEMBLE = """
name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: {dtype} dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: {dtype} dims: [ -1 ] }} ]
ensemble_scheduling {{ step [ {{
  model_name: "{step}" model_version: -1
  input_map {{ key: "{step_input}" value: "INPUT0" }}
  output_map {{ key: "{step_output}" value: "OUTPUT0" }}
}} ] }}
response_cache {{ enable: true }}
"""


def write_counting_model(repository: Path, name: str, extra: str = "") -> None:
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "1" / "model.py").write_text(textwrap.dedent(COUNTING_MODEL))
    (repository / name / "config.pbtxt").write_text(COUNTING_CONFIG.format(name=name, extra=extra))


def write_ensemble(repository: Path, name: str, **fields: str) -> None:
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(ENSEMBLE.format(name=name, **fields))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    """One server with a cache: models that use it, one that does not, and three whose configs Triton refuses."""
    repository = tmp_path_factory.mktemp("cache") / "models"
    repository.mkdir()
    write_counting_model(repository, "cached", "response_cache { enable: true }")
    write_identity_model(repository, "plain")
    write_ensemble(repository, "pipeline", dtype="TYPE_FP32", step="plain", step_input="INPUT0", step_output="OUTPUT0")
    write_counting_model(
        repository, "decoupled_cached", "model_transaction_policy { decoupled: true }\nresponse_cache { enable: true }"
    )
    write_identity_model(repository, "sequence_cached", extra="sequence_batching {}\nresponse_cache { enable: true }")
    write_counting_model(repository, "stream_step", "model_transaction_policy { decoupled: true }")
    write_ensemble(
        repository,
        "decoupled_step_pipeline",
        dtype="TYPE_INT32",
        step="stream_step",
        step_input="IN",
        step_output="OUT",
    )
    log = repository.parent / "geserve.log"
    process = GeserveProcess(log, f"--model-repository={repository}", CACHE, "--exit-on-error=false").wait_live()
    yield process
    process.stop()


def http_infer(server: GeserveProcess, values: list[int]) -> httpclient.InferResult:
    client = httpclient.InferenceServerClient(server.url)
    tensor = httpclient.InferInput("IN", [len(values)], "INT32")
    tensor.set_data_from_numpy(np.array(values, dtype=np.int32))
    return client.infer("cached", [tensor])


def grpc_infer(server: GeserveProcess, values: list[int]) -> grpcclient.InferResult:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    tensor = grpcclient.InferInput("IN", [len(values)], "INT32")
    tensor.set_data_from_numpy(np.array(values, dtype=np.int32))
    try:
        return client.infer("cached", [tensor])
    finally:
        client.close()


def statistics(server: GeserveProcess, model: str) -> dict[str, Any]:
    found: dict[str, Any] = httpclient.InferenceServerClient(server.url).get_inference_statistics(model)
    return found["model_stats"][0]


def fp32_infer(server: GeserveProcess, model: str, values: list[float]) -> np.ndarray:
    client = httpclient.InferenceServerClient(server.url)
    tensor = httpclient.InferInput("INPUT0", [1, len(values)], "FP32")
    tensor.set_data_from_numpy(np.array([values], dtype=np.float32))
    output = client.infer(model, [tensor]).as_numpy("OUTPUT0")
    assert output is not None
    return output


def test_an_identical_request_is_answered_from_the_cache_whichever_protocol_asks(server: GeserveProcess) -> None:
    before = statistics(server, "cached")
    first = http_infer(server, [11, 12, 13])
    runs = int(first.as_numpy("RUNS")[0])
    again = grpc_infer(server, [11, 12, 13])
    assert int(again.as_numpy("RUNS")[0]) == runs  # the model did not run again
    np.testing.assert_array_equal(again.as_numpy("OUT"), [22, 24, 26])
    after = statistics(server, "cached")
    inference, cached = before["inference_stats"], after["inference_stats"]
    assert cached["cache_hit"]["count"] == inference["cache_hit"]["count"] + 1
    assert cached["cache_miss"]["count"] == inference["cache_miss"]["count"] + 1
    assert cached["success"]["count"] == inference["success"]["count"] + 2
    # as Triton: a hit is a success, not an inference nor an execution
    assert after["execution_count"] == before["execution_count"] + 1
    assert after["inference_count"] == before["inference_count"] + 1
    other = http_infer(server, [11, 12, 14])
    assert int(other.as_numpy("RUNS")[0]) > runs  # other contents: a miss, the model runs
    assert statistics(server, "cached")["inference_stats"]["cache_miss"]["count"] == cached["cache_miss"]["count"] + 1


def test_an_ensemble_hit_skips_its_steps_and_a_model_without_the_field_is_never_cached(server: GeserveProcess) -> None:
    executions = statistics(server, "plain")["execution_count"]
    first = fp32_infer(server, "pipeline", [1.5, 2.5])
    assert statistics(server, "plain")["execution_count"] == executions + 1
    np.testing.assert_array_equal(fp32_infer(server, "pipeline", [1.5, 2.5]), first)
    assert statistics(server, "plain")["execution_count"] == executions + 1
    assert statistics(server, "pipeline")["inference_stats"]["cache_hit"]["count"] >= 1
    for _ in range(2):
        fp32_infer(server, "plain", [7.0])
    plain = statistics(server, "plain")
    assert plain["execution_count"] == executions + 3
    assert plain["inference_stats"]["cache_hit"]["count"] == plain["inference_stats"]["cache_miss"]["count"] == 0


def metric(text: str, name: str, model: str | None = None) -> float:
    labels = rf'\{{model="{model}",version="1"\}}' if model else ""
    found = re.search(rf"^{name}{labels} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} {model or ''} not in the metrics:\n{text}"
    return float(found.group(1))


def test_the_cache_metrics_are_tritons(server: GeserveProcess) -> None:
    http_infer(server, [31])
    http_infer(server, [31])
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert metric(text, "nv_cache_num_hits_per_model", "cached") >= 1
    assert metric(text, "nv_cache_num_misses_per_model", "cached") >= 1
    assert metric(text, "nv_cache_hit_duration_per_model", "cached") >= 0
    assert metric(text, "nv_cache_miss_duration_per_model", "cached") > 0
    assert "# TYPE nv_cache_num_hits_per_model counter" in text
    assert 'nv_cache_num_hits_per_model{model="plain"' not in text  # only for models that use the cache
    assert metric(text, "nv_cache_num_entries") >= 1
    assert metric(text, "nv_cache_num_hits") >= 1 and metric(text, "nv_cache_num_lookups") >= 2
    assert 0 < metric(text, "nv_cache_util") <= 1
    assert "# TYPE nv_cache_util gauge" in text


@pytest.mark.parametrize(
    ("model", "why"),
    [
        ("decoupled_cached", "with a 'decoupled' transaction policy"),
        ("sequence_cached", "with sequence batching"),
        ("decoupled_step_pipeline", "its step model 'stream_step' has a 'decoupled' transaction policy"),
    ],
)
def test_models_triton_cannot_cache_fail_to_load_saying_why(server: GeserveProcess, model: str, why: str) -> None:
    index = httpclient.InferenceServerClient(server.url).get_model_repository_index()
    entry = next(item for item in index if item["name"] == model)
    assert entry["state"] == "UNAVAILABLE"
    assert f"Response Cache does not currently support model '{model}'" in entry["reason"]
    assert why in entry["reason"]
    np.testing.assert_array_equal(http_infer(server, [41]).as_numpy("OUT"), [82])  # the rest serves


def test_a_model_enabling_the_cache_on_a_server_without_one_is_warned_and_not_cached(
    launch: Launch, repository: Path
) -> None:
    write_identity_model(repository, "wants_cache", extra="response_cache { enable: true }")
    server = launch(f"--model-repository={repository}").wait_live()
    for _ in range(2):
        fp32_infer(server, "wants_cache", [3.0])
    stats = statistics(server, "wants_cache")
    assert stats["execution_count"] == 2 and stats["inference_stats"]["cache_hit"]["count"] == 0
    assert (
        "model 'wants_cache' version 1 sets response_cache { enable: true } but the server has no response cache"
        in server.log()
    )


def test_a_cache_geserve_does_not_have_stops_the_server_at_start(launch: Launch, repository: Path) -> None:
    write_identity_model(repository, "echo")
    refused = launch(f"--model-repository={repository}", "--cache-config=redis,host=localhost")
    assert refused.wait_exit() == 2
    assert "--cache-config=redis,...: the 'redis' cache is not available" in refused.log()
    server = launch(f"--model-repository={repository}", "--cache-config", "local,size=4096").wait_live()
    np.testing.assert_array_equal(fp32_infer(server, "echo", [5.0]), [[5.0]])

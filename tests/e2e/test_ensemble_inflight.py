"""ensemble_scheduling.max_inflight_requests through tritonclient: a step's requests in flight are bounded."""

from __future__ import annotations

import queue
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.support import GeserveProcess

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]
PROBE = Path(__file__).resolve().parents[1] / "python_models" / "inflight_probe"


def _ensemble(name: str, limit: str, probe: str) -> str:
    return f"""
name: "{name}"
platform: "ensemble"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [
  {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "CONCURRENT" data_type: TYPE_INT32 dims: [ 1 ] }}
]
ensemble_scheduling {{
  {limit}
  step [ {{
    model_name: "{probe}" model_version: -1
    input_map {{ key: "IN" value: "IN" }}
    output_map {{ key: "OUT" value: "OUT" }}
    output_map {{ key: "CONCURRENT" value: "CONCURRENT" }}
  }} ]
}}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("inflight")
    repository, probes = root / "models", root / "probes"
    probes.mkdir()
    # Requests free to meet wait long for each other (a loaded machine may start the second one late);
    # requests held apart never meet, so each waits out its whole wait: keep that one short.
    for name, limit, wait_s in (("one_at_a_time", "max_inflight_requests: 1", 1.5), ("unbounded", "", 60)):
        probe = f"{name}_probe"
        shutil.copytree(PROBE, repository / probe)
        config = repository / probe / "config.pbtxt"
        text = config.read_text().replace('"inflight_probe"', f'"{probe}"').replace("PROBE_DIR", str(probes / probe))
        config.write_text(text.replace("WAIT_S", str(wait_s)))
        (probes / probe).mkdir()
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(_ensemble(name, limit, probe))
    process = GeserveProcess(root / "geserve.log", f"--model-repository={repository}").wait_live()
    yield process
    assert process.stop() == 0, process.log()


def _side_by_side(server: GeserveProcess, model: str, values: list[int]) -> dict[int, int]:
    """Send the requests at once; each one's OUT (checked to be its own IN) -> the CONCURRENT it saw."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    answers: queue.Queue[tuple[int, grpcclient.InferResult | None, Exception | None]] = queue.Queue()
    for value in values:
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
        client.async_infer(
            model, [tensor], callback=lambda result, error, value=value: answers.put((value, result, error))
        )
    seen: dict[int, int] = {}
    for _ in values:
        value, result, error = answers.get(timeout=120)
        assert error is None, error
        assert result is not None
        np.testing.assert_array_equal(result.as_numpy("OUT"), [value])
        seen[value] = int(result.as_numpy("CONCURRENT")[0])
    client.close()
    return seen


def test_without_a_bound_the_step_runs_requests_side_by_side(server: GeserveProcess) -> None:
    assert _side_by_side(server, "unbounded", [1, 2]) == {1: 2, 2: 2}


def test_max_inflight_requests_1_runs_the_step_one_request_at_a_time(server: GeserveProcess) -> None:
    assert _side_by_side(server, "one_at_a_time", [3, 4, 5]) == {3: 1, 4: 1, 5: 1}
    assert "Ensemble model 'one_at_a_time' configured with max_inflight_requests: 1" in server.log()

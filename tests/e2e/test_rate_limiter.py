"""--rate-limit=execution_count through tritonclient: two models whose instances claim one resource take turns."""

from __future__ import annotations

import queue
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.support import GeserveProcess

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]
PROBE = Path(__file__).resolve().parents[1] / "python_models" / "inflight_probe"
# Each probe waits this long to meet another request running beside it (across both models: one folder).
WAIT_S = 0.75


def _probe(repository: Path, probes: Path, name: str, rate_limiter: str) -> None:
    shutil.copytree(PROBE, repository / name)
    config = repository / name / "config.pbtxt"
    text = config.read_text().replace('"inflight_probe"', f'"{name}"').replace("PROBE_DIR", str(probes))
    text = text.replace("WAIT_S", str(WAIT_S)).replace("count: 2 }", f"count: 1 {rate_limiter} }}")
    config.write_text(text)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("rate_limiter")
    repository, probes = root / "models", root / "probes"
    probes.mkdir()
    one_slot = 'rate_limiter { resources [ { name: "npu_slot" count: 1 } ] }'
    for name in ("detector", "classifier"):
        _probe(repository, probes, name, one_slot)
    _probe(repository, probes, "greedy", 'rate_limiter { resources [ { name: "npu_slot" count: 2 } ] priority: 2 }')
    process = GeserveProcess(
        root / "geserve.log",
        f"--model-repository={repository}",
        "--rate-limit=execution_count",
        "--rate-limit-resource=npu_slot:1",
        "--exit-on-error=false",  # greedy's load fails, and the server serves the others
    ).wait_live()
    yield process
    assert process.stop() == 0, process.log()


def test_instances_of_two_models_claiming_one_resource_never_run_together(server: GeserveProcess) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    answers: queue.Queue[tuple[int, grpcclient.InferResult | None, Exception | None]] = queue.Queue()
    sent = {1: "detector", 2: "classifier", 3: "detector", 4: "classifier"}
    for value, model in sent.items():
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
        client.async_infer(
            model, [tensor], callback=lambda result, error, value=value: answers.put((value, result, error))
        )
    seen = {}
    for _ in sent:
        value, result, error = answers.get(timeout=60)
        assert error is None, error
        assert result is not None
        np.testing.assert_array_equal(result.as_numpy("OUT"), [value])  # each answer is its own request's
        seen[value] = int(result.as_numpy("CONCURRENT")[0])
    assert seen == {1: 1, 2: 1, 3: 1, 4: 1}
    client.close()


def test_an_instance_needing_more_copies_than_the_flag_gives_fails_its_load_with_tritons_text(
    server: GeserveProcess,
) -> None:
    client = httpclient.InferenceServerClient(server.url)
    assert not client.is_model_ready("greedy")
    assert client.is_model_ready("detector") and client.is_model_ready("classifier")
    assert (
        'Resource count for "npu_slot" is limited to 1 which will prevent scheduling of one or more model instances, '
        "the minimum required count is 2"
    ) in server.log()

"""A hung NPU: the batch fails after sync_timeout_ms, the instance is replaced, and the model serves again."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.fakes.om_models import FEATURES, affine_reference, write_affine_om
from tests.support import GeserveProcess

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

FAKES = Path(__file__).resolve().parents[1] / "fakes"
CONFIG = """
name: "affine"
backend: "ge"
max_batch_size: 4
instance_group [ { kind: KIND_GPU count: 1 gpus: [ 0 ] } ]
parameters { key: "sync_timeout_ms" value { string_value: "500" } }
"""


def _http(client: httpclient.InferenceServerClient, x: np.ndarray) -> np.ndarray:
    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return np.asarray(client.infer("affine", [tensor]).as_numpy("y"))


def _grpc(client: grpcclient.InferenceServerClient, x: np.ndarray) -> np.ndarray:
    tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return np.asarray(client.infer("affine", [tensor]).as_numpy("y"))


def test_a_hung_execution_fails_its_request_and_the_restarted_instance_serves(launch: Any, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    write_affine_om(repository / "affine" / "1" / "model.om", gears=[1, 2, 4])
    (repository / "affine" / "config.pbtxt").write_text(CONFIG)
    hang = tmp_path / "hang"
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]),
        "ACL_SIM_DEVICE_COUNT": "1",
        "ACL_SIM_HANG_FILE": str(hang),  # the next execute never ends
    }
    server: GeserveProcess = launch(f"--model-repository={repository}", "--device-ids=0", env=env)
    server.wait_live()
    http = httpclient.InferenceServerClient(server.url, network_timeout=20)  # a request that hangs fails
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    x = np.arange(2 * FEATURES, dtype=np.float32).reshape(2, FEATURES)
    expected = affine_reference(x)["y"]
    np.testing.assert_array_equal(_http(http, x), expected)

    hang.write_text("")
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as error:
        _http(http, x)
    assert 0.5 <= time.monotonic() - started < 30
    assert error.value.status() == "500"
    assert "the NPU did not finish the batch within 500 ms (parameter 'sync_timeout_ms')" in error.value.message()
    assert "507046 (ACL_ERROR_RT_STREAM_SYNC_TIMEOUT)" in error.value.message()
    assert not hang.exists()  # taken by that execution

    deadline = time.monotonic() + 60
    while True:
        try:
            answered = _grpc(grpc, x)
            break
        except InferenceServerException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    np.testing.assert_array_equal(answered, expected)
    np.testing.assert_array_equal(_http(http, x), expected)
    log = server.log()
    assert "exited after a device failure" in log and "did not finish the batch within 500 ms" in log
    assert server.stop() == 0

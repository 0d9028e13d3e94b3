"""Which NPUs a server without --device-ids finds (the runtime counts them), and ge models kept off the CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.fakes.om_models import FEATURES, affine_reference, write_affine_om
from tests.support import GeserveProcess, copy_model

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

FAKES = Path(__file__).resolve().parents[1] / "fakes"
CPU_CONFIG = """
name: "affine_cpu"
backend: "ge"
instance_group [ { kind: KIND_CPU count: 1 } ]
"""


def test_the_runtime_counts_the_npus_and_a_cpu_group_of_a_ge_model_is_refused(launch: Any, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    write_affine_om(repository / "affine" / "1" / "model.om", gears=[1, 2, 4])  # no config: KIND_AUTO
    write_affine_om(repository / "affine_cpu" / "1" / "model.om", gears=[1, 2, 4])
    (repository / "affine_cpu" / "config.pbtxt").write_text(CPU_CONFIG)
    copy_model("simple", repository)
    reports = tmp_path / "reports"
    reports.mkdir()
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]),
        "ACL_SIM_DEVICE_COUNT": "3",  # this machine has no /dev/davinciN: only the runtime can count them
        "ACL_SIM_REPORT_DIR": str(reports),
    }
    server: GeserveProcess = launch(f"--model-repository={repository}", "--exit-on-error=false", env=env)
    server.wait_live()
    http = httpclient.InferenceServerClient(server.url)
    assert not http.is_model_ready("affine_cpu")
    assert (
        "model 'affine_cpu': instance_group[0] ('affine_cpu_0') has kind KIND_CPU, but the 'ge' backend runs .om "
        "models on Ascend NPUs only" in server.log()
    )
    assert http.is_model_ready("simple") and http.is_model_ready("affine")
    config = http.get_model_config("affine")
    assert [g["kind"] for g in config["instance_group"]] == ["KIND_GPU"]  # KIND_AUTO, with NPUs found

    x = np.arange(3 * FEATURES, dtype=np.float32).reshape(3, FEATURES)
    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    np.testing.assert_array_equal(http.infer("affine", [tensor]).as_numpy("y"), affine_reference(x)["y"])
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    np.testing.assert_array_equal(grpc.infer("affine", [tensor]).as_numpy("s"), affine_reference(x)["s"])
    assert server.stop() == 0

    found = [json.loads(path.read_text()) for path in reports.glob("acl-sim-*.json")]
    probes = [report for report in found if "rt.set_device" not in report["calls"]]
    workers = [report for report in found if "rt.set_device" in report["calls"]]
    # one probe process asked the runtime, and only that; the server itself never initialised ACL
    assert [report["calls"] for report in probes] == [{"init": 1, "rt.get_device_count": 1, "finalize": 1}]
    assert server.process.pid not in {report["pid"] for report in found}
    # one worker per NPU the runtime counted, each shown its own
    assert sorted(report["visible_devices"] for report in workers) == ["0", "1", "2"]

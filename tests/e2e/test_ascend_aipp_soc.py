"""Static- and dynamic-AIPP `.om` models, and models compiled for another SoC, served through tritonclient."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.e2e.test_ascend import _simulator_env
from tests.fakes.om_models import (
    affine_description,
    affine_reference,
    aipp_description,
    dynamic_aipp_description,
    write_affine_om,
)
from tests.fakes.om_writer import write_om
from tests.support import GeserveProcess

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

HOST_SOC = "Ascend910B3"  # what the simulated chip calls itself in this file's server
HEIGHT, WIDTH = 16, 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("ascend-aipp")
    repository = root / "models"
    write_om(repository / "aipp" / "1" / "model.om", aipp_description(HEIGHT, WIDTH, soc_version=HOST_SOC))
    write_om(repository / "dynamic_aipp" / "1" / "model.om", dynamic_aipp_description(soc_version=HOST_SOC))
    write_affine_om(repository / "affine_310p" / "1" / "model.om", static_batch=1)  # compiled for Ascend310P3
    matching = write_affine_om(repository / "affine_910b" / "1" / "model.om", static_batch=1)
    description = affine_description(static_batch=1)
    description["soc_version"] = HOST_SOC
    write_om(matching, description)  # the same model, compiled for this host's chip (its twin stays)
    env = {**_simulator_env(root), "ACL_SIM_SOC_NAME": HOST_SOC}
    process = GeserveProcess(
        root / "geserve.log", f"--model-repository={repository}", "--exit-on-error=false", env=env
    ).wait_live()
    yield process
    assert process.stop() == 0, process.log()


def _reasons(server: GeserveProcess) -> dict[str, str]:
    index = httpclient.InferenceServerClient(server.url).get_model_repository_index()
    return {entry["name"]: entry.get("reason", "") for entry in index}


def test_static_aipp_metadata_shows_the_buffer_dims_and_inference_with_them_works(server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(server.url)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    buffer_dims = [HEIGHT * 3 // 2, WIDTH, 1]  # YUV420SP_U8: n, h*1.5, w, 1 (aclmdlGetInputDimsV2)
    metadata = http.get_model_metadata("aipp")
    assert metadata["inputs"] == [{"name": "image", "datatype": "UINT8", "shape": [-1, *buffer_dims]}]
    assert grpc.get_model_metadata("aipp").inputs[0].shape == [-1, *buffer_dims]
    assert http.get_model_config("aipp")["input"][0]["dims"] == buffer_dims
    image = np.random.default_rng(0).integers(0, 256, size=(1, *buffer_dims), dtype=np.uint8)
    expected = np.full((1, 10), float(image.sum()), dtype=np.float32)  # the simulator's row sums
    http_input = httpclient.InferInput("image", list(image.shape), "UINT8")
    http_input.set_data_from_numpy(image, binary_data=True)
    grpc_input = grpcclient.InferInput("image", list(image.shape), "UINT8")
    grpc_input.set_data_from_numpy(image)
    np.testing.assert_array_equal(http.infer("aipp", [http_input]).as_numpy("prob"), expected)
    np.testing.assert_array_equal(grpc.infer("aipp", [grpc_input]).as_numpy("prob"), expected)


def test_a_dynamic_aipp_model_is_refused_saying_why(server: GeserveProcess) -> None:
    assert not httpclient.InferenceServerClient(server.url).is_model_ready("dynamic_aipp")
    reason = _reasons(server)["dynamic_aipp"]
    assert "dynamic AIPP is not supported" in reason and "ascend_dynamic_aipp_data" in reason, reason


def test_a_model_for_another_soc_is_refused_and_the_rest_serve(server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(server.url)
    assert not http.is_model_ready("affine_310p")
    reason = _reasons(server)["affine_310p"]
    assert f"was compiled for Ascend310P3, this host is {HOST_SOC}" in reason, reason
    assert f"was compiled for Ascend310P3, this host is {HOST_SOC}" in server.log()
    assert http.is_model_ready("affine_910b") and http.is_model_ready("aipp")
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    tensor = httpclient.InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    np.testing.assert_array_equal(http.infer("affine_910b", [tensor]).as_numpy("y"), affine_reference(x)["y"])

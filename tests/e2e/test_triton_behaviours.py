"""Behaviours Triton's own tests pin down, through tritonclient: ensemble parameters, the python backend's rules."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.support import GeserveProcess, config_text, write_python_model

pytestmark = pytest.mark.e2e

PARAMETERS_ECHO = textwrap.dedent(
    """
    import json
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                text = json.dumps(json.loads(request.parameters()), sort_keys=True)
                out = pb_utils.Tensor("PARAMETERS", np.array([text.encode()], dtype=np.object_))
                responses.append(pb_utils.InferenceResponse([out]))
            return responses
    """
)
ENSEMBLE_OF_ECHO = config_text(
    "parameters_ensemble",
    platform="ensemble",
    inputs=[("IN", "TYPE_INT32", "1")],
    outputs=[("PARAMETERS", "TYPE_STRING", "1")],
    extra="""ensemble_scheduling { step [
  { model_name: "parameters_echo" model_version: -1 input_map { key: "IN" value: "IN" }
    output_map { key: "PARAMETERS" value: "PARAMETERS" } }
] }""",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("triton_behaviours")
    repository = root / "models"
    echo_config = config_text(
        "parameters_echo",
        backend="python",
        inputs=[("IN", "TYPE_INT32", "1")],
        outputs=[("PARAMETERS", "TYPE_STRING", "1")],
    )
    write_python_model(repository, "parameters_echo", PARAMETERS_ECHO, echo_config)
    (repository / "parameters_ensemble" / "1").mkdir(parents=True)
    (repository / "parameters_ensemble" / "config.pbtxt").write_text(ENSEMBLE_OF_ECHO)
    process = GeserveProcess(root / "geserve.log", f"--model-repository={repository}").wait_live()
    yield process
    assert process.stop() == 0, process.log()


def _int_input(module: Any, value: int = 1) -> Any:
    tensor = module.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
    return tensor


def _seen_parameters(result: Any) -> dict[str, Any]:
    seen: dict[str, Any] = json.loads(result.as_numpy("PARAMETERS")[0])
    return seen


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_an_ensembles_request_parameters_reach_its_steps(server: GeserveProcess, module: Any) -> None:
    """Every request parameter reaches every step, as Triton's ensemble scheduler passes them on (core PR #261)."""
    url = server.url if module is httpclient else f"127.0.0.1:{server.grpc_port}"
    client = module.InferenceServerClient(url)
    parameters = {"flag": True, "count": 7, "text": "hello"}
    direct = _seen_parameters(client.infer("parameters_echo", [_int_input(module)], parameters=parameters))
    through = _seen_parameters(client.infer("parameters_ensemble", [_int_input(module)], parameters=parameters))
    assert direct == parameters
    assert through == direct

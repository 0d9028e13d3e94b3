"""Behaviours Triton's own tests pin down, through tritonclient: ensemble parameters, the python backend's rules."""

from __future__ import annotations

import concurrent.futures
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
NO_INPUTS = textwrap.dedent(
    """
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.batched = "max_batch_size: 0" not in args["model_config"] and '"max_batch_size": 0' not in args["model_config"]

        def execute(self, requests):
            value = np.array([[42]] if self.batched else [42], dtype=np.int32)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value)]) for _ in requests]
    """
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
    for name, batching in (("no_inputs", 0), ("no_inputs_batched", 4)):
        extra = "dynamic_batching { max_queue_delay_microseconds: 20000 }" if batching else ""
        config = config_text(
            name, backend="python", max_batch_size=batching, outputs=[("OUT", "TYPE_INT32", "1")], extra=extra
        )
        write_python_model(repository, name, NO_INPUTS, config)
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


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
@pytest.mark.parametrize("model", ["no_inputs", "no_inputs_batched"])
def test_a_model_without_inputs_loads_and_answers(server: GeserveProcess, module: Any, model: str) -> None:
    """Triton has no rule that a model takes inputs (its own QA models include some that take none)."""
    url = server.url if module is httpclient else f"127.0.0.1:{server.grpc_port}"
    assert module.InferenceServerClient(url).is_model_ready(model)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # side by side: a batch of requests without inputs
        results = list(pool.map(lambda _: module.InferenceServerClient(url).infer(model, []), range(4)))
    expected = [[42]] if model.endswith("batched") else [42]
    assert [result.as_numpy("OUT").tolist() for result in results] == [expected] * 4

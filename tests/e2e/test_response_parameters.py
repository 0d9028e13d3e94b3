"""Response parameters a python model sets (InferenceResponse(parameters=...)) as tritonclient reads them."""

from __future__ import annotations

import asyncio
import json
import queue
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, config_text

pytestmark = pytest.mark.e2e
PYTHON_MODELS = Path(__file__).resolve().parents[1] / "python_models"
PARAMS = {"flag": True, "count": 1024, "text": "Hello World!", "big": -(1 << 62)}
ENSEMBLE = config_text(
    "params_ensemble",
    platform="ensemble",
    inputs=[("PARAMS", "TYPE_STRING", "1")],
    outputs=[("OUT", "TYPE_STRING", "1")],
    extra="""ensemble_scheduling { step [
  { model_name: "response_params" model_version: -1 input_map { key: "PARAMS" value: "PARAMS" }
    output_map { key: "OUTPUT" value: "MID" } },
  { model_name: "response_params_tail" model_version: -1 input_map { key: "PARAMS" value: "MID" }
    output_map { key: "OUTPUT" value: "OUT" } }
] }""",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("response_parameters")
    repository = root / "models"
    repository.mkdir()
    for name in ("response_params", "response_params_decoupled", "response_params_bls"):
        shutil.copytree(PYTHON_MODELS / name, repository / name)
    tail = repository / "response_params_tail"
    shutil.copytree(PYTHON_MODELS / "response_params", tail)
    config = (tail / "config.pbtxt").read_text().replace('"response_params"', '"response_params_tail"')
    (tail / "config.pbtxt").write_text(config.replace("response_cache { enable: true }", ""))
    (repository / "params_ensemble" / "1").mkdir(parents=True)
    (repository / "params_ensemble" / "config.pbtxt").write_text(ENSEMBLE)
    args = (f"--model-repository={repository}", "--cache-config=local,size=1048576")
    process = GeserveProcess(root / "geserve.log", *args).wait_live()
    yield process
    assert process.stop() == 0, process.log()


def _inputs(module: Any, **texts: str) -> list[Any]:
    tensors = []
    for name, text in texts.items():
        tensor = module.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        tensors.append(tensor)
    return tensors


def _grpc_parameters(response: Any) -> dict[str, Any]:
    """A gRPC response's parameters by the field each travelled in, as Triton's own test reads them."""
    values: dict[str, Any] = {}
    for key, parameter in response.parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        assert kind in {"bool_param", "int64_param", "string_param"}, (key, kind)
        values[key] = getattr(parameter, kind)
    return values


def test_http_json_and_binary_responses_carry_the_models_parameters(server: GeserveProcess) -> None:
    client = httpclient.InferenceServerClient(server.url)
    result = client.infer("response_params", _inputs(httpclient, PARAMS=json.dumps(PARAMS)))
    assert result.get_response()["parameters"] == PARAMS
    binary = [httpclient.InferRequestedOutput("OUTPUT", binary_data=True)]
    result = client.infer("response_params", _inputs(httpclient, PARAMS=json.dumps(PARAMS)), outputs=binary)
    assert result.get_response()["parameters"] == PARAMS
    assert result.as_numpy("OUTPUT").tolist() == [json.dumps(PARAMS).encode()]
    # Given as a JSON string, as older python backends took them.
    result = client.infer("response_params", _inputs(httpclient, PARAMS=json.dumps({"as_text": True, "a": "1"})))
    assert result.get_response()["parameters"] == {"a": "1"}
    # None set: no "parameters" member, as Triton answers.
    assert "parameters" not in client.infer("response_params", _inputs(httpclient, PARAMS="{}")).get_response()


def test_grpc_responses_carry_the_models_parameters_typed(server: GeserveProcess) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    result = client.infer("response_params", _inputs(grpcclient, PARAMS=json.dumps(PARAMS)))
    assert _grpc_parameters(result.get_response()) == PARAMS
    kinds = {key: p.WhichOneof("parameter_choice") for key, p in result.get_response().parameters.items()}
    assert kinds == {"flag": "bool_param", "count": "int64_param", "text": "string_param", "big": "int64_param"}


def test_asyncio_clients_read_the_parameters(server: GeserveProcess) -> None:
    async def run() -> None:
        http = httpaio.InferenceServerClient(server.url)
        grpc = grpcaio.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        try:
            result = await http.infer("response_params", _inputs(httpaio, PARAMS=json.dumps({"http": 1})))
            assert result.get_response()["parameters"] == {"http": 1}
            answered = await grpc.infer("response_params", _inputs(grpcaio, PARAMS=json.dumps({"grpc": 2})))
            assert _grpc_parameters(answered.get_response()) == {"grpc": 2}
        finally:
            await http.close()
            await grpc.close()

    asyncio.run(run())


def _stream(server: GeserveProcess, model: str, text: str, **options: Any) -> list[Any]:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    client.async_stream_infer(model, _inputs(grpcclient, PARAMS=text), **options)
    client.stop_stream()  # waits for the stream to end
    collected = []
    while not answers.empty():
        result, error = answers.get()
        assert error is None, error
        collected.append(result.get_response())
    return collected


def test_streams_carry_each_responses_parameters(server: GeserveProcess) -> None:
    sent = [{"bool": False, "int": 2048}, {"str": "Hello World!"}, {}]
    responses = _stream(server, "response_params_decoupled", json.dumps(sent))
    # triton_final_response joins the model's own on every streamed response (Triton's stream handler sets it on each).
    assert [_grpc_parameters(response) for response in responses] == [
        {**parameters, "triton_final_response": False} for parameters in sent
    ]
    # With the empty final response asked for, the stream ends with one; triton_final_response wins over the model's.
    sent = [{"int": 1}, {"triton_final_response": "the model's"}]
    responses = _stream(server, "response_params_decoupled", json.dumps(sent), enable_empty_final_response=True)
    got = [_grpc_parameters(response) for response in responses]
    assert got == [
        {"int": 1, "triton_final_response": False},
        {"triton_final_response": False},
        {"triton_final_response": True},
    ]
    # A model that is not decoupled, through ModelStreamInfer.
    responses = _stream(server, "response_params", json.dumps({"streamed": True}))
    assert [_grpc_parameters(response) for response in responses] == [{"streamed": True, "triton_final_response": True}]


def test_cached_responses_answer_with_their_parameters(server: GeserveProcess) -> None:
    client = httpclient.InferenceServerClient(server.url)
    text = json.dumps({"calls": 0, "cached": "yes"})
    first = client.infer("response_params", _inputs(httpclient, PARAMS=text)).get_response()["parameters"]
    again = client.infer("response_params", _inputs(httpclient, PARAMS=text)).get_response()["parameters"]
    assert first["cached"] == "yes" and first["calls"] >= 1
    assert again == first  # the model did not run again: its call count would have grown
    stats = client.get_inference_statistics("response_params")["model_stats"][0]["inference_stats"]
    assert int(stats["cache_hit"]["count"]) >= 1


def test_ensemble_answers_with_its_last_steps_parameters(server: GeserveProcess) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    result = client.infer("params_ensemble", _inputs(grpcclient, PARAMS=json.dumps({"via": "ensemble"})))
    assert _grpc_parameters(result.get_response()) == {"via": "ensemble", "step": "tail"}
    http = httpclient.InferenceServerClient(server.url)
    result = http.infer("params_ensemble", _inputs(httpclient, PARAMS=json.dumps({"via": "http"})))
    assert result.get_response()["parameters"] == {"via": "http", "step": "tail"}


def test_bls_responses_give_their_parameters_as_json_text(server: GeserveProcess) -> None:
    client = httpclient.InferenceServerClient(server.url)
    streamed = [{"bool": True, "int": 10000}, {"str": "?"}]
    inputs = _inputs(httpclient, PARAMS=json.dumps({"bls": "unary"}), STREAMED=json.dumps(streamed))
    result = client.infer("response_params_bls", inputs)
    texts = json.loads(result.as_numpy("OUTPUT")[0])
    assert [json.loads(text) for text in texts] == [{"bls": "unary"}, *streamed]
    assert result.get_response()["parameters"] == {"bls": "unary"}


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"int": 2, "float": 0.5}, "Expect parameters values to have type bool/int/str, found type <class 'float'>"),
        ({"null": None}, "Expect parameters values to have type bool/int/str, found type <class 'NoneType'>"),
        ({"list": ["variable"]}, "Expect parameters values to have type bool/int/str, found type <class 'list'>"),
        ([], "Expect dict, got <class 'list'>"),
    ],
)
def test_a_parameter_of_a_type_triton_refuses_fails_the_request_then_a_good_one_succeeds(
    server: GeserveProcess, parameters: Any, message: str
) -> None:
    http = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as refused:
        http.infer("response_params", _inputs(httpclient, PARAMS=json.dumps(parameters)))
    assert message in refused.value.message()
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    with pytest.raises(InferenceServerException) as refused:
        grpc.infer("response_params", _inputs(grpcclient, PARAMS=json.dumps(parameters)))
    assert message in refused.value.message()
    good = http.infer("response_params", _inputs(httpclient, PARAMS=json.dumps({"ok": True})))
    assert good.get_response()["parameters"] == {"ok": True}

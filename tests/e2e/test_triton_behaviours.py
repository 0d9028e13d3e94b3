"""Behaviours Triton's own tests pin down, through tritonclient: ensemble parameters, the python backend's rules."""

from __future__ import annotations

import concurrent.futures
import json
import queue
import re
import textwrap
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, config_text, wait_until, write_python_model

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
# IN picks what execute does; OUT says what happened. Texts of the sender's refusals go to the log.
SENDER_DEFAULT = textwrap.dedent(
    """
    import threading
    import time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

    def answer(text):
        return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([text.encode()], dtype=np.object_))])

    def refused(call):
        try:
            call()
        except pb_utils.TritonModelException as error:
            pb_utils.Logger.log_info("refused: " + str(error))

    class TritonPythonModel:
        def initialize(self, args):
            self.instance = args["model_instance_name"]

        def execute(self, requests):
            returned = []
            for request in requests:
                mode = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
                sender = request.get_response_sender()
                if mode == 0:  # answered later, from another thread
                    def later(sender=sender):
                        time.sleep(0.3)
                        sender.send(answer("later from " + self.instance), FINAL)
                    threading.Thread(target=later).start()
                    returned = None
                elif mode == 1:  # a response, then the final flag alone; then everything Triton refuses
                    refused(lambda: sender.send(flags=FINAL))
                    refused(lambda: sender.send(None, 0))
                    refused(lambda: sender.send(answer("x"), 2))
                    sender.send(answer("response then final"))
                    refused(lambda: sender.send(answer("second")))
                    sender.send(flags=FINAL)
                    refused(lambda: sender.send(flags=FINAL))
                    returned = None
                elif mode == 2:  # answered through the sender without the final flag, and in the list too
                    sender.send(answer("sent"))
                    returned.append(answer("returned"))
                elif mode == 3:  # never answered: waited for until its client goes away
                    returned = None
            return returned
    """
)
DECOUPLED_RETURNS = textwrap.dedent(
    """
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            return [
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([b"x"], dtype=np.object_))])
                for _ in requests
            ]
    """
)
UNKNOWN_ERROR = textwrap.dedent(
    """
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            error = pb_utils.TritonError("nobody knows", pb_utils.TritonError.UNKNOWN)
            return [pb_utils.InferenceResponse([], error=error) for _ in requests]
    """
)
STREAMS_THEN_FAILS = textwrap.dedent(
    """
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            for request in requests:
                sender = request.get_response_sender()
                for text in (b"one", b"two"):
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([text], dtype=np.object_))]))
                error = pb_utils.TritonError("the third went wrong", pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse([], error=error), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
    """
)
TICKS = textwrap.dedent(
    """
    import time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            for request in requests:
                tag = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
                sender = request.get_response_sender()
                deadline = time.monotonic() + 20
                while not sender.is_cancelled() and time.monotonic() < deadline:
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([b"tick"], dtype=np.object_))]))
                    time.sleep(0.05)
                pb_utils.Logger.log_info(f"ticks {tag} cancelled: {sender.is_cancelled()}")
                if not sender.is_cancelled():
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
    """
)
BLS_CANCEL = textwrap.dedent(
    """
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                mode = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
                call = pb_utils.InferenceRequest(
                    model_name="ticks", inputs=[pb_utils.Tensor("IN", np.array([mode], dtype=np.int32))],
                    requested_output_names=["OUT"],
                )
                iterator = call.exec(decoupled=True)
                first = next(iterator)
                text = first.output_tensors()[0].as_numpy()[0].decode()
                if mode == 1:  # cancel, then read to the end
                    iterator.cancel()
                    rest = list(iterator)
                    errors = [r.error().message() for r in rest if r.has_error()]
                    text += f" then {len(rest)} more, errors {errors}"
                else:  # dropped unfinished
                    del iterator
                responses.append(
                    pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([text.encode()], dtype=np.object_))])
                )
            return responses
    """
)
ARGV_PROBE = textwrap.dedent(
    """
    import json
    import sys
    import unittest
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            program = unittest.main(module=None, exit=False)  # parses sys.argv, as a model's own tests do
            text = json.dumps({"argv": sys.argv, "ran": program.result.testsRun})
            out = pb_utils.Tensor("OUT", np.array([text.encode()], dtype=np.object_))
            return [pb_utils.InferenceResponse([out]) for _ in requests]
    """
)
METRIC_CHECKS = textwrap.dedent(
    """
    import json
    import numpy as np
    import triton_python_backend_utils as pb_utils

    MF = pb_utils.MetricFamily

    def refusal(call):
        try:
            call()
        except pb_utils.TritonModelException as error:
            return str(error)
        return "accepted"

    class TritonPythonModel:
        def initialize(self, args):
            self.gauges = MF(name="checks_gauge", description="a gauge", kind=MF.GAUGE)
            self.gauge = self.gauges.Metric(labels={"model": "metric_checks"})

        def execute(self, requests):
            value = int(pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()[0])
            self.gauge.set(float(value))  # seen by the next scrape
            counters = MF(name="checks_counter", description="a counter", kind=MF.COUNTER)
            histograms = MF(name="checks_histogram", description="a histogram", kind=MF.HISTOGRAM)
            counter = counters.Metric(labels={"k": "v"})
            histogram = histograms.Metric(labels={"k": "v"}, buckets=[1.0, 2.0])
            dropped = MF(name="checks_dropped", description="dropped", kind=MF.COUNTER)
            orphan = dropped.Metric()
            del dropped
            found = {
                "kind": refusal(lambda: MF(name="checks_counter", description="other", kind=MF.GAUGE)),
                "labels": refusal(lambda: counters.Metric(labels=["k"])),
                "label value": refusal(lambda: counters.Metric(labels={"k": 1})),
                "buckets type": refusal(lambda: histograms.Metric(buckets=(1.0, 2.0))),
                "unexpected buckets": refusal(lambda: counters.Metric(buckets=[1.0])),
                "missing buckets": refusal(lambda: histograms.Metric()),
                "unsorted": refusal(lambda: histograms.Metric(labels={"k": "w"}, buckets=[2.0, 1.0])),
                "duplicate": refusal(lambda: histograms.Metric(labels={"k": "x"}, buckets=[1.0, 1.0])),
                "negative": refusal(lambda: counter.increment(-1)),
                "counter set": refusal(lambda: counter.set(1)),
                "counter observe": refusal(lambda: counter.observe(1)),
                "histogram increment": refusal(lambda: histogram.increment(1)),
                "histogram value": refusal(lambda: histogram.value()),
                "after family": refusal(lambda: orphan.increment(1)),
                "same family": refusal(lambda: MF(name="checks_counter", description="again", kind=MF.COUNTER)),
            }
            out = pb_utils.Tensor("OUT", np.array([json.dumps(found).encode()], dtype=np.object_))
            return [pb_utils.InferenceResponse([out]) for _ in requests]
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
    for name, model_py, decoupled in (
        ("sender_default", SENDER_DEFAULT, False),
        ("decoupled_returns", DECOUPLED_RETURNS, True),
        ("unknown_error", UNKNOWN_ERROR, False),
        ("streams_then_fails", STREAMS_THEN_FAILS, True),
        ("ticks", TICKS, True),
        ("bls_cancel", BLS_CANCEL, False),
        ("argv_probe", ARGV_PROBE, False),
        ("metric_checks", METRIC_CHECKS, False),
    ):
        policy = "model_transaction_policy { decoupled: true }" if decoupled else ""
        config = config_text(
            name,
            backend="python",
            inputs=[("IN", "TYPE_INT32", "1")],
            outputs=[("OUT", "TYPE_STRING", "1")],
            extra=f"{policy}\ninstance_group [ {{ kind: KIND_CPU count: 2 }} ]",
        )
        write_python_model(repository, name, model_py, config)
    (repository / "parameters_ensemble" / "1").mkdir(parents=True)
    (repository / "parameters_ensemble" / "config.pbtxt").write_text(ENSEMBLE_OF_ECHO)
    # A model with a per-host config (--model-config-name), and one without: config.pbtxt serves it.
    for name, host_config in (("per_host", True), ("one_config", False)):
        config = config_text(
            name, backend="python", inputs=[("IN", "TYPE_INT32", "1")], outputs=[("PARAMETERS", "TYPE_STRING", "1")]
        )
        folder = write_python_model(
            repository, name, PARAMETERS_ECHO, config + 'parameters { key: "host" value { string_value: "any" } }'
        )
        if host_config:
            (folder / "configs").mkdir()
            (folder / "configs" / "h100.pbtxt").write_text(
                config + 'parameters { key: "host" value { string_value: "h100" } }'
            )
    process = GeserveProcess(
        root / "geserve.log",
        f"--model-repository={repository}",
        "--model-config-name=h100",
        "--http-header-forward-pattern=^x-forward|^priority$",
        "--grpc-header-forward-pattern=^x-forward",
    ).wait_live()
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


def _text(result: Any) -> str:
    return str(result.as_numpy("OUT")[0].decode())


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_a_default_mode_model_answers_through_its_response_sender(server: GeserveProcess, module: Any) -> None:
    """python_backend's InferenceResponseSender in the default mode (PR #364): one response and FINAL per request,
    sent during execute or after it returns None; what Triton refuses is refused with its texts."""
    url = server.url if module is httpclient else f"127.0.0.1:{server.grpc_port}"
    client = module.InferenceServerClient(url)
    assert _text(client.infer("sender_default", [_int_input(module, 0)])) in {
        "later from sender_default_0_0",
        "later from sender_default_0_1",
    }
    assert _text(client.infer("sender_default", [_int_input(module, 1)])) == "response then final"
    refusals = [line.split("refused: ", 1)[1] for line in server.log().splitlines() if "refused: " in line]
    assert refusals[:5] == [
        "Unable to send response. Non-decoupled model cannot send complete final before sending a response.",
        "Inference Response object must be provided when the response flags is set to zero.",
        "Unable to send response. Unsupported flag provided.",
        "Unable to send response. Non-decoupled model cannot send more than one response.",
        "Unable to send response. Response sender has been closed.",
    ]
    with pytest.raises(InferenceServerException) as error:
        client.infer("sender_default", [_int_input(module, 2)])
    assert error.value.message().endswith(
        "', message: Unable to send response. Non-decoupled model cannot send more than one response."
    ), error.value.message()
    assert "Failed to process the request(s) for model 'sender_default_0_" in error.value.message()
    assert _text(client.infer("sender_default", [_int_input(module, 1)])) == "response then final"


def test_a_decoupled_model_whose_execute_returns_responses_fails_the_request_with_tritons_text(
    server: GeserveProcess,
) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("decoupled_returns", [_int_input(grpcclient)], enable_empty_final_response=True)
        result, error = answers.get(timeout=30)
    finally:
        client.stop_stream()
    assert result is None and error is not None
    assert re.fullmatch(
        r"Failed to process the request\(s\) for model 'decoupled_returns_0_[01]', message: Python model "
        r"'decoupled_returns' is using the decoupled mode and the execute function must return None\.",
        error.message(),
    ), error.message()


def test_a_models_unknown_error_is_400_over_http_and_unknown_over_grpc(server: GeserveProcess) -> None:
    """TRITONSERVER_ERROR_UNKNOWN maps as Triton maps it (http_server.cc HttpCodeFromError, grpc_utils.cc)."""
    with pytest.raises(InferenceServerException) as error:
        httpclient.InferenceServerClient(server.url).infer("unknown_error", [_int_input(httpclient)])
    assert error.value.status() == "400" and error.value.message() == "nobody knows"
    with pytest.raises(InferenceServerException) as error:
        grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}").infer(
            "unknown_error", [_int_input(grpcclient)]
        )
    assert error.value.status() == "StatusCode.UNKNOWN" and error.value.message() == "nobody knows"


def _streamed(
    server: GeserveProcess, model: str, value: int = 0, headers: dict[str, str] | None = None
) -> list[tuple[Any, Any]]:
    """What a stream's callback got for one request, until the stream went quiet or closed."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=headers)
    got: list[tuple[Any, Any]] = []
    try:
        client.async_stream_infer(model, [_int_input(grpcclient, value)])
        got.append(answers.get(timeout=30))
        while True:
            try:
                got.append(answers.get(timeout=1.0))
            except queue.Empty:
                break
    finally:
        client.stop_stream()
    return got


def test_every_streamed_response_says_whether_it_is_the_last(server: GeserveProcess) -> None:
    """triton_final_response on every response of a stream, asked for or not (stream_infer_handler.cc)."""
    for model, finals in (("sender_default", [True]), ("streams_then_fails", [False, False])):
        got = _streamed(server, model, value=1)
        results = [result for result, error in got if result is not None]
        flags = [result.get_response().parameters["triton_final_response"].bool_param for result in results]
        assert flags == finals, (model, got)


def test_a_decoupled_error_after_responses_closes_the_stream_with_its_status_when_asked(server: GeserveProcess) -> None:
    """Without triton_grpc_error the error is a message and the stream stays open; with it, the responses before
    it arrive and the stream ends with the error's status."""
    got = _streamed(server, "streams_then_fails")
    assert [_text(result) for result, error in got if result is not None] == ["one", "two"]
    errors = [error for result, error in got if error is not None]
    assert [error.message() for error in errors] == ["the third went wrong"], got
    got = _streamed(server, "streams_then_fails", headers={"triton_grpc_error": "true"})  # closes the stream
    assert [_text(result) for result, error in got if result is not None] == ["one", "two"]
    errors = [error for result, error in got if error is not None]
    assert len(errors) == 1 and errors[0].status() == "StatusCode.INVALID_ARGUMENT", got
    assert "the third went wrong" in errors[0].message()


@pytest.mark.parametrize(("mode", "how"), [(1, "cancel"), (2, "drop")])
def test_a_bls_response_iterator_cancelled_or_dropped_cancels_its_callee(
    server: GeserveProcess, mode: int, how: str
) -> None:
    """ResponseIterator.cancel() cancels the callee (its is_cancelled() turns true) and the iterator ends; so does
    dropping an unfinished iterator."""
    client = httpclient.InferenceServerClient(server.url)
    text = _text(client.infer("bls_cancel", [_int_input(httpclient, mode)]))
    assert text.startswith("tick"), text
    if how == "cancel":
        assert text.endswith("errors ['Request was cancelled']"), text
    assert wait_until(lambda: f"ticks {mode} cancelled: True" in server.log(), 15), server.log()[-3000:]
    assert f"ticks {mode} cancelled: False" not in server.log()


def test_a_model_sees_the_stubs_command_line_not_the_servers(server: GeserveProcess) -> None:
    """sys.argv is [''] as in Triton's stub (pybind11's interpreter without arguments): unittest.main(exit=False)
    inside a model runs instead of failing on the server's flags."""
    seen = json.loads(_text(httpclient.InferenceServerClient(server.url).infer("argv_probe", [_int_input(httpclient)])))
    assert seen == {"argv": [""], "ran": 0}


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_headers_the_pattern_matches_reach_the_model_and_its_ensembles_steps(
    server: GeserveProcess, module: Any
) -> None:
    """--http-header-forward-pattern / --grpc-header-forward-pattern: matching headers become string request
    parameters (matched anywhere in the name, ignoring case), as Triton's."""
    url = server.url if module is httpclient else f"127.0.0.1:{server.grpc_port}"
    client = module.InferenceServerClient(url)
    # HTTP header names are matched ignoring case (and arrive lowercase); gRPC metadata keys are lowercase.
    headers = {"X-Forward-Tenant" if module is httpclient else "x-forward-tenant": "blue", "x-other": "not forwarded"}
    for model in ("parameters_echo", "parameters_ensemble"):
        seen = _seen_parameters(client.infer(model, [_int_input(module)], parameters={"own": 1}, headers=headers))
        assert seen == {"own": 1, "x-forward-tenant": "blue"}, (model, seen)


def test_a_forwarded_header_with_a_reserved_name_is_refused_with_tritons_text(server: GeserveProcess) -> None:
    client = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as error:
        client.infer("parameters_echo", [_int_input(httpclient)], headers={"priority": "1"})
    assert error.value.status() == "400"
    assert error.value.message() == "Header 'priority' is reserved for Triton usage and cannot be forwarded."
    assert _seen_parameters(client.infer("parameters_echo", [_int_input(httpclient)])) == {}


def test_model_config_name_picks_a_models_per_host_config_where_it_has_one(server: GeserveProcess) -> None:
    """--model-config-name h100: configs/h100.pbtxt over config.pbtxt, which serves a model without one."""
    client = httpclient.InferenceServerClient(server.url)
    for model, host in (("per_host", "h100"), ("one_config", "any")):
        config = client.get_model_config(model)
        assert config["parameters"]["host"]["string_value"] == host, (model, config)


def test_custom_metrics_are_checked_as_tritons_and_seen_by_the_next_scrape(server: GeserveProcess) -> None:
    """pb_utils.MetricFamily and Metric refuse what Triton refuses, in its words; a value set in execute is on the
    very next /metrics, not a polling interval later."""
    client = httpclient.InferenceServerClient(server.url)
    for value in (17, 42):
        found = json.loads(_text(client.infer("metric_checks", [_int_input(httpclient, value)])))
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
        assert f'checks_gauge{{model="metric_checks"}} {value}' in scraped, scraped[-2000:]
    assert "checks_dropped" not in scraped  # its family went away, and its metrics with it
    kind = "TRITONSERVER_METRIC_KIND_"
    assert found == {
        "kind": "Error when creating MetricFamily: Family name already exists with different type",
        "labels": "Failed to create metric. Labels must be a dictionary.",
        "label value": "Error when creating Metric: attempt to access JSON non-string as string",
        "buckets type": "Failed to create metric. Buckets must be a list.",
        "unexpected buckets": "Failed to create metric. Unexpected buckets found.",
        "missing buckets": "Failed to create metric. Missing required buckets.",
        "unsorted": "Error when creating Metric: Bucket Boundaries must be strictly sorted",
        "duplicate": "Error when creating Metric: Bucket Boundaries must be strictly sorted",
        "negative": f"Failed to increment metric value: {kind}COUNTER can only be incremented monotonically by "
        "non-negative values.",
        "counter set": f"Failed to set metric value: {kind}COUNTER does not support Set",
        "counter observe": f"Failed to observe metric value: {kind}COUNTER does not support Observe",
        "histogram increment": f"Failed to increment metric value: {kind}HISTOGRAM does not support Increment",
        "histogram value": f"Failed to get metric value: {kind}HISTOGRAM does not support Value",
        "after family": "Failed to increment metric value: Invalid metric operation as the corresponding "
        "'MetricFamily' has been deleted. The 'MetricFamily' object should be deleted AFTER its corresponding "
        "'Metric' objects have been deleted.",
        "same family": "accepted",
    }


def test_a_request_the_model_never_answers_through_its_sender_ends_when_its_client_goes_away(
    server: GeserveProcess,
) -> None:
    """Triton waits for a default-mode request's final response without end; a client that gives up (its deadline)
    cancels it, and the instance serves the next request instead of waiting on for ever."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    for _ in range(2):  # one on each of the model's two instances
        with pytest.raises(InferenceServerException) as error:
            client.infer("sender_default", [_int_input(grpcclient, 3)], client_timeout=1.0)
        assert "DEADLINE_EXCEEDED" in str(error.value.status())
    assert (
        _text(client.infer("sender_default", [_int_input(grpcclient, 1)], client_timeout=30)) == "response then final"
    )

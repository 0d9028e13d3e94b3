"""BLS (python models calling models with InferenceRequest.exec / async_exec) through tritonclient."""

from __future__ import annotations

import functools
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, copy_model, run_on_threads, segments_of_server, write_identity_model

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]
PYTHON_MODELS = Path(__file__).resolve().parents[1] / "python_models"


@pytest.fixture(scope="module")
def bls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("bls")
    repository = root / "models"
    repository.mkdir()
    for name in ("simple", "digits", "bls_example", "repeat_int32"):
        copy_model(name, repository)
    for name in ("bls_call", "bls_async", "bls_stream", "bls_loop", "bls_first", "bls_abandon"):
        shutil.copytree(PYTHON_MODELS / name, repository / name)
    shutil.copytree(PYTHON_MODELS / "bls_recurse", repository / "bls_recurse")
    # One instance: its first call to itself can only wait for itself.
    single = repository / "bls_self"
    shutil.copytree(PYTHON_MODELS / "bls_recurse", single)
    config = single / "config.pbtxt"
    config.write_text(config.read_text().replace('"bls_recurse"', '"bls_self"').replace("count: 2", "count: 1"))
    # One instance, which calls an ensemble whose step is itself: the loop goes around the ensemble.
    around = repository / "bls_around"
    shutil.copytree(PYTHON_MODELS / "bls_recurse", around)
    config = around / "config.pbtxt"
    config.write_text(
        config.read_text().replace('"bls_recurse"', '"bls_around"').replace("count: 2", "count: 1")
        + 'parameters { key: "target" value { string_value: "around_ensemble" } }\n'
    )
    (repository / "around_ensemble").mkdir()
    (repository / "around_ensemble" / "1").mkdir()
    (repository / "around_ensemble" / "config.pbtxt").write_text(
        'name: "around_ensemble" platform: "ensemble" max_batch_size: 0\n'
        'input [ { name: "DEPTH" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "bls_around" model_version: -1 '
        'input_map { key: "DEPTH" value: "DEPTH" } output_map { key: "OUT" value: "OUT" } } ] }\n'
    )
    write_identity_model(repository, "echo", max_batch_size=0)
    write_identity_model(
        repository,
        "slow_echo",
        max_batch_size=0,
        extra='parameters { key: "execute_delay_ms" value { string_value: "2000" } }',
    )
    process = GeserveProcess(root / "geserve.log", f"--model-repository={repository}").wait_live()
    yield process
    assert process.stop() == 0, process.log()


def _inputs(module: Any, arrays: dict[str, tuple[np.ndarray, str]]) -> list[Any]:
    tensors = []
    for name, (array, datatype) in arrays.items():
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _example_inputs(seed: int) -> dict[str, tuple[np.ndarray, str]]:
    rng = np.random.default_rng(seed)
    return {
        "INPUT0": (rng.integers(-100, 100, size=(1, 16), dtype=np.int32), "INT32"),
        "INPUT1": (rng.integers(-100, 100, size=(1, 16), dtype=np.int32), "INT32"),
        "PIXELS": (rng.uniform(0, 16, size=(1, 64)).astype(np.float32), "FP32"),
    }


def _check_example(client: Any, module: Any, arrays: dict[str, tuple[np.ndarray, str]]) -> None:
    result = client.infer("bls_example", _inputs(module, arrays))
    left, right = arrays["INPUT0"][0], arrays["INPUT1"][0]
    np.testing.assert_array_equal(result.as_numpy("SUM"), left + right)
    np.testing.assert_array_equal(result.as_numpy("DIFFERENCE"), left - right)
    digits = client.infer("digits", _inputs(module, {"pixels": arrays["PIXELS"]})).as_numpy("probabilities")
    assert result.as_numpy("DIGIT").tolist() == digits.argmax(axis=1).tolist()


def test_shipped_bls_model_calls_simple_and_digits(bls_server: GeserveProcess) -> None:
    _check_example(httpclient.InferenceServerClient(bls_server.url), httpclient, _example_inputs(1))
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{bls_server.grpc_port}")
    _check_example(grpc, grpcclient, _example_inputs(2))


def test_concurrent_clients_of_a_bls_model_each_get_their_own_answer(bls_server: GeserveProcess) -> None:
    def client(seed: int) -> None:
        with httpclient.InferenceServerClient(bls_server.url) as own:
            for round_ in range(4):
                _check_example(own, httpclient, _example_inputs(100 * seed + round_))

    run_on_threads([functools.partial(client, seed) for seed in range(8)])


def _call(server: GeserveProcess, target: str, data: np.ndarray, timeout_us: int = 0) -> tuple[np.ndarray, str]:
    http = httpclient.InferenceServerClient(server.url, network_timeout=60)
    arrays = {
        "TARGET": (np.array([target.encode()], dtype=np.object_), "BYTES"),
        "DATA": (data, "FP32"),
        "TIMEOUT_US": (np.array([timeout_us], dtype=np.int64), "INT64"),
    }
    result = http.infer("bls_call", _inputs(httpclient, arrays))
    return result.as_numpy("OUTPUT"), result.as_numpy("ERROR")[0].decode()


def test_a_bls_call_returns_the_target_models_outputs(bls_server: GeserveProcess) -> None:
    data = np.linspace(-1, 1, 7, dtype=np.float32)
    output, error = _call(bls_server, "echo", data)
    assert error == "" and output.tolist() == data.tolist()


def test_a_bls_call_to_a_missing_model_answers_with_an_error(bls_server: GeserveProcess) -> None:
    output, error = _call(bls_server, "does_not_exist", np.ones(3, dtype=np.float32))
    assert error == "Request for unknown model: 'does_not_exist' is not found" and output.size == 0
    assert _call(bls_server, "echo", np.ones(3, dtype=np.float32))[1] == ""


def test_a_bls_call_with_a_timeout_gives_up_on_a_slow_model(bls_server: GeserveProcess) -> None:
    started = time.monotonic()
    output, error = _call(bls_server, "slow_echo", np.ones(3, dtype=np.float32), timeout_us=200_000)
    assert error == "Request timeout expired" and output.size == 0
    assert time.monotonic() - started < 1.8  # the slow model takes 2 s
    assert _call(bls_server, "echo", np.ones(3, dtype=np.float32))[1] == ""


def test_a_bls_call_to_a_model_that_itself_uses_bls_async(bls_server: GeserveProcess) -> None:
    data = np.arange(5, dtype=np.float32)
    output, error = _call(bls_server, "bls_async", data)
    assert error == "" and output.tolist() == (2 * data).tolist()


def test_a_decoupled_target_streams_its_responses_to_the_caller(bls_server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(bls_server.url)
    values = np.array([4, 8, 15, 16, 23, 42], dtype=np.int32)
    result = http.infer("bls_stream", _inputs(httpclient, {"IN": (values, "INT32")}))
    assert result.as_numpy("OUT").tolist() == values.tolist()


CYCLE = "BLS call cycle"


def test_a_model_calling_itself_fails_with_the_cycle_not_the_timeout(bls_server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(bls_server.url, network_timeout=30)
    for _ in range(2):  # the instance is free again after each
        result = http.infer("bls_loop", _inputs(httpclient, {"INPUT0": (np.ones(2, dtype=np.float32), "FP32")}))
        message = result.as_numpy("ERROR")[0].decode()
        assert message.startswith(f"{CYCLE}: 'bls_loop' -> 'bls_loop'"), message
    stats = http.get_inference_statistics("bls_loop")["model_stats"][0]["inference_stats"]
    # The refused calls never queued: only the two client requests ran.
    assert stats["success"]["count"] == 2


def _depth(value: int) -> dict[str, tuple[np.ndarray, str]]:
    return {"DEPTH": (np.array([value], dtype=np.int32), "INT32")}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_model_calling_itself_without_a_timeout_gets_an_error_naming_the_cycle(
    bls_server: GeserveProcess, protocol: str
) -> None:
    """bls_self has one instance: the call it makes to itself could only run there, where its caller waits."""
    if protocol == "http":
        client: Any = httpclient.InferenceServerClient(bls_server.url, network_timeout=60)
        module: Any = httpclient
    else:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{bls_server.grpc_port}")
        module = grpcclient
    with client:
        for _ in range(2):
            with pytest.raises(InferenceServerException) as refused:
                client.infer("bls_self", _inputs(module, _depth(1)))
            text = str(refused.value)
            assert f"{CYCLE}: 'bls_self' -> 'bls_self'" in text and "(1)" in text, text
            # The instance is free again: a request that does not call itself is answered.
            assert client.infer("bls_self", _inputs(module, _depth(0))).as_numpy("OUT").tolist() == [0]


def test_a_chain_of_calls_is_refused_only_once_it_holds_every_instance(bls_server: GeserveProcess) -> None:
    """bls_recurse has two instances: one call to itself runs on the other; a second could not run anywhere."""
    http = httpclient.InferenceServerClient(bls_server.url, network_timeout=60)
    assert http.infer("bls_recurse", _inputs(httpclient, _depth(1))).as_numpy("OUT").tolist() == [1]
    with pytest.raises(InferenceServerException, match="'bls_recurse' -> 'bls_recurse' -> 'bls_recurse'"):
        http.infer("bls_recurse", _inputs(httpclient, _depth(2)))
    assert http.infer("bls_recurse", _inputs(httpclient, _depth(1))).as_numpy("OUT").tolist() == [1]
    http.close()


def test_a_model_may_stop_listening_to_a_decoupled_target(bls_server: GeserveProcess) -> None:
    """The responses it no longer reads are dropped (their shared memory too: the session checks)."""
    http = httpclient.InferenceServerClient(bls_server.url)
    for first in (5, 9):
        values = np.array([first, 2, 3, 4], dtype=np.int32)
        result = http.infer("bls_first", _inputs(httpclient, {"IN": (values, "INT32")}))
        assert result.as_numpy("OUT").tolist() == [first]
    time.sleep(0.3)  # the rest of the stream arrives meanwhile
    assert http.infer("bls_first", _inputs(httpclient, {"IN": (values, "INT32")})).as_numpy("OUT").tolist() == [9]


def _settled_segments(pid: int, below: int, timeout_s: float = 30.0) -> set[str]:
    """The server's segments once their number falls to `below` or less (the streams' last responses are still
    arriving when the calls return), or as they are when `timeout_s` runs out."""
    deadline = time.monotonic() + timeout_s
    names = segments_of_server(pid)
    while len(names) > below and time.monotonic() < deadline:
        time.sleep(0.1)
        names = segments_of_server(pid)
    return names


@pytest.mark.parametrize("model", ["bls_first", "bls_abandon"])
def test_streams_a_model_stops_reading_leave_no_shared_memory_behind(bls_server: GeserveProcess, model: str) -> None:
    """bls_first drops its stream after the first response; bls_abandon breaks out of one with responses already
    waiting unread, and drops another it never read."""
    http = httpclient.InferenceServerClient(bls_server.url)
    values = np.array([7, 2, 3, 4, 5, 6], dtype=np.int32)
    assert http.infer(model, _inputs(httpclient, {"IN": (values, "INT32")})).as_numpy("OUT").tolist() == [7]
    before = _settled_segments(bls_server.process.pid, 0, timeout_s=5.0)
    for first in range(40):
        values[0] = first
        result = http.infer(model, _inputs(httpclient, {"IN": (values, "INT32")}))
        assert result.as_numpy("OUT").tolist() == [first]
    after = _settled_segments(bls_server.process.pid, len(before))
    assert after <= before, f"segments left by abandoned BLS streams: {sorted(after - before)[:5]}"
    assert http.infer(model, _inputs(httpclient, {"IN": (values, "INT32")})).as_numpy("OUT").tolist() == [39]
    http.close()


def test_a_cycle_around_an_ensemble_is_refused_too(bls_server: GeserveProcess) -> None:
    """bls_around (one instance) calls around_ensemble, whose step is bls_around."""
    http = httpclient.InferenceServerClient(bls_server.url, network_timeout=60)
    assert http.infer("around_ensemble", _inputs(httpclient, _depth(0))).as_numpy("OUT").tolist() == [0]
    with pytest.raises(InferenceServerException, match=f"{CYCLE}: 'bls_around' -> 'bls_around'"):
        http.infer("bls_around", _inputs(httpclient, _depth(1)))
    assert http.infer("bls_around", _inputs(httpclient, _depth(0))).as_numpy("OUT").tolist() == [0]
    http.close()


def test_concurrent_self_calls_that_hold_every_instance_are_broken_not_deadlocked(bls_server: GeserveProcess) -> None:
    """Requests to bls_recurse (two instances) side by side, each calling the model once: when both instances
    wait for a call queued behind them, one call fails with the cycle's error and the rest are answered."""
    answers: list[Any] = []

    def one() -> None:
        with httpclient.InferenceServerClient(bls_server.url, network_timeout=60) as client:
            for _ in range(5):
                try:
                    result = client.infer("bls_recurse", _inputs(httpclient, _depth(1)))
                    answers.append(result.as_numpy("OUT").tolist())
                except InferenceServerException as error:
                    answers.append(str(error))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(answers) == 20, "requests did not come back"
    for answer in answers:  # each answered: its value, or the cycle's error, never a timeout
        assert answer == [1] or (isinstance(answer, str) and CYCLE in answer), answer
    http = httpclient.InferenceServerClient(bls_server.url, network_timeout=60)
    assert http.infer("bls_recurse", _inputs(httpclient, _depth(1))).as_numpy("OUT").tolist() == [1]
    http.close()

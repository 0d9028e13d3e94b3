"""Ensembles through tritonclient: the shipped pipeline's values, parallel steps, load errors, failures, control."""

from __future__ import annotations

import functools
import os
import queue
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.e2e.test_worker_pool import worker_pids
from tests.support import (
    MODEL_REPOSITORY,
    GeserveProcess,
    copy_model,
    run_on_threads,
    run_perf_analyzer,
    write_identity_model,
)

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]
Launch = Callable[..., GeserveProcess]
PYTHON_MODELS = Path(__file__).resolve().parents[1] / "python_models"


def ensemble(name: str, body: str, max_batch_size: int = 8) -> str:
    return f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: {max_batch_size}\n{body}\n'


def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    maps += " " + " ".join(f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: -1 {maps} }}'


def write_ensemble(repository: Path, name: str, text: str) -> None:
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(text)


def images(count: int, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(count, 8, 8), dtype=np.uint8)


def by_hand(client: httpclient.InferenceServerClient, image: np.ndarray) -> tuple[bytes, float]:
    """The three models called one by one from the client: what the ensemble must answer."""
    tensor = httpclient.InferInput("IMAGE", list(image.shape), "UINT8")
    tensor.set_data_from_numpy(image)
    pixels = client.infer("digits_preprocess", [tensor]).as_numpy("PIXELS")
    tensor = httpclient.InferInput("pixels", list(pixels.shape), "FP32")
    tensor.set_data_from_numpy(pixels)
    probabilities = client.infer("digits", [tensor]).as_numpy("probabilities")
    tensor = httpclient.InferInput("PROBABILITIES", list(probabilities.shape), "FP32")
    tensor.set_data_from_numpy(probabilities)
    result = client.infer("digits_postprocess", [tensor])
    return result.as_numpy("LABEL")[0, 0], float(result.as_numpy("SCORE")[0, 0])


# -- the shipped ensemble -------------------------------------------------------------------------------


def test_shipped_ensemble_classifies_a_real_digit_over_http_and_grpc(server: GeserveProcess) -> None:
    pixels = np.load(MODEL_REPOSITORY / "digits" / "sample_digit.npy")
    image = np.round(pixels.reshape(1, 8, 8) * 255 / 16).astype(np.uint8)
    expected = (MODEL_REPOSITORY / "digits" / "sample_label.txt").read_text().strip().encode()
    http = httpclient.InferenceServerClient(server.url)
    tensor = httpclient.InferInput("IMAGE", [1, 8, 8], "UINT8")
    tensor.set_data_from_numpy(image)
    result = http.infer("digits_ensemble", [tensor])
    assert result.as_numpy("LABEL")[0, 0] == expected
    label, score = by_hand(http, image)
    assert label == expected and result.as_numpy("SCORE")[0, 0] == pytest.approx(score, rel=1e-4)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    grpc_tensor = grpcclient.InferInput("IMAGE", [1, 8, 8], "UINT8")
    grpc_tensor.set_data_from_numpy(image)
    grpc_result = grpc.infer("digits_ensemble", [grpc_tensor], outputs=[grpcclient.InferRequestedOutput("LABEL")])
    assert grpc_result.as_numpy("LABEL")[0, 0] == expected
    assert grpc_result.as_numpy("SCORE") is None  # only what was asked for
    metadata = http.get_model_metadata("digits_ensemble")
    assert metadata["platform"] == "ensemble"
    assert [t["name"] for t in metadata["inputs"]] == ["IMAGE"]


def test_sixteen_concurrent_clients_each_get_their_own_answer(server: GeserveProcess) -> None:
    pictures = images(64)
    http = httpclient.InferenceServerClient(server.url)
    expected = [by_hand(http, pictures[i : i + 1]) for i in range(len(pictures))]
    before = http.get_inference_statistics("digits_ensemble")["model_stats"][0]
    composing_before = http.get_inference_statistics("digits")["model_stats"][0]["inference_count"]

    def client(offset: int) -> None:
        with httpclient.InferenceServerClient(server.url) as own:
            for index in range(offset, len(pictures), 16):
                tensor = httpclient.InferInput("IMAGE", [1, 8, 8], "UINT8")
                tensor.set_data_from_numpy(pictures[index : index + 1])
                result = own.infer("digits_ensemble", [tensor])
                label, score = expected[index]
                assert result.as_numpy("LABEL")[0, 0] == label, index
                assert result.as_numpy("SCORE")[0, 0] == pytest.approx(score, rel=1e-4), (
                    index
                )  # batched BLAS sums differ

    run_on_threads([functools.partial(client, offset) for offset in range(16)])
    after = http.get_inference_statistics("digits_ensemble")["model_stats"][0]
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 64
    assert int(after["inference_count"]) - int(before["inference_count"]) == 64
    # Each ensemble request ran the composing models too, and they count it as theirs.
    composing_after = http.get_inference_statistics("digits")["model_stats"][0]["inference_count"]
    assert int(composing_after) - int(composing_before) == 64


def test_perf_analyzer_drives_the_ensemble(server: GeserveProcess, perf_analyzer: str) -> None:
    output = run_perf_analyzer(perf_analyzer, "-m", "digits_ensemble", "-u", server.url, "--concurrency-range", "4")
    assert "Throughput:" in output


# -- graphs, errors and failures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("ensembles")
    repository = root / "models"
    repository.mkdir()
    copy_model("simple", repository)
    copy_model("repeat_int32", repository)
    shutil.copytree(PYTHON_MODELS / "raises", repository / "raises")
    for name in ("slow_a", "slow_b"):
        write_identity_model(
            repository, name, extra='parameters { key: "execute_delay_ms" value { string_value: "600" } }'
        )
    io = (
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "A" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "B" data_type: TYPE_FP32 dims: [ -1 ] } ]'
    )
    fork = f"{io}\nensemble_scheduling {{ step [ {step('slow_a', {'INPUT0': 'X'}, {'OUTPUT0': 'A'})}, "
    fork += f"{step('slow_b', {'INPUT0': 'X'}, {'OUTPUT0': 'B'})} ] }}"
    write_ensemble(repository, "fork", ensemble("fork", fork))
    failing = (
        'input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]\noutput [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        f"ensemble_scheduling {{ step [ {step('raises', {'IN': 'X'}, {'OUT': 'Y'})} ] }}"
    )
    write_ensemble(repository, "failing", ensemble("failing", failing, max_batch_size=0))
    for name, body in BAD_ENSEMBLES.items():
        write_ensemble(repository, name, ensemble(name, body))
    write_identity_model(repository, "echo_int", dtype="TYPE_INT32", dims="1", max_batch_size=0)
    streamed = (
        "model_transaction_policy { decoupled: true }\n"
        'input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] }, '
        '{ name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]\n'
        "ensemble_scheduling { step [ "
        f"{step('repeat_int32', {'IN': 'IN', 'DELAY': 'DELAY', 'WAIT': 'WAIT'}, {'OUT': 'value', 'IDX': 'IDX'})}, "
        f"{step('echo_int', {'INPUT0': 'value'}, {'OUTPUT0': 'OUT'})} ] }}"
    )
    write_ensemble(repository, "stream_chain", ensemble("stream_chain", streamed, max_batch_size=0))
    for name in ("pass_a", "pass_b"):
        write_identity_model(repository, name)
    chain = (
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]\noutput [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        f"ensemble_scheduling {{ step [ {step('pass_a', {'INPUT0': 'X'}, {'OUTPUT0': 'mid'})}, "
        f"{step('pass_b', {'INPUT0': 'mid'}, {'OUTPUT0': 'Y'})} ] }}"
    )
    write_ensemble(repository, "big_chain", ensemble("big_chain", chain))
    copy_model("sequence_accumulator", repository)
    stateful = (
        'input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]\noutput [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        f"ensemble_scheduling {{ step [ {step('sequence_accumulator', {'INPUT': 'X'}, {'OUTPUT': 'SUM'})} ] }}"
    )
    write_ensemble(repository, "stateful_pipeline", ensemble("stateful_pipeline", stateful))
    process = GeserveProcess(
        root / "geserve.log", f"--model-repository={repository}", "--exit-on-error=false"
    ).wait_live()
    yield process
    assert process.stop() == 0, process.log()


def test_independent_steps_run_side_by_side(graph_server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(graph_server.url)
    data = np.arange(3, dtype=np.float32).reshape(1, 3)
    tensor = httpclient.InferInput("X", [1, 3], "FP32")
    tensor.set_data_from_numpy(data)
    http.infer("fork", [tensor])  # warm
    started = time.monotonic()
    result = http.infer("fork", [tensor])
    elapsed = time.monotonic() - started
    np.testing.assert_array_equal(result.as_numpy("A"), data)
    np.testing.assert_array_equal(result.as_numpy("B"), data)
    # Each step takes 600 ms: one after the other would take 1.2 s.
    assert elapsed < 1.0, f"the two steps did not overlap ({elapsed:.2f}s)"


def test_a_failing_step_fails_the_request_with_its_error_and_the_next_succeeds(graph_server: GeserveProcess) -> None:
    for client, module in (
        (httpclient.InferenceServerClient(graph_server.url), httpclient),
        (grpcclient.InferenceServerClient(f"127.0.0.1:{graph_server.grpc_port}"), grpcclient),
    ):
        bad = module.InferInput("X", [1], "INT32")
        bad.set_data_from_numpy(np.array([13], dtype=np.int32))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("failing", [bad])
        assert "unlucky input" in caught.value.message()
        good = module.InferInput("X", [1], "INT32")
        good.set_data_from_numpy(np.array([5], dtype=np.int32))
        assert client.infer("failing", [good]).as_numpy("Y").tolist() == [5]


SIMPLE_IO = 'input [ { name: "X" data_type: TYPE_INT32 dims: [ 16 ] } ]\noutput [ { name: "Y" data_type: TYPE_INT32 dims: [ 16 ] } ]'
BAD_ENSEMBLES = {
    "bad_missing": f"{SIMPLE_IO}\nensemble_scheduling {{ step [ {step('nope', {'IN': 'X'}, {'OUT': 'Y'})} ] }}",
    "bad_dtype": SIMPLE_IO.replace("TYPE_INT32 dims: [ 16 ] } ]\noutput", "TYPE_FP32 dims: [ 16 ] } ]\noutput")
    + f"\nensemble_scheduling {{ step [ {step('simple', {'INPUT0': 'X', 'INPUT1': 'X'}, {'OUTPUT0': 'Y'})} ] }}",
    "bad_cycle": f"{SIMPLE_IO}\nensemble_scheduling {{ step [ "
    f"{step('simple', {'INPUT0': 'X', 'INPUT1': 't2'}, {'OUTPUT0': 't1'})}, "
    f"{step('simple', {'INPUT0': 't1', 'INPUT1': 'X'}, {'OUTPUT0': 't2', 'OUTPUT1': 'Y'})} ] }}",
    "bad_unused_input": SIMPLE_IO.replace(
        " } ]\noutput", ' }, { name: "Z" data_type: TYPE_INT32 dims: [ 16 ] } ]\noutput'
    )
    + f"\nensemble_scheduling {{ step [ {step('simple', {'INPUT0': 'X', 'INPUT1': 'X'}, {'OUTPUT0': 'Y'})} ] }}",
    "bad_dangling": f"{SIMPLE_IO}\nensemble_scheduling {{ step [ "
    f"{step('simple', {'INPUT0': 'X', 'INPUT1': 'X'}, {'OUTPUT0': 'Y', 'OUTPUT1': 'dangling'})} ] }}",
    "bad_input_name": f"{SIMPLE_IO}\nensemble_scheduling {{ step [ "
    f"{step('simple', {'INPUT0': 'X', 'INPUT9': 'X'}, {'OUTPUT0': 'Y'})} ] }}",
    "bad_unmapped": f"{SIMPLE_IO}\nensemble_scheduling {{ step [ {step('simple', {'INPUT0': 'X'}, {'OUTPUT0': 'Y'})} ] }}",
    "bad_decoupled": 'input [ { name: "I" data_type: TYPE_INT32 dims: [ -1 ] }, '
    '{ name: "D" data_type: TYPE_UINT32 dims: [ -1 ] }, { name: "W" data_type: TYPE_UINT32 dims: [ 1 ] } ]\n'
    'output [ { name: "O" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
    f"ensemble_scheduling {{ step [ {step('repeat_int32', {'IN': 'I', 'DELAY': 'D', 'WAIT': 'W'}, {'OUT': 'O'})} ] }}",
}
LOAD_ERRORS = {
    "bad_missing": "ensemble bad_missing contains models that are not available: nope",
    "bad_dtype": "in ensemble bad_dtype, ensemble tensor X: inconsistent data type: TYPE_FP32 is inferred from model "
    "bad_dtype while TYPE_INT32 is inferred from model simple",
    "bad_cycle": "output 'Y' for ensemble 'bad_cycle' is not written",
    "bad_unused_input": "ensemble input 'Z' for ensemble bad_unused_input' is not used",
    "bad_dangling": "ensemble tensor 'dangling' is unused in ensemble 'bad_dangling'",
    "bad_input_name": "in ensemble bad_input_name, ensemble tensor X is mapping to non-existing input INPUT9 in model simple",
    "bad_unmapped": "in ensemble bad_unmapped, input INPUT1 in model simple is not mapped to any ensemble tensors",
    "bad_decoupled": "ensemble bad_decoupled step 0 uses decoupled model repeat_int32",
}


@pytest.mark.parametrize("name", sorted(LOAD_ERRORS))
def test_each_bad_graph_fails_its_load_naming_step_and_tensor(graph_server: GeserveProcess, name: str) -> None:
    http = httpclient.InferenceServerClient(graph_server.url)
    index = {entry["name"]: entry for entry in http.get_model_repository_index()}
    assert index[name]["state"] == "UNAVAILABLE"
    assert LOAD_ERRORS[name] in index[name]["reason"], index[name]["reason"]
    assert http.is_model_ready("simple") and http.is_model_ready("fork")


def test_a_killed_composing_worker_fails_the_request_clearly_and_the_next_succeeds(
    launch: Launch, tmp_path: Path
) -> None:
    repository = tmp_path / "models"
    write_identity_model(
        repository, "slow", extra='parameters { key: "execute_delay_ms" value { string_value: "1500" } }'
    )
    body = (
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]\noutput [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        f"ensemble_scheduling {{ step [ {step('slow', {'INPUT0': 'X'}, {'OUTPUT0': 'Y'})} ] }}"
    )
    write_ensemble(repository, "chain", ensemble("chain", body))
    server = launch(f"--model-repository={repository}").wait_live()
    http = httpclient.InferenceServerClient(server.url, network_timeout=60)
    data = np.ones((1, 4), dtype=np.float32)
    tensor = httpclient.InferInput("X", [1, 4], "FP32")
    tensor.set_data_from_numpy(data)
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            with httpclient.InferenceServerClient(server.url, network_timeout=60) as own:
                outcome["result"] = own.infer("chain", [tensor])
        except InferenceServerException as error:
            outcome["error"] = error

    ((instance, pid),) = worker_pids(server, "slow").items()
    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    thread.join(60)
    error = outcome.get("error")
    assert error is not None and error.status() == "503", outcome
    deadline = time.monotonic() + 60
    while worker_pids(server, "slow").get(instance) == pid or not http.is_model_ready("chain"):
        assert time.monotonic() < deadline, "the composing model did not come back"
        time.sleep(0.1)
    np.testing.assert_array_equal(http.infer("chain", [tensor]).as_numpy("Y"), data)
    assert server.stop() == 0


def test_explicit_load_brings_composing_models_and_unload_dependents_takes_them(launch: Launch, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    repository.mkdir()
    for name in ("digits", "digits_preprocess", "digits_postprocess", "digits_ensemble"):
        copy_model(name, repository)
    server = launch(f"--model-repository={repository}", "--model-control-mode=explicit").wait_live()
    http = httpclient.InferenceServerClient(server.url)
    http.load_model("digits_ensemble")
    for name in ("digits", "digits_preprocess", "digits_postprocess", "digits_ensemble"):
        assert http.is_model_ready(name), name
    http.unload_model("digits_ensemble")
    assert not http.is_model_ready("digits_ensemble") and http.is_model_ready("digits")
    http.load_model("digits_ensemble")
    http.unload_model("digits_ensemble", unload_dependents=True)
    for name in ("digits", "digits_preprocess", "digits_postprocess", "digits_ensemble"):
        assert not http.is_model_ready(name), name
    assert server.stop() == 0


def test_a_decoupled_step_streams_through_the_rest_of_the_ensemble(graph_server: GeserveProcess) -> None:
    """Every response of repeat_int32 runs the step after it and becomes one response of the ensemble."""
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{graph_server.grpc_port}")
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
    values = np.array([7, -3, 11, 5], dtype=np.int32)
    arrays = {
        "IN": (values, "INT32"),
        "DELAY": (np.full(values.shape, 10, dtype=np.uint32), "UINT32"),
        "WAIT": (np.zeros(1, dtype=np.uint32), "UINT32"),
    }
    tensors = []
    for name, (array, datatype) in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    try:
        grpc.async_stream_infer("stream_chain", tensors, enable_empty_final_response=True)
        seen = []
        while True:
            result, error = answers.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                seen.append((int(result.as_numpy("OUT")[0]), int(result.as_numpy("IDX")[0])))
            if response.parameters["triton_final_response"].bool_param:
                break
        assert seen == [(int(v), i) for i, v in enumerate(values)]
    finally:
        grpc.stop_stream()


@pytest.mark.parametrize("elements", [100_000, 5_000_000])
def test_large_tensors_pass_between_steps_in_shared_memory_intact(graph_server: GeserveProcess, elements: int) -> None:
    """400 KB go through a reused handoff segment, 20 MB (more than an arena) through a one-off one."""

    def client(seed: int) -> None:
        data = np.random.default_rng(seed).standard_normal((1, elements)).astype(np.float32)
        with httpclient.InferenceServerClient(graph_server.url, network_timeout=120) as own:
            tensor = httpclient.InferInput("X", list(data.shape), "FP32")
            tensor.set_data_from_numpy(data)
            for _ in range(3):
                np.testing.assert_array_equal(own.infer("big_chain", [tensor]).as_numpy("Y"), data)

    run_on_threads([functools.partial(client, seed) for seed in range(4)], timeout_s=300)


def test_an_ensemble_passes_the_sequence_on_to_a_sequence_model_step(graph_server: GeserveProcess) -> None:
    """sequence_id, sequence_start and sequence_end reach the step, whose implicit state follows the sequence."""
    http = httpclient.InferenceServerClient(graph_server.url)

    def send(sequence_id: int, value: int, start: bool = False, end: bool = False) -> int:
        tensor = httpclient.InferInput("X", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
        result = http.infer(
            "stateful_pipeline", [tensor], sequence_id=sequence_id, sequence_start=start, sequence_end=end
        )
        return int(result.as_numpy("SUM").item())

    assert [send(41, 2, start=True), send(42, 10, start=True), send(41, 3), send(42, 1), send(41, 4, end=True)] == [
        2,
        10,
        5,
        11,
        9,
    ]
    with pytest.raises(InferenceServerException) as caught:
        send(41, 1)
    assert "must specify the START flag on the first request of the sequence" in caught.value.message()
    assert send(42, 1, end=True) == 12

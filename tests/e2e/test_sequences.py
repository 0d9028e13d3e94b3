"""Sequence models (Triton's sequence batcher) through tritonclient: values, errors, idle timeout, backlog, failures."""

from __future__ import annotations

import functools
import os
import queue
import shutil
import signal
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
from tests.support import MODEL_REPOSITORY, GeserveProcess, run_on_threads, run_perf_analyzer

pytestmark = pytest.mark.e2e
Launch = Callable[..., GeserveProcess]
PYTHON_MODELS = Path(__file__).resolve().parents[1] / "python_models"
SEQUENCE_MODELS = ("simple_sequence", "sequence_controls", "sequence_accumulator")
STEPS = 5
START_ERROR = "must specify the START flag on the first request of the sequence"


def _variant(repository: Path, source: str, name: str, edit: Callable[[str], str]) -> Path:
    """A copy of a model under another name, its config edited."""
    origin = MODEL_REPOSITORY / source if (MODEL_REPOSITORY / source).exists() else PYTHON_MODELS / source
    target = repository / name
    shutil.copytree(origin, target, ignore=shutil.ignore_patterns("__pycache__"))
    config = target / "config.pbtxt"
    config.write_text(edit(config.read_text().replace(f'name: "{source}"', f'name: "{name}"')))
    return target


def build_repository(repository: Path) -> None:
    repository.mkdir(parents=True, exist_ok=True)
    for name in SEQUENCE_MODELS:
        shutil.copytree(MODEL_REPOSITORY / name, repository / name)
    shutil.copytree(PYTHON_MODELS / "sequence_state", repository / "sequence_state")
    # The initial state read from initial_state/<data_file>: the running sum starts at 100.
    from_file = _variant(
        repository,
        "sequence_accumulator",
        "accumulator_from_file",
        lambda text: text.replace('name: "zero"', 'name: "hundred"').replace("zero_data: true", 'data_file: "start"'),
    )
    (from_file / "initial_state").mkdir()
    (from_file / "initial_state" / "start").write_bytes(np.array([100], dtype="<i4").tobytes())
    _variant(
        repository,
        "simple_sequence",
        "short_idle",
        lambda text: text.replace("max_sequence_idle_microseconds: 5000000", "max_sequence_idle_microseconds: 300000"),
    )
    _variant(
        repository,
        "sequence_accumulator",
        "two_slots",
        lambda text: text.replace("max_batch_size: 8", "max_batch_size: 2"),
    )
    # One slot and a 1 s idle limit: a sequence that waits longer than that in the backlog must still run.
    _variant(
        repository,
        "sequence_accumulator",
        "one_slot_short_idle",
        lambda text: text.replace("max_batch_size: 8", "max_batch_size: 1").replace(
            "max_sequence_idle_microseconds: 5000000", "max_sequence_idle_microseconds: 1000000"
        ),
    )
    # The direct strategy with a model that does not batch: one slot per instance, two instances.
    _variant(
        repository,
        "sequence_state",
        "unbatched_state",
        lambda text: text.replace("max_batch_size: 4", "max_batch_size: 0").replace(
            "instance_group [ { kind: KIND_CPU } ]", "instance_group [ { count: 2 kind: KIND_CPU } ]"
        ),
    )


@pytest.fixture(scope="module")
def sequence_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("sequences")
    build_repository(root / "models")
    process = GeserveProcess(root / "geserve.log", f"--model-repository={root / 'models'}").wait_live()
    yield process
    assert process.stop() == 0, process.log()


# -- what each model answers ---------------------------------------------------------------------------


def value_of(sequence: int, step: int) -> int:
    return 100 * sequence + step + 1


def expected(model: str, sequence_id: int | str, values: list[int], step: int) -> dict[str, Any]:
    """The outputs of step `step` of a sequence sent `values`, first with START and last with END."""
    start, end = step == 0, step == len(values) - 1
    value = values[step]
    if model in ("simple_sequence", "short_idle"):
        return {"OUTPUT": value + int(start)}
    if model == "sequence_controls":
        return {"OUTPUT": value + int(start) + 2 * int(end), "CORRID_OUT": sequence_id}
    if model in ("sequence_accumulator", "two_slots"):
        return {"OUTPUT": sum(values[: step + 1])}
    if model == "accumulator_from_file":
        return {"OUTPUT": 100 + sum(values[: step + 1])}
    flags = int(start) + 2 * int(end) + 4 * int(start) + 8
    return {"OUTPUT": sum(values[: step + 1]), "CORRELATION": str(sequence_id).encode(), "FLAGS": flags}


def check(model: str, outputs: dict[str, Any], sequence_id: int | str, values: list[int], step: int) -> None:
    for name, want in expected(model, sequence_id, values, step).items():
        got = np.asarray(outputs[name]).reshape(-1)[0]
        assert got == want, f"{model} sequence {sequence_id} step {step}: {name} is {got!r}, expected {want!r}"


def _into(answers: queue.Queue[tuple[Any, Any]]) -> Callable[..., None]:
    """A tritonclient callback (called with result= and error=) that queues what it is given."""

    def callback(result: Any, error: Any) -> None:
        answers.put((result, error))

    return callback


def _array(value: int, batched: bool = True) -> np.ndarray:
    return np.array([[value]] if batched else [value], dtype=np.int32)


def _step(
    module: Any,
    client: Any,
    model: str,
    sequence_id: int | str,
    value: int,
    start: bool = False,
    end: bool = False,
    batched: bool = True,
) -> dict[str, Any]:
    """One request of a sequence through tritonclient's http or grpc module; its outputs by name."""
    data = _array(value, batched)
    tensor = module.InferInput("INPUT", list(data.shape), "INT32")
    tensor.set_data_from_numpy(data)
    result = client.infer(model, [tensor], sequence_id=sequence_id, sequence_start=start, sequence_end=end)
    response = result.get_response()
    names = (
        [o["name"] for o in response["outputs"]] if isinstance(response, dict) else [o.name for o in response.outputs]
    )
    return {name: result.as_numpy(name) for name in names}


def http_step(client: httpclient.InferenceServerClient, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return _step(httpclient, client, *args, **kwargs)


def grpc_step(client: grpcclient.InferenceServerClient, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return _step(grpcclient, client, *args, **kwargs)


def _run_sequence(step: Callable[..., dict[str, Any]], model: str, sequence_id: int | str, number: int) -> None:
    values = [value_of(number, i) for i in range(STEPS)]
    batched = model != "unbatched_state"
    for i, value in enumerate(values):
        outputs = step(model, sequence_id, value, start=i == 0, end=i == STEPS - 1, batched=batched)
        check(model, outputs, sequence_id, values, i)


def _interleaved(step: Callable[..., dict[str, Any]], model: str, ids: list[int | str]) -> None:
    """Each sequence on its own thread, in order; the sequences run side by side, so batches mix them."""
    run_on_threads(
        [
            functools.partial(_run_sequence, step, model, sequence_id, number)
            for number, sequence_id in enumerate(ids, start=1)
        ]
    )


MODELS = ["simple_sequence", "sequence_controls", "sequence_accumulator", "sequence_state", "accumulator_from_file"]


def _ids(model: str, base: int) -> list[int | str]:
    # Numeric ids where a UINT64 CORRID asks for them; string ids elsewhere too, which the others accept.
    if model in ("sequence_controls", "accumulator_from_file"):
        return [base + n for n in range(10)]
    return [base + n for n in range(5)] + [f"session-{base}-{n}" for n in range(5)]


@pytest.mark.parametrize("model", [*MODELS, "unbatched_state"])
def test_interleaved_sequences_over_http(sequence_server: GeserveProcess, model: str) -> None:
    def step(*args: Any, **kwargs: Any) -> dict[str, Any]:
        with httpclient.InferenceServerClient(sequence_server.url) as client:
            return http_step(client, *args, **kwargs)

    _interleaved(step, model, _ids(model, 1000))


@pytest.mark.parametrize("model", MODELS)
def test_interleaved_sequences_over_grpc(sequence_server: GeserveProcess, model: str) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{sequence_server.grpc_port}")
    _interleaved(lambda *a, **k: grpc_step(client, *a, **k), model, _ids(model, 2000))


@pytest.mark.parametrize("model", MODELS)
def test_interleaved_sequences_over_one_grpc_stream(sequence_server: GeserveProcess, model: str) -> None:
    """All sequences on one stream, step by step across them: the stream keeps each sequence's order."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{sequence_server.grpc_port}")
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=_into(answers))
    ids = _ids(model, 3000)[:8]
    values = {sequence_id: [value_of(n, i) for i in range(STEPS)] for n, sequence_id in enumerate(ids, start=1)}
    try:
        for step in range(STEPS):
            for sequence_id in ids:
                data = _array(values[sequence_id][step])
                tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
                tensor.set_data_from_numpy(data)
                client.async_stream_infer(
                    model,
                    [tensor],
                    request_id=f"{sequence_id}/{step}",
                    sequence_id=sequence_id,
                    sequence_start=step == 0,
                    sequence_end=step == STEPS - 1,
                )
        for _ in range(STEPS * len(ids)):
            result, error = answers.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            sequence_key, step_text = response.id.rsplit("/", 1)
            sequence_id = next(i for i in ids if str(i) == sequence_key)
            outputs = {output.name: result.as_numpy(output.name) for output in response.outputs}
            check(model, outputs, sequence_id, values[sequence_id], int(step_text))
    finally:
        client.stop_stream()


def test_async_infer_through_http_and_grpc(sequence_server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(sequence_server.url, concurrency=4)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{sequence_server.grpc_port}")
    values = [3, 4, 5]
    for i, value in enumerate(values):
        data = _array(value)
        http_input = httpclient.InferInput("INPUT", [1, 1], "INT32")
        http_input.set_data_from_numpy(data)
        pending = http.async_infer(
            "sequence_accumulator", [http_input], sequence_id=71, sequence_start=i == 0, sequence_end=i == 2
        )
        check("sequence_accumulator", {"OUTPUT": pending.get_result().as_numpy("OUTPUT")}, 71, values, i)
        grpc_input = grpcclient.InferInput("INPUT", [1, 1], "INT32")
        grpc_input.set_data_from_numpy(data)
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        grpc.async_infer(
            "sequence_accumulator",
            [grpc_input],
            _into(answers),
            sequence_id="async-72",
            sequence_start=i == 0,
            sequence_end=i == 2,
        )
        result, error = answers.get(timeout=30)
        assert error is None, error
        check("sequence_accumulator", {"OUTPUT": result.as_numpy("OUTPUT")}, "async-72", values, i)
    http.close()


# -- errors ---------------------------------------------------------------------------------------------


def _good_sequence(server: GeserveProcess, model: str = "sequence_controls", sequence_id: int = 9000) -> None:
    with httpclient.InferenceServerClient(server.url) as client:
        _run_sequence(lambda *a, **k: http_step(client, *a, **k), model, sequence_id, 9)


def _http_error(call: Callable[[], object]) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return str(caught.value.status()), caught.value.message()


ERROR_CASES = [
    # (what, model, sequence_id, start, end, rows, expected text)
    (
        "never started",
        "sequence_controls",
        4242,
        False,
        False,
        1,
        f"sequence 4242 to model 'sequence_controls' {START_ERROR}",
    ),
    ("id 0", "sequence_controls", 0, True, False, 1, "must specify a non-zero or non-empty correlation ID"),
    ("no id", "simple_sequence", "", True, True, 1, "must specify a non-zero or non-empty correlation ID"),
    (
        "a string id where CORRID is UINT64",
        "sequence_controls",
        "abc",
        True,
        False,
        1,
        "sequence batching control 'CORRID' data-type is 'BYTES', but model 'sequence_controls' expects 'UINT64'",
    ),
    (
        "two rows",
        "sequence_accumulator",
        5,
        True,
        False,
        2,
        "must specify batch-size 1 due to requirements of sequence batcher",
    ),
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=[case[0] for case in ERROR_CASES])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_each_bad_request_gets_tritons_error_and_the_model_keeps_serving(
    sequence_server: GeserveProcess, case: tuple[Any, ...], protocol: str
) -> None:
    _, model, sequence_id, start, end, rows, text = case
    data = np.arange(rows, dtype=np.int32).reshape(rows, 1)
    if protocol == "http":
        client: Any = httpclient.InferenceServerClient(sequence_server.url)
        tensor: Any = httpclient.InferInput("INPUT", [rows, 1], "INT32")
    else:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{sequence_server.grpc_port}")
        tensor = grpcclient.InferInput("INPUT", [rows, 1], "INT32")
    tensor.set_data_from_numpy(data)
    status, message = _http_error(
        lambda: client.infer(model, [tensor], sequence_id=sequence_id, sequence_start=start, sequence_end=end)
    )
    assert status in ("400", "StatusCode.INVALID_ARGUMENT"), (status, message)
    assert text in message, message
    _good_sequence(sequence_server)


def test_a_request_after_end_must_start_again(sequence_server: GeserveProcess) -> None:
    with httpclient.InferenceServerClient(sequence_server.url) as client:
        http_step(client, "sequence_accumulator", 77, 1, start=True, end=True)
        status, message = _http_error(lambda: http_step(client, "sequence_accumulator", 77, 2))
        assert status == "400" and START_ERROR in message
        # The same id starts a new sequence, from the initial state.
        assert http_step(client, "sequence_accumulator", 77, 5, start=True)["OUTPUT"].item() == 5
        assert http_step(client, "sequence_accumulator", 77, 6, end=True)["OUTPUT"].item() == 11


def test_start_for_a_running_sequence_restarts_it_in_its_slot(sequence_server: GeserveProcess) -> None:
    """Triton logs the conflict and carries on: the new START resets the state."""
    with httpclient.InferenceServerClient(sequence_server.url) as client:
        assert http_step(client, "sequence_accumulator", 78, 10, start=True)["OUTPUT"].item() == 10
        assert http_step(client, "sequence_accumulator", 78, 1)["OUTPUT"].item() == 11
        assert http_step(client, "sequence_accumulator", 78, 3, start=True)["OUTPUT"].item() == 3
        assert http_step(client, "sequence_accumulator", 78, 4, end=True)["OUTPUT"].item() == 7
    assert "sequence 78 for model 'sequence_accumulator' has a conflict" in sequence_server.log()


def test_an_idle_sequence_loses_its_slot(sequence_server: GeserveProcess) -> None:
    with httpclient.InferenceServerClient(sequence_server.url) as client:
        http_step(client, "short_idle", 31, 1, start=True)
        http_step(client, "short_idle", 31, 2)
        time.sleep(0.8)  # max_sequence_idle_microseconds is 300000
        status, message = _http_error(lambda: http_step(client, "short_idle", 31, 3, end=True))
        assert status == "400" and f"sequence 31 to model 'short_idle' {START_ERROR}" in message
        _run_sequence(lambda *a, **k: http_step(client, *a, **k), "short_idle", 31, 3)


def test_sequences_beyond_the_slots_wait_in_the_backlog_in_arrival_order(sequence_server: GeserveProcess) -> None:
    """two_slots has 2 slots: C, D and E wait, and take the slots A and B free, in the order they came."""
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{sequence_server.grpc_port}")
    model = "two_slots"
    assert grpc_step(grpc, model, "A", 1, start=True)["OUTPUT"].item() == 1
    assert grpc_step(grpc, model, "B", 2, start=True)["OUTPUT"].item() == 2
    answers: dict[str, queue.Queue[tuple[Any, Any]]] = {name: queue.Queue() for name in "CDE"}
    for name in "CDE":
        tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(_array(10))
        grpc.async_infer(model, [tensor], _into(answers[name]), sequence_id=name, sequence_start=True)
        time.sleep(0.05)  # arrival order C, D, E
    time.sleep(0.3)
    assert all(q.empty() for q in answers.values()), "a backlogged sequence ran without a slot"
    assert grpc_step(grpc, model, "A", 5, end=True)["OUTPUT"].item() == 6  # frees a slot: C takes it
    result, error = answers["C"].get(timeout=30)
    assert error is None and result.as_numpy("OUTPUT").item() == 10
    time.sleep(0.2)
    assert answers["D"].empty() and answers["E"].empty()
    assert grpc_step(grpc, model, "B", 5, end=True)["OUTPUT"].item() == 7  # D next
    result, error = answers["D"].get(timeout=30)
    assert error is None and result.as_numpy("OUTPUT").item() == 10
    assert answers["E"].empty()
    assert grpc_step(grpc, model, "C", 1, end=True)["OUTPUT"].item() == 11  # E last
    result, error = answers["E"].get(timeout=30)
    assert error is None and result.as_numpy("OUTPUT").item() == 10
    # A backlogged sequence's state is its own once it has a slot.
    assert grpc_step(grpc, model, "D", 2, end=True)["OUTPUT"].item() == 12
    assert grpc_step(grpc, model, "E", 3, end=True)["OUTPUT"].item() == 13


def test_a_sequence_that_waited_in_the_backlog_longer_than_the_idle_limit_runs_to_its_end(
    sequence_server: GeserveProcess,
) -> None:
    """one_slot_short_idle: B waits behind A for longer than max_sequence_idle_microseconds (1 s), then runs."""
    model = "one_slot_short_idle"
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{sequence_server.grpc_port}")
    assert grpc_step(grpc, model, "A", 1, start=True)["OUTPUT"].item() == 1
    answer: queue.Queue[tuple[Any, Any]] = queue.Queue()
    tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(_array(10))
    grpc.async_infer(model, [tensor], _into(answer), sequence_id="B", sequence_start=True)
    total = 1
    for _ in range(8):  # A keeps its slot for about 2 s with a request every 0.25 s; B waits in the backlog
        time.sleep(0.25)
        total += 1
        assert grpc_step(grpc, model, "A", 1)["OUTPUT"].item() == total
    assert answer.empty(), "a backlogged sequence ran without a slot"
    assert grpc_step(grpc, model, "A", 1, end=True)["OUTPUT"].item() == total + 1
    result, error = answer.get(timeout=30)
    assert error is None and result.as_numpy("OUTPUT").item() == 10
    # B's next requests find its slot and its state (today they were refused: its START had been reaped).
    values = [10, 2, 3, 4]
    for step in range(1, len(values)):
        outputs = grpc_step(grpc, model, "B", values[step], end=step == len(values) - 1)
        assert outputs["OUTPUT"].item() == sum(values[: step + 1])


def test_config_and_statistics_show_sequences(sequence_server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(sequence_server.url)
    config = http.get_model_config("sequence_controls")
    batching = config["sequence_batching"]
    assert batching["oldest"] == {
        "max_candidate_sequences": 16,
        "preferred_batch_size": [4, 8],
        "max_queue_delay_microseconds": 2000,
        "preserve_ordering": False,
    }
    assert [c["name"] for c in batching["control_input"]] == ["START", "END", "READY", "CORRID"]
    assert "dynamic_batching" not in config
    # Control and state tensors are the server's: clients see only INPUT.
    metadata = http.get_model_metadata("sequence_accumulator")
    assert [tensor["name"] for tensor in metadata["inputs"]] == ["INPUT"]
    assert [tensor["name"] for tensor in metadata["outputs"]] == ["OUTPUT"]
    before = http.get_inference_statistics("sequence_accumulator")["model_stats"][0]
    with httpclient.InferenceServerClient(sequence_server.url) as client:
        _run_sequence(lambda *a, **k: http_step(client, *a, **k), "sequence_accumulator", 555, 1)
    after = http.get_inference_statistics("sequence_accumulator")["model_stats"][0]
    assert int(after["inference_count"]) - int(before["inference_count"]) == STEPS
    success = after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    assert success == STEPS
    # Every step is a batch of its own here, padding of empty slots not counted as inferences.
    assert int(after["execution_count"]) - int(before["execution_count"]) == STEPS


# -- instances that die, servers that stop --------------------------------------------------------------


def test_a_worker_killed_mid_sequence_fails_that_sequence_and_new_ones_work(launch: Launch, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    repository.mkdir()
    shutil.copytree(MODEL_REPOSITORY / "sequence_accumulator", repository / "sequence_accumulator")
    server = launch(f"--model-repository={repository}").wait_live()
    client = httpclient.InferenceServerClient(server.url)
    assert http_step(client, "sequence_accumulator", 1, 5, start=True)["OUTPUT"].item() == 5
    assert http_step(client, "sequence_accumulator", 2, 7, start=True)["OUTPUT"].item() == 7
    ((instance, pid),) = worker_pids(server, "sequence_accumulator").items()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while worker_pids(server, "sequence_accumulator").get(instance) == pid or not client.is_model_ready(
        "sequence_accumulator"
    ):
        assert time.monotonic() < deadline, "the worker was not restarted"
        time.sleep(0.05)
    status, message = _http_error(lambda: http_step(client, "sequence_accumulator", 1, 1))
    assert status == "503" and "sequence 1 of model 'sequence_accumulator' was lost" in message, message
    # Once told, the id is forgotten: its next request needs START, as for any unknown sequence.
    status, message = _http_error(lambda: http_step(client, "sequence_accumulator", 1, 1))
    assert status == "400" and START_ERROR in message
    status, message = _http_error(lambda: http_step(client, "sequence_accumulator", 2, 1, end=True))
    assert status == "503" and "sequence 2 of model 'sequence_accumulator' was lost" in message, message
    _run_sequence(lambda *a, **k: http_step(client, *a, **k), "sequence_accumulator", 3, 3)
    assert server.stop() == 0


def test_sigterm_lets_in_flight_sequence_requests_finish(launch: Launch, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    repository.mkdir()
    slow = _variant(repository, "sequence_state", "slow_state", lambda text: text)
    config = slow / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters { key: "delay_s" value { string_value: "0.5" } }\n')
    server = launch(f"--model-repository={repository}").wait_live()
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    for number in range(4):  # one batch running, the next queued behind it, at SIGTERM
        tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(_array(number + 1))
        grpc.async_infer(
            "slow_state",
            [tensor],
            _into(answers),
            sequence_id=number + 1,
            sequence_start=True,
            sequence_end=True,
        )
    time.sleep(0.2)
    server.process.send_signal(signal.SIGTERM)
    outputs = set()
    for _ in range(4):
        result, error = answers.get(timeout=60)
        assert error is None, error
        outputs.add(int(result.as_numpy("OUTPUT").item()))
    assert outputs == {1, 2, 3, 4}
    assert server.wait_exit(60) == 0


# -- perf_analyzer --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "protocol", "extra"),
    [
        ("simple_sequence", "http", ()),
        ("sequence_accumulator", "grpc", ()),
        ("sequence_controls", "grpc", ("--streaming",)),
        ("sequence_state", "grpc", ("--streaming",)),
    ],
)
@pytest.mark.timeout(600)
def test_perf_analyzer_runs_sequences(
    sequence_server: GeserveProcess,
    perf_analyzer: str,
    model: str,
    protocol: str,
    extra: tuple[str, ...],
) -> None:
    http = httpclient.InferenceServerClient(sequence_server.url)
    before = http.get_inference_statistics(model)["model_stats"][0]["inference_stats"]
    port = sequence_server.http_port if protocol == "http" else sequence_server.grpc_port
    output = run_perf_analyzer(
        perf_analyzer, "-m", model, "-i", protocol, "-u", f"127.0.0.1:{port}", "--sequence-length", "20",
        "--concurrency-range", "6", *extra,
    )  # fmt: skip
    assert "Throughput:" in output
    after = http.get_inference_statistics(model)["model_stats"][0]["inference_stats"]
    assert after["fail"]["count"] == before["fail"]["count"], "perf_analyzer's sequences met errors"
    assert after["success"]["count"] > before["success"]["count"]

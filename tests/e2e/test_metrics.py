"""Scheduling seen from outside: pending counts, executions, queue limits, statistics and metrics agree."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, copy_model, write_identity_model

pytestmark = pytest.mark.e2e
Launch = Callable[..., GeserveProcess]


def scrape(server: GeserveProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"] == "text/plain; charset=utf-8"
        return str(response.read().decode())


def metric(text: str, name: str, model: str, **labels: str) -> float:
    label_text = ",".join(f'{k}="{v}"' for k, v in sorted({"model": model, "version": "1", **labels}.items()))
    match = re.search(rf"^{name}\{{{re.escape(label_text)}\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{{{label_text}}} not in metrics"
    return float(match.group(1))


def identity_repository(repository: Path, name: str, delay_ms: int, batching: str) -> None:
    write_identity_model(
        repository,
        name,
        dtype="TYPE_INT32",
        dims="4",
        max_batch_size=4,
        extra=f'{batching}\nparameters {{ key: "execute_delay_ms" value: {{ string_value: "{delay_ms}" }} }}',
    )


async def _infer(client: aiohttpclient.InferenceServerClient, model: str, value: int) -> np.ndarray:
    data = np.full((1, 4), value, dtype=np.int32)
    tensor = aiohttpclient.InferInput("INPUT0", [1, 4], "INT32")
    tensor.set_data_from_numpy(data)
    result = await client.infer(model, [tensor], request_id=str(value))
    assert result.get_response()["id"] == str(value)
    output = result.as_numpy("OUTPUT0")
    assert output is not None
    return output


async def test_dynamic_batches_drain_with_exact_pending_counts(launch: Launch, repository: Path) -> None:
    identity_repository(repository, "batched", 2000, "dynamic_batching { max_queue_delay_microseconds: 100000 }")
    server = launch(f"--model-repository={repository}").wait_live()
    seen: list[float] = []

    async def watch() -> None:
        while not seen or seen[-1] != 0:
            pending = metric(await asyncio.to_thread(scrape, server), "nv_inference_pending_request_count", "batched")
            if (seen or pending == 6) and (not seen or seen[-1] != pending):
                seen.append(pending)
            await asyncio.sleep(0.05)

    async with aiohttpclient.InferenceServerClient(server.url, conn_limit=20) as client:
        watcher = asyncio.create_task(watch())
        outputs = await asyncio.gather(*(_infer(client, "batched", value) for value in range(10)))
        await asyncio.wait_for(watcher, 10)
    for value, output in enumerate(outputs):
        np.testing.assert_array_equal(output, np.full((1, 4), value, dtype=np.int32))
    assert seen == [6, 2, 0]
    text = scrape(server)
    assert 'nv_inference_pending_request_count{model="batched",version="1"} 0\n' in text
    assert metric(text, "nv_inference_count", "batched") == 10
    assert metric(text, "nv_inference_exec_count", "batched") == 3  # ceil(10 / 4)
    assert metric(text, "nv_inference_request_success", "batched") == 10
    stats = httpclient.InferenceServerClient(server.url).get_inference_statistics("batched")["model_stats"][0]
    assert (stats["inference_count"], stats["execution_count"]) == (10, 3)
    assert sorted(entry["batch_size"] for entry in stats["batch_stats"]) == [2, 4]


async def test_default_scheduler_runs_each_request_alone(launch: Launch, repository: Path) -> None:
    identity_repository(repository, "unbatched", 200, "")
    server = launch(f"--model-repository={repository}").wait_live()
    async with aiohttpclient.InferenceServerClient(server.url, conn_limit=20) as client:
        outputs = await asyncio.gather(*(_infer(client, "unbatched", value) for value in range(10)))
    for value, output in enumerate(outputs):
        assert output.tolist() == [[value] * 4]
    text = scrape(server)
    assert metric(text, "nv_inference_count", "unbatched") == 10
    assert metric(text, "nv_inference_exec_count", "unbatched") == 10


async def test_max_queue_size_rejects_the_overflow(launch: Launch, repository: Path) -> None:
    identity_repository(
        repository,
        "bounded",
        1000,
        "dynamic_batching { max_queue_delay_microseconds: 100000 default_queue_policy { max_queue_size: 4 } }",
    )
    server = launch(f"--model-repository={repository}").wait_live()
    async with aiohttpclient.InferenceServerClient(server.url, conn_limit=20) as client:
        results = await asyncio.gather(
            *(_infer(client, "bounded", value) for value in range(10)), return_exceptions=True
        )
        rejected = [r for r in results if isinstance(r, InferenceServerException)]
        assert len(rejected) == 2
        for value, result in enumerate(results):
            if isinstance(result, InferenceServerException):
                assert (result.status(), result.message()) == (
                    "503",
                    f"[request id: {value}] Exceeds maximum queue size",
                )
        for value, result in enumerate(results):
            if isinstance(result, np.ndarray):
                assert result.tolist() == [[value] * 4]
        # Fill the queue again, then one more over gRPC: UNAVAILABLE.
        running = [asyncio.create_task(_infer(client, "bounded", value)) for value in range(8)]
        for _ in range(100):
            if metric(await asyncio.to_thread(scrape, server), "nv_inference_pending_request_count", "bounded") == 4:
                break
            await asyncio.sleep(0.02)
        grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        tensor = grpcclient.InferInput("INPUT0", [1, 4], "INT32")
        tensor.set_data_from_numpy(np.zeros((1, 4), dtype=np.int32))
        with pytest.raises(InferenceServerException) as error:
            await asyncio.to_thread(grpc_client.infer, "bounded", [tensor])
        assert (error.value.status(), error.value.message()) == ("StatusCode.UNAVAILABLE", "Exceeds maximum queue size")
        await asyncio.gather(*running)
    text = scrape(server)
    assert metric(text, "nv_inference_request_failure", "bounded", reason="REJECTED") == 3
    assert metric(text, "nv_inference_request_success", "bounded") == 16


def test_statistics_and_metrics_agree_after_mixed_load(server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(server.url)
    grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    for batch in (1, 3, 8):
        for module, client in ((httpclient, http), (grpcclient, grpc_client)):
            inputs = []
            for name in ("INPUT0", "INPUT1"):
                tensor = module.InferInput(name, [batch, 16], "INT32")
                tensor.set_data_from_numpy(np.ones((batch, 16), dtype=np.int32))
                inputs.append(tensor)
            client.infer("simple", inputs)
    half = httpclient.InferInput("INPUT0", [1, 16], "INT32")
    half.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    with pytest.raises(InferenceServerException):
        http.infer("simple", [half])  # a missing input: a failure of the model's requests
    stats = http.get_inference_statistics("simple")["model_stats"][0]
    text = scrape(server)
    inference = stats["inference_stats"]
    assert metric(text, "nv_inference_request_success", "simple") == inference["success"]["count"]
    assert metric(text, "nv_inference_count", "simple") == stats["inference_count"]
    assert metric(text, "nv_inference_exec_count", "simple") == stats["execution_count"]
    failures = sum(
        metric(text, "nv_inference_request_failure", "simple", reason=r)
        for r in ("REJECTED", "CANCELED", "BACKEND", "OTHER")
    )
    assert failures == inference["fail"]["count"] >= 1
    for family, key in (("request", "success"), ("queue", "queue"), ("compute_infer", "compute_infer")):
        assert metric(text, f"nv_inference_{family}_duration_us", "simple") == inference[key]["ns"] // 1000
    assert inference["success"]["count"] >= 6 and stats["inference_count"] >= 24
    assert {entry["batch_size"] for entry in stats["batch_stats"]} >= {1, 3, 8}
    # gRPC reports the same numbers.
    grpc_stats = grpc_client.get_inference_statistics("simple", as_json=True)["model_stats"][0]
    assert int(grpc_stats["inference_count"]) == stats["inference_count"]
    assert grpc_stats["version"] == "1"


def test_metrics_text_as_triton_prints_it(server: GeserveProcess) -> None:
    text = scrape(server)
    assert "# TYPE nv_inference_request_success counter\n" in text
    assert "# TYPE nv_inference_pending_request_count gauge\n" in text
    assert not re.search(r"^nv_inference\w*_total", text, re.MULTILINE)  # counters keep their names
    for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
        assert f'nv_inference_request_failure{{model="digits",reason="{reason}",version="1"}} ' in text
    assert metric(text, "nv_model_load_duration_secs", "simple") > 0
    assert re.search(r"^nv_cpu_utilization \S+$", text, re.MULTILINE)
    assert re.search(r"^nv_cpu_memory_total_bytes [0-9]+$", text, re.MULTILINE)
    assert re.search(r"^nv_cpu_memory_used_bytes [0-9]+$", text, re.MULTILINE)
    assert "summary_us" not in text and "histogram" not in text  # off by default


def test_statistics_endpoints(server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(server.url)
    everything = http.get_inference_statistics()["model_stats"]
    assert [(s["name"], s["version"]) for s in everything] == [
        ("bls_example", "1"),
        ("digits", "1"),
        ("digits_ensemble", "1"),
        ("digits_postprocess", "1"),
        ("digits_preprocess", "1"),
        ("repeat_int32", "1"),
        ("sequence_accumulator", "1"),
        ("sequence_controls", "1"),
        ("simple", "1"),
        ("simple_identity", "1"),
        ("simple_sequence", "1"),
        ("simple_string", "1"),
    ]
    entry = http.get_inference_statistics("digits", "1")["model_stats"][0]
    assert set(entry) == {
        "name", "version", "last_inference", "inference_count", "execution_count",
        "inference_stats", "response_stats", "batch_stats", "memory_usage",
    }  # fmt: skip
    assert set(entry["inference_stats"]) == {
        "success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss",
    }  # fmt: skip
    with pytest.raises(InferenceServerException) as error:
        http.get_inference_statistics("nope")
    assert error.value.message() == "Request for unknown model: 'nope' is not found"
    assert "statistics" in http.get_server_metadata()["extensions"]


def test_latency_summaries_histograms_and_switches(launch: Launch, repository: Path) -> None:
    copy_model("simple", repository)
    server = launch(
        f"--model-repository={repository}",
        "--metrics-config=summary_latencies=true",
        "--metrics-config=summary_quantiles=0.5:0.05,0.99:0.001",
        "--metrics-config=histogram_latencies=true",
        "--metrics-config=counter_latencies=false",
    ).wait_live()
    client = httpclient.InferenceServerClient(server.url)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = httpclient.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
        inputs.append(tensor)
    for _ in range(3):
        client.infer("simple", inputs)
    text = scrape(server)
    assert "_duration_us" not in text
    assert "# TYPE nv_inference_request_summary_us summary" in text
    assert metric(text, "nv_inference_queue_summary_us_count", "simple") == 3
    assert re.search(
        r'^nv_inference_compute_infer_summary_us\{model="simple",version="1",quantile="0.99"\} \S+$', text, re.MULTILINE
    )
    assert metric(text, "nv_inference_first_response_histogram_ms_count", "simple") == 3
    bucket = 'nv_inference_first_response_histogram_ms_bucket{model="simple",version="1",le="%s"} 3\n'
    assert bucket % "+Inf" in text and bucket % "100" in text and bucket % "5000" in text
    no_metrics = launch(f"--model-repository={repository}", "--allow-metrics=false").wait_live()
    with pytest.raises(OSError):
        scrape(no_metrics)


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_cancelled_grpc_request_leaves_the_queue(launch: Launch, repository: Path) -> None:
    identity_repository(repository, "slow", 1500, "dynamic_batching { }")
    server = launch(f"--model-repository={repository}").wait_live()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    tensor = grpcclient.InferInput("INPUT0", [4, 4], "INT32")
    tensor.set_data_from_numpy(np.zeros((4, 4), dtype=np.int32))
    answers: list[object] = []
    client.async_infer("slow", [tensor], callback=lambda result, error: answers.append(error or result))
    time.sleep(0.3)  # the first request is running by now
    # The next request queues behind the running one, and its client gives up.
    with pytest.raises(InferenceServerException) as error:
        client.infer("slow", [tensor], client_timeout=0.4)
    assert error.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    wait_until(lambda: metric(scrape(server), "nv_inference_request_failure", "slow", reason="CANCELED") == 1)
    assert metric(scrape(server), "nv_inference_pending_request_count", "slow") == 0
    wait_until(lambda: bool(answers))
    assert metric(scrape(server), "nv_inference_exec_count", "slow") == 1  # the cancelled one never ran

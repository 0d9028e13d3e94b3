"""The metrics endpoint's text over an in-process service: Triton's families from the API's snapshots."""

from __future__ import annotations

import numpy as np

from geserve.core.api import InferenceAPI
from geserve.metrics.exposition import render
from geserve.metrics.registry import create_registry
from geserve.settings import MetricsSettings
from geserve.types import InferInput, InferRequest


async def test_a_scrape_publishes_the_counters_summaries_and_histogram_of_each_version(service: InferenceAPI) -> None:
    values = np.ones((1, 2), np.float32)
    for _ in range(3):
        await service.infer(InferRequest("echo", "", (InferInput("INPUT0", "FP32", (1, 2), values),)))
    settings = MetricsSettings(summary_latencies=True, histogram_latencies=True, cpu_metrics=False)
    registry, collector = create_registry(service, settings)
    await collector.refresh()
    lines = render(registry).decode().splitlines()
    assert 'nv_inference_request_success{model="echo",version="1"} 3' in lines
    assert 'nv_inference_request_success{model="simple",version="1"} 0' in lines
    assert 'nv_inference_request_failure{model="echo",reason="OTHER",version="1"} 0' in lines
    assert 'nv_inference_request_summary_us_count{model="echo",version="1"} 3' in lines
    assert 'nv_inference_first_response_histogram_ms_count{model="echo",version="1"} 3' in lines
    assert any(
        line.startswith('nv_inference_queue_summary_us{model="echo",version="1",quantile="0.5"}') for line in lines
    )
    # A scrape reads a new snapshot: what happened since shows in the next one, not in an older render.
    await service.infer(InferRequest("echo", "", (InferInput("INPUT0", "FP32", (1, 2), values),)))
    assert 'nv_inference_request_success{model="echo",version="1"} 3' in render(registry).decode().splitlines()
    await collector.refresh()
    assert 'nv_inference_request_success{model="echo",version="1"} 4' in render(registry).decode().splitlines()

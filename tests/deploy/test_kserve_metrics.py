"""deploy/kserve's metrics as a cluster scrapes them: the annotations KServe leaves on a predictor pod, and the
PodMonitor's targets."""

from __future__ import annotations

from typing import Any

import pytest

from geserve.cli import parse_settings
from tests.deploy.kserve import (
    ENABLE_METRIC_AGGREGATION,
    ENABLE_PROMETHEUS_SCRAPING,
    ISVC_POD_LABEL,
    KSERVE_CONTAINER_PROMETHEUS_PORT,
    METRICS_AGGREGATOR_DEFAULTS,
    PROMETHEUS_PORT,
    PROMETHEUS_SCRAPE,
    QUEUE_PROXY,
    RAW,
    SERVERLESS,
    annotation_scrape,
    deployment_modes,
    inject_metrics_aggregator,
    predictor_metadata,
    predictor_pod,
    predictor_pod_annotations,
    running_pod,
)
from tests.deploy.manifests import DEPLOY, by_kind, kserve_objects, render_chart
from tests.deploy.prometheus import pod_monitor_rules, pod_monitor_scrapes, pod_targets, relabel, selects

Object = dict[str, Any]
# inferenceservice-config's metricsAggregator as KServe ships it, and as the qpext README suggests for a cluster
# that has swapped Knative's queue-proxy for qpext (kserve/kserve qpext/README.md).
CLUSTER_CONFIGS = [
    METRICS_AGGREGATOR_DEFAULTS,
    {"enableMetricAggregation": "true", "enablePrometheusScraping": "true"},
]
POD_IPS = ("10.1.2.3", "fd00:10:1::7")


def _runtimes() -> dict[str, Object]:
    return {r["metadata"]["name"]: r for r in by_kind(kserve_objects(), "ClusterServingRuntime")}


def _services() -> list[tuple[Object, Object]]:
    """Every InferenceService with the runtime it names."""
    runtimes = _runtimes()
    services = [
        (isvc, runtimes[isvc["spec"]["predictor"]["model"]["runtime"]])
        for isvc in by_kind(kserve_objects(), "InferenceService")
    ]
    assert services
    return services


def _monitor() -> Object:
    monitors = by_kind(kserve_objects(), "PodMonitor")
    assert len(monitors) == 1, "deploy/kserve ships one PodMonitor for the predictor pods"
    return monitors[0]


def _listeners(pod: Object, mode: str, qpext: bool) -> dict[int, str]:
    """Port -> what answers on it in a predictor pod: geserve's listeners (its command line), the queue-proxy's in
    Knative mode, and qpext's aggregate port where Knative's queue-sidecar-image is KServe's qpext."""
    options = parse_settings(pod["containers"][0]["args"])
    found = {
        options.http.port: "geserve http",
        options.grpc.port: "geserve grpc",
        options.metrics.port: "geserve metrics",
    }
    if mode == SERVERLESS:
        found |= {9090: "queue-proxy autoscaler metrics", 9091: "queue-proxy user metrics"}
        if qpext:
            found[9088] = "qpext aggregate"
    return found


def test_the_metrics_webhook_model_follows_kserve() -> None:
    """InjectMetricsAggregator's cases (kserve/kserve pkg/webhook/admission/pod/metrics_aggregate_injector_test.go):
    scraping alone points at queue-proxy's 9091, scraping with aggregation at qpext's 9088 with the runtime's port in
    the queue-proxy's environment, a switch left out comes from the cluster's config, and one set "false" leaves the
    pod's own prometheus.io annotations alone."""
    runtime_port = {KSERVE_CONTAINER_PROMETHEUS_PORT: "8002"}
    scraped, env = inject_metrics_aggregator(runtime_port | {ENABLE_PROMETHEUS_SCRAPING: "true"}, queue_proxy=True)
    assert (scraped[PROMETHEUS_PORT], env) == ("9091", {})
    both = runtime_port | {ENABLE_PROMETHEUS_SCRAPING: "true", ENABLE_METRIC_AGGREGATION: "true"}
    scraped, env = inject_metrics_aggregator(both, queue_proxy=True)
    assert scraped[PROMETHEUS_PORT] == "9088" and env["KSERVE_CONTAINER_PROMETHEUS_METRICS_PORT"] == "8002"
    scraped, env = inject_metrics_aggregator(both, queue_proxy=False)  # raw mode: no queue-proxy to configure
    assert scraped[PROMETHEUS_PORT] == "9088" and env == {}
    scraped, env = inject_metrics_aggregator({}, queue_proxy=True, config=CLUSTER_CONFIGS[1])
    assert scraped[PROMETHEUS_PORT] == "9088" and env["KSERVE_CONTAINER_PROMETHEUS_METRICS_PORT"] == "8080"
    own = {ENABLE_PROMETHEUS_SCRAPING: "false", PROMETHEUS_PORT: "8002"}
    assert inject_metrics_aggregator(own, queue_proxy=True, config=CLUSTER_CONFIGS[1])[0][PROMETHEUS_PORT] == "8002"
    # The InferenceService's annotations win over the runtime's; KServe's disallowed ones never reach the pod.
    runtime = {"spec": {"annotations": {ENABLE_PROMETHEUS_SCRAPING: "false"}}}
    isvc = {
        "metadata": {"name": "m", "annotations": {ENABLE_PROMETHEUS_SCRAPING: "true", "modelFormat": "onnx"}},
        "spec": {"predictor": {}},
    }
    labels, annotations = predictor_metadata(runtime, isvc)
    assert annotations == {ENABLE_PROMETHEUS_SCRAPING: "true"}
    assert labels[ISVC_POD_LABEL] == "m" and labels["component"] == "predictor"


@pytest.mark.parametrize("config", CLUSTER_CONFIGS, ids=["kserve-defaults", "cluster-wide-on"])
def test_every_inference_service_is_scraped_at_geserves_metrics_port(config: dict[str, str]) -> None:
    """A Prometheus that finds pods by their prometheus.io annotations scrapes geserve's --metrics-port in every mode
    the service may run in, whatever the cluster's metricsAggregator defaults. KServe's scraping switch would send it
    to queue-proxy's 9091 (9088 with aggregation), and raw mode has no queue-proxy at all."""
    checked = 0
    for isvc, runtime in _services():
        pod = predictor_pod(runtime, isvc)
        metrics_port = parse_settings(pod["containers"][0]["args"]).metrics.port
        for mode in deployment_modes(isvc):
            annotations, _ = predictor_pod_annotations(runtime, isvc, mode, config)
            scrape = annotation_scrape(annotations)
            name = f"{isvc['metadata']['name']} ({mode})"
            assert scrape is not None, f'{name}: no {PROMETHEUS_SCRAPE}: "true" on the pod, {annotations}'
            assert scrape == (metrics_port, "/metrics"), f"{name}: scraped at {scrape}, geserve's is {metrics_port}"
            assert _listeners(pod, mode, qpext=False)[scrape[0]] == "geserve metrics", name
            checked += 1
    assert checked


def test_aggregation_reaches_geserve_only_through_qpext_in_knative_mode() -> None:
    """Why the services do not turn aggregation on: KServe then points Prometheus at 9088, which only qpext, swapped in
    as Knative's queue-sidecar-image, listens on; it scrapes the runtime's prometheus.kserve.io/port (geserve's
    metrics). In raw mode, and on a cluster with Knative's own queue-proxy, 9088 has no listener."""
    for isvc, runtime in _services():
        opted = {
            **isvc,
            "metadata": {
                **isvc["metadata"],
                "annotations": {ENABLE_METRIC_AGGREGATION: "true", ENABLE_PROMETHEUS_SCRAPING: "true"},
            },
        }
        pod = predictor_pod(runtime, opted)
        metrics_port = parse_settings(pod["containers"][0]["args"]).metrics.port
        annotations, env = predictor_pod_annotations(runtime, opted, SERVERLESS)
        scrape = annotation_scrape({**annotations, PROMETHEUS_SCRAPE: "true"})
        assert scrape is not None
        assert _listeners(pod, SERVERLESS, qpext=True)[scrape[0]] == "qpext aggregate"
        assert scrape[0] not in _listeners(pod, SERVERLESS, qpext=False)
        assert env["KSERVE_CONTAINER_PROMETHEUS_METRICS_PORT"] == str(metrics_port)  # what qpext scrapes of geserve
        annotations, env = predictor_pod_annotations(runtime, opted, RAW)
        assert int(annotations[PROMETHEUS_PORT]) not in _listeners(pod, RAW, qpext=True) and env == {}


# -- the PodMonitor ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pod_ip", POD_IPS)
def test_the_pod_monitor_scrapes_each_predictor_pod_once_at_geserves_metrics_port(pod_ip: str) -> None:
    monitor = _monitor()
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    checked = 0
    for isvc, runtime in _services():
        labels, _ = predictor_metadata(runtime, isvc)
        assert selects(monitor["spec"]["selector"], labels), isvc["metadata"]["name"]
        for mode in deployment_modes(isvc):
            pod = running_pod(runtime, isvc, mode)
            metrics_port = parse_settings(pod["containers"][0]["args"]).metrics.port
            scraped = pod_monitor_scrapes(monitor, pod_targets(labels, pod, pod_ip))
            name = f"{isvc['metadata']['name']} ({mode})"
            assert [url for url, _ in scraped] == [f"http://{host}:{metrics_port}/metrics"], (name, scraped)
            assert dict(next(iter(scraped))[1])["container"] == "kserve-container", name
            checked += 1
    assert checked


def test_the_pod_monitor_leaves_other_pods_alone() -> None:
    """A predictor pod of another runtime (KServe's Triton, which also serves metrics on 8002) and the Helm chart's
    own pods, which its ServiceMonitor scrapes, are not selected."""
    selector = _monitor()["spec"]["selector"]
    triton = {"metadata": {"name": "t"}, "spec": {"predictor": {"model": {"runtime": "kserve-tritonserver"}}}}
    labels, _ = predictor_metadata({"spec": {}}, triton)
    assert not selects(selector, labels)
    chart_pod = by_kind(render_chart(), "Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    assert not selects(selector, chart_pod)


def test_a_declared_port_filter_would_scrape_nothing() -> None:
    """Why the PodMonitor rewrites the address: the Operator's `portNumber` (and `port`) keep only targets of declared
    ports, and no predictor container declares geserve's metrics port."""
    monitor = _monitor()
    by_port = {
        **monitor,
        "spec": {**monitor["spec"], "podMetricsEndpoints": [{"portNumber": 8002, "path": "/metrics"}]},
    }
    for isvc, runtime in _services():
        labels, _ = predictor_metadata(runtime, isvc)
        for mode in deployment_modes(isvc):
            assert (
                pod_monitor_scrapes(by_port, pod_targets(labels, running_pod(runtime, isvc, mode), POD_IPS[0])) == set()
            )


def test_the_relabel_model_follows_prometheus() -> None:
    target = {"__address__": "10.0.0.1", "__meta_kubernetes_pod_container_name": QUEUE_PROXY, "a": "x"}
    assert (
        relabel(
            target,
            [{"sourceLabels": ["__meta_kubernetes_pod_container_name"], "regex": "kserve-container", "action": "keep"}],
        )
        is None
    )
    assert relabel(target, [{"sourceLabels": ["a"], "regex": "x|y", "action": "drop"}]) is None
    assert relabel(target, [{"sourceLabels": ["a"], "regex": "", "action": "drop"}]) == target  # anchored: no match
    moved = relabel(
        target,
        [{"sourceLabels": ["__address__"], "regex": "([^:]+)", "targetLabel": "__address__", "replacement": "$1:8002"}],
    )
    assert moved is not None and moved["__address__"] == "10.0.0.1:8002"
    unmoved = relabel(
        target, [{"sourceLabels": ["a"], "regex": "(z)", "targetLabel": "__address__", "replacement": "${1}:1"}]
    )
    assert unmoved == target
    monitor = {
        "metadata": {"name": "m"},
        "spec": {"selector": {"matchExpressions": [{"key": "k.io/x", "operator": "Exists"}]}},
    }
    rules = pod_monitor_rules(monitor, {})
    assert relabel({"__meta_kubernetes_pod_phase": "Running"}, rules) is None
    kept = relabel(
        {"__meta_kubernetes_pod_phase": "Running", "__meta_kubernetes_pod_labelpresent_k_io_x": "true"}, rules
    )
    assert kept is not None and kept["job"] == "monitoring/m"


def test_kube_prometheus_stack_picks_the_pod_monitor() -> None:
    """kube-prometheus-stack's Prometheus selects PodMonitors by `release: <its release>` (podMonitorSelectorNilUsesHelmValues,
    prometheus-community/helm-charts charts/kube-prometheus-stack templates/prometheus/prometheus.yaml) in every
    namespace; the PodMonitor then selects pods in every namespace."""
    monitor = _monitor()
    assert selects({"matchLabels": {"release": "kube-prometheus-stack"}}, monitor["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


def test_the_readme_applies_the_pod_monitor_and_says_why_kserves_switches_are_off() -> None:
    kserve_section = (DEPLOY / "README.md").read_text().split("## KServe", 1)[1]
    assert "kubectl apply -f deploy/kserve/podmonitor.yaml" in kserve_section
    metrics = kserve_section.split("**Metrics.**", 1)[1].split("\n\n", 1)[0]
    for needed in (ENABLE_PROMETHEUS_SCRAPING, ENABLE_METRIC_AGGREGATION, "9091", "9088", "raw mode", "qpext"):
        assert needed in metrics, needed

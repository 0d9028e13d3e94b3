"""deploy/ checked offline: the chart renders and validates, manifests match the CLI and live metrics."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from geserve.cli import parse_settings
from tests.deploy.kserve import quantity
from tests.deploy.manifests import (
    CHART,
    CRDS,
    DEPLOY,
    MONITORING_APIS,
    by_kind,
    containers_of,
    crd_schemas,
    kserve_objects,
    render_chart,
    render_installed,
    validate_core,
    validate_custom,
)
from tests.fakes.om_models import write_affine_om
from tests.support import ROOT, GeserveProcess, copy_model

CUSTOM_KINDS = {
    "ServiceMonitor",
    "PodMonitor",
    "PrometheusRule",
    "ClusterServingRuntime",
    "InferenceService",
    "TrainedModel",
}
METRIC_NAME = re.compile(r"\b(nv_[a-z0-9_]+|geserve[_:][a-z0-9_:]+)\b")


def _crds() -> dict[tuple[str, str], dict[str, Any]]:
    if not CRDS.is_dir():
        pytest.skip(f"the CRD schemas are not here ({CRDS}); custom resources cannot be validated")
    return crd_schemas()


@pytest.mark.parametrize("values", [None, "values-ascend.yaml"])
def test_chart_renders_valid_objects(values: str | None) -> None:
    objects = render_installed(values)
    kinds = sorted(document["kind"] for document in objects)
    # A PodDisruptionBudget only where more than one pod runs: not with the Ascend values' single replica.
    budget = ["PodDisruptionBudget"] if values is None else []
    assert kinds == sorted(
        [
            "ConfigMap",
            "ConfigMap",
            "Deployment",
            "HorizontalPodAutoscaler",
            "PrometheusRule",
            "Service",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
            *budget,
        ]
    )
    for document in objects:
        if document["kind"] not in CUSTOM_KINDS:
            validate_core(document)
    schemas = _crds()
    for document in objects:
        if document["kind"] in CUSTOM_KINDS:
            validate_custom(document, schemas)


def test_kserve_manifests_validate_against_the_crds() -> None:
    objects = kserve_objects()
    assert sorted({document["kind"] for document in objects}) == [
        "ClusterServingRuntime",
        "InferenceService",
        "PodMonitor",
        "TrainedModel",
    ]
    schemas = _crds()
    for document in objects:
        validate_custom(document, schemas)


def _options(args: list[str]) -> Any:
    return parse_settings(args)


def test_deployment_probes_ports_and_hardening_match_the_cli() -> None:
    for values in (None, "values-ascend.yaml"):
        deployment = by_kind(render_installed(values), "Deployment")[0]
        pod = deployment["spec"]["template"]["spec"]
        container = containers_of(deployment)[0]
        options = _options(container["args"])
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert ports == {"http": options.http.port, "grpc": options.grpc.port, "metrics": options.metrics.port}
        assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
        assert container["startupProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
        # /dev/shm in memory, large enough for at least a few workers' pairs of arenas
        shm = next(volume for volume in pod["volumes"] if volume["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert quantity(shm["emptyDir"]["sizeLimit"]) >= 8 * 2 * options.workers.arena_bytes
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        # drained within the grace period: the exit timeout leaves the kubelet time to spare
        assert options.server.exit_timeout_secs < pod["terminationGracePeriodSeconds"]


def test_ascend_values_request_npus_and_mount_the_driver_only() -> None:
    deployment = by_kind(render_installed("values-ascend.yaml"), "Deployment")[0]
    container = containers_of(deployment)[0]
    assert container["resources"]["requests"]["huawei.com/Ascend310P"] == 1
    assert container["resources"]["limits"]["huawei.com/Ascend310P"] == 1
    driver = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "ascend-driver")
    assert driver["hostPath"]["path"] == "/usr/local/Ascend/driver"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "ascend-driver")
    assert mount["readOnly"] is True and mount["mountPath"] == "/usr/local/Ascend/driver"
    assert "Ascend" not in json.dumps(by_kind(render_chart(), "Deployment")[0])  # CPU values: no NPU parts


def test_kserve_runtime_args_probes_and_annotations() -> None:
    for runtime in by_kind(kserve_objects(), "ClusterServingRuntime"):
        container = containers_of(runtime)[0]
        options = _options(container["args"])
        assert options.repository.paths == (Path("/mnt/models"),)
        assert (options.http.port, options.grpc.port) == (8080, 9000)
        for probe in ("readinessProbe", "startupProbe"):
            assert container[probe]["httpGet"] == {"path": "/v2/health/ready", "port": options.http.port}
        annotations = runtime["spec"]["annotations"]
        assert annotations["prometheus.kserve.io/port"] == str(options.metrics.port)
        assert annotations["prometheus.kserve.io/path"] == "/metrics"
        assert set(runtime["spec"]["protocolVersions"]) == {"v2", "grpc-v2"}
        assert {f["name"] for f in runtime["spec"]["supportedModelFormats"]} == {"onnx", "python", "om"}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert options.repository.control_mode.value == "explicit"  # the model agent drives the repository API


# -- container images ----------------------------------------------------------------------------


def _instruction(dockerfile: Path, name: str) -> list[str]:
    """The last `name` instruction's arguments: the one in effect in the final image."""
    found: list[str] | None = None
    for line in dockerfile.read_text().splitlines():
        if line.startswith(f"{name} "):
            value = line[len(name) + 1 :].strip()
            found = json.loads(value) if value.startswith("[") else value.split()
    assert found is not None, f"{dockerfile.name} has no {name}"
    return found


@pytest.mark.parametrize("image", ["Dockerfile.cpu", "Dockerfile.ascend"])
def test_dockerfile_command_parses_with_the_cli(image: str) -> None:
    dockerfile = DEPLOY / "docker" / image
    command = _instruction(dockerfile, "CMD")
    options = _options(command)
    assert options.repository.paths == (Path("/models"),)
    assert sorted(_instruction(dockerfile, "EXPOSE")) == sorted(
        str(port) for port in (options.http.port, options.grpc.port, options.metrics.port)
    )
    assert _instruction(dockerfile, "USER") == ["1000:1000"]
    text = dockerfile.read_text()
    # both images install the same pinned versions
    assert '-c /tmp/src/deploy/docker/constraints.txt "/tmp/src[onnx]"' in text
    if image == "Dockerfile.ascend":
        assert _instruction(dockerfile, "ENTRYPOINT") == ["tini", "--", "/usr/local/bin/geserve-ascend"]
        assert "driver" not in re.sub(r"#.*", "", text).replace("Ascend/driver", "")  # never copied in
        entrypoint = (DEPLOY / "docker" / "ascend-entrypoint.sh").read_text()
        assert "ascend-toolkit/set_env.sh" in entrypoint and 'exec "$geserve" "$@"' in entrypoint
        assert os.access(DEPLOY / "docker" / "ascend-entrypoint.sh", os.X_OK)
    else:
        assert _instruction(dockerfile, "ENTRYPOINT") == ["tini", "--", "geserve"]
        assert _instruction(dockerfile, "FROM")[0].startswith("python:3.11-slim")


# -- metric names ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """Metric families a geserve process exports with an ONNX model and an NPU (the pyACL simulator)."""
    root = tmp_path_factory.mktemp("metrics")
    repository = root / "models"
    copy_model("simple", repository)
    write_affine_om(repository / "affine" / "1" / "model.om", gears=[1, 2, 4])
    fakes = Path(__file__).resolve().parents[1] / "fakes"
    server = GeserveProcess(
        root / "geserve.log",
        f"--model-repository={repository}",
        "--device-ids=0",
        "--metrics-interval-ms=100",
        "--metrics-config=summary_latencies=true",
        env={"PYTHONPATH": os.pathsep.join([str(fakes), os.environ.get("PYTHONPATH", "")])},
    ).wait_live()
    try:
        names: set[str] = set()
        for _ in range(300):
            try:  # the metrics listener starts just after the HTTP one
                with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as answer:
                    text = answer.read().decode()
            except OSError:
                time.sleep(0.1)
                continue
            names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
            if "nv_gpu_memory_total_bytes" in names:
                break
            time.sleep(0.1)
        yield names
    finally:
        server.stop()


def _recorded(objects: list[dict[str, Any]]) -> set[str]:
    rule = by_kind(objects, "PrometheusRule")[0]
    return {r["record"] for group in rule["spec"]["groups"] for r in group["rules"] if "record" in r}


def test_every_metric_used_is_exported_or_recorded(live_metrics: set[str]) -> None:
    objects = render_chart()
    recorded = _recorded(objects)
    used: set[str] = set()
    rule = by_kind(objects, "PrometheusRule")[0]
    for group in rule["spec"]["groups"]:
        for entry in group["rules"]:
            used |= set(METRIC_NAME.findall(entry["expr"]))
    hpa = by_kind(objects, "HorizontalPodAutoscaler")[0]
    hpa_metrics = {metric["pods"]["metric"]["name"] for metric in hpa["spec"]["metrics"]}
    assert hpa_metrics <= recorded  # the HPA scales on the recording rule
    dashboard = json.loads((DEPLOY / "grafana" / "geserve-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= set(METRIC_NAME.findall(target["expr"]))
    for variable in dashboard["templating"]["list"]:
        used |= set(METRIC_NAME.findall(str(variable.get("query", ""))))
    exported = {name for name in used if name.startswith("nv_")}
    assert exported and exported <= live_metrics, sorted(exported - live_metrics)
    assert {"nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"} <= used
    assert {name for name in used if not name.startswith("nv_")} <= recorded


def test_dashboard_is_the_one_the_chart_ships() -> None:
    shipped = (DEPLOY / "grafana" / "geserve-dashboard.json").read_text()
    assert (CHART / "files" / "geserve-dashboard.json").read_text() == shipped
    configmap = by_kind(render_chart(), "ConfigMap")[0]
    assert json.loads(configmap["data"]["geserve-dashboard.json"]) == json.loads(shipped)
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    titles = {panel["title"] for panel in json.loads(shipped)["panels"]}
    assert {"Request rate", "Failures by reason", "Pending requests", "NPU memory", "NPU utilization"} <= titles


def _kinds(objects: list[dict[str, Any]]) -> list[str]:
    return sorted(document["kind"] for document in objects)


@pytest.mark.parametrize("values", [None, "values-ascend.yaml"])
def test_chart_installs_on_a_plain_cluster_and_adds_monitoring_where_its_apis_exist(values: str | None) -> None:
    plain = render_installed(values, api_versions=())
    # No CRD it would need; the ConfigMaps: the dashboard, and the adapter rule to install prometheus-adapter with.
    budget = ["PodDisruptionBudget"] if values is None else []
    assert _kinds(plain) == sorted(
        ["ConfigMap", "ConfigMap", "Deployment", "Service", "Service", "ServiceAccount", *budget]
    )
    assert by_kind(plain, "Deployment")[0]["spec"]["replicas"] >= 1  # no HPA: a fixed replica count
    for document in plain:
        validate_core(document)
    monitored = render_installed(values)
    assert {"ServiceMonitor", "PrometheusRule", "HorizontalPodAutoscaler"} <= set(_kinds(monitored))
    assert "replicas" not in by_kind(monitored, "Deployment")[0]["spec"]  # the HPA owns it
    # Operator present but no custom-metrics API: monitoring yes, an HPA that could never read its metric no.
    operator_only = render_installed(values, api_versions=MONITORING_APIS[:3])
    assert "ServiceMonitor" in _kinds(operator_only) and "HorizontalPodAutoscaler" not in _kinds(operator_only)
    forced = render_chart(api_versions=(), values={"metrics": {"serviceMonitor": {"enabled": True}}})
    assert "ServiceMonitor" in _kinds(forced)
    off = render_chart(values={"autoscaling": {"enabled": False}, "metrics": {"prometheusRule": {"enabled": False}}})
    assert "HorizontalPodAutoscaler" not in _kinds(off) and "PrometheusRule" not in _kinds(off)


def test_the_hpa_metric_is_recorded_by_the_rule_and_served_by_the_adapter_rule_the_chart_ships() -> None:
    objects = render_chart()
    hpa = by_kind(objects, "HorizontalPodAutoscaler")[0]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    recorded = [
        rule["record"]
        for group in by_kind(objects, "PrometheusRule")[0]["spec"]["groups"]
        for rule in group["rules"]
        if "record" in rule
    ]
    assert metric in recorded
    adapter = next(
        d for d in by_kind(objects, "ConfigMap") if d["metadata"]["name"].endswith("prometheus-adapter-rules")
    )
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    served = [rule for rule in rules if rule["name"]["as"] == metric]
    assert served and served[0]["seriesQuery"].startswith(f"{metric}{{")
    assert served[0]["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}


def test_the_grace_period_covers_prestop_drain_and_exit_timeout() -> None:
    for values in (None, "values-ascend.yaml"):
        deployment = by_kind(render_installed(values), "Deployment")[0]
        pod = deployment["spec"]["template"]["spec"]
        container = containers_of(deployment)[0]
        options = _options(container["args"])
        pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
        assert options.server.drain_delay_secs > 0 and pre_stop > 0
        # The endpoint removal propagates while the pod still serves: a few seconds at least in all.
        assert pre_stop + options.server.drain_delay_secs >= 5
        assert (
            pod["terminationGracePeriodSeconds"]
            >= pre_stop + options.server.drain_delay_secs + options.server.exit_timeout_secs + 5
        )


def _runtime_ports(runtime: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    container = runtime["spec"]["containers"][0]
    return container, _options(container["args"])


def test_kserve_ports_are_named_as_knative_routes_them() -> None:
    # Knative and KServe route a port named h2c as HTTP/2 (gRPC) and http1 as HTTP/1.1; a serverless
    # container may declare one port only, and KServe merges the runtime's ports with the service's, so
    # the runtimes declare none (REST gets Knative's default 8080) and a gRPC InferenceService declares
    # the h2c port itself, as KServe's own gRPC examples do (test_kserve_cluster.py builds the merge).
    objects = kserve_objects()
    runtimes = {document["metadata"]["name"]: document for document in by_kind(objects, "ClusterServingRuntime")}
    assert runtimes
    for runtime in runtimes.values():
        container, options = _runtime_ports(runtime)
        assert "ports" not in container
        assert options.grpc.port == 9000 and options.http.port == 8080  # KServe's conventions
        assert {"v2", "grpc-v2"} <= set(runtime["spec"]["protocolVersions"])
    services = by_kind(objects, "InferenceService")
    grpc_services = [s for s in services if s["spec"]["predictor"]["model"].get("protocolVersion") == "grpc-v2"]
    assert grpc_services, "no InferenceService shows how to reach gRPC"
    for service in grpc_services:
        model = service["spec"]["predictor"]["model"]
        _, options = _runtime_ports(runtimes[model["runtime"]])
        assert model["ports"] == [{"containerPort": options.grpc.port, "name": "h2c", "protocol": "TCP"}]
    for service in services:
        model = service["spec"]["predictor"]["model"]
        for port in model.get("ports", []):
            assert port["name"] in ("http1", "h2c")


def test_the_multi_model_runtime_reloads_its_models_after_a_restart_and_survives_a_bad_one() -> None:
    runtime = next(d for d in by_kind(kserve_objects(), "ClusterServingRuntime") if d["spec"].get("multiModel"))
    _, options = _runtime_ports(runtime)
    assert options.repository.control_mode.value == "explicit"
    assert list(options.repository.startup_models) == ["*"]
    assert not options.server.exit_on_error


def test_constraints_pin_every_runtime_dependency_within_the_declared_ranges() -> None:
    import tomllib
    from importlib import metadata

    from packaging.requirements import Requirement

    from scripts.write_constraints import TARGET, runtime_closure

    pins = {}
    for line in TARGET.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name] = version
    needed = runtime_closure()
    assert set(needed) <= set(pins), f"not pinned: {sorted(set(needed) - set(pins))}"
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for text in [*declared["dependencies"], *declared["optional-dependencies"]["onnx"]]:
        requirement = Requirement(text)
        key = requirement.name.lower().replace("_", "-")
        assert requirement.specifier.contains(pins[key], prereleases=True), f"{key}=={pins[key]} outside {text}"
    # uvicorn without its [standard] extras: the server names what it uses itself.
    assert not {"websockets", "watchfiles", "python-dotenv"} & set(pins)
    assert {"uvloop", "httptools"} <= set(pins)
    assert metadata.version("geserve")


def test_the_package_says_its_license_and_answers_to_tritonserver() -> None:
    from importlib import metadata

    meta = metadata.metadata("geserve")
    assert meta["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (meta.get_all("License-File") or [])
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.lstrip().startswith("Apache License") and "END OF TERMS AND CONDITIONS" in license_text
    assert any(c.startswith("Programming Language :: Python :: 3.11") for c in meta.get_all("Classifier") or [])
    scripts = {entry.name: entry.value for entry in metadata.entry_points(group="console_scripts")}
    assert scripts["tritonserver"] == scripts["geserve"] == "geserve.cli:main"


def test_the_chart_gives_compiled_models_a_writable_cache_and_the_image_a_writable_home() -> None:
    for values in (None, "values-ascend.yaml"):
        deployment = by_kind(render_installed(values), "Deployment")[0]
        container = containers_of(deployment)[0]
        cache_dir = _options(container["args"]).workers.model_cache_dir
        assert cache_dir is not None  # not ~/.cache: uid 1000 has no home and the root filesystem is read-only
        mount = next(m for m in container["volumeMounts"] if m["name"] == "model-cache")
        assert mount["mountPath"] == str(cache_dir) and not mount.get("readOnly")
        volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "model-cache")
        assert "emptyDir" in volume
    text = (DEPLOY / "docker" / "Dockerfile.ascend").read_text()
    assert "HOME=/tmp" in text and "XDG_CACHE_HOME=/var/cache/geserve" in text
    assert "install -d -o 1000 -g 1000 -m 0755 /var/cache/geserve /var/cache/geserve/geserve/om" in text

"""The chart on real clusters: kube-prometheus-stack, prometheus-adapter, Volcano, Ascend nodes, and its dashboard."""

from __future__ import annotations

import itertools
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_python import HelmRenderError, values_from_yaml

from tests.deploy.manifests import (
    ASCEND_NODE,
    CHART,
    DEPLOY,
    MONITORING_APIS,
    by_kind,
    containers_of,
    merged_values,
    render_chart,
    render_installed,
    render_templates,
    validate_core,
)
from tests.deploy.prometheus import selects

README = DEPLOY / "README.md"
VOLCANO_FILES = ("values-ascend.yaml", "values-ascend-volcano.yaml")
OPERATOR_ONLY = MONITORING_APIS[:3]  # the Prometheus Operator, before prometheus-adapter is installed


# -- deploy/README.md's commands --------------------------------------------------------------------


def _commands(text: str) -> list[list[str]]:
    """Every command of the README's bash blocks, continuations joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def _chart_installs(text: str) -> list[list[str]]:
    """The README's `helm install|upgrade` commands of this chart (not of prometheus-adapter's)."""
    return [
        words
        for words in _commands(text)
        if words[:2] in (["helm", "install"], ["helm", "upgrade"]) and "deploy/helm/geserve" in words
    ]


def _scalar(text: str) -> Any:
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return {"true": True, "false": False}.get(text, text)


def _set_values(words: list[str]) -> dict[str, Any]:
    """The values a command's `--set key=value` flags give, as helm reads them ({a,b} is a list)."""
    values: dict[str, Any] = {}
    for flag, argument in itertools.pairwise(words):
        if flag != "--set":
            continue
        for assignment in argument.split(",") if not re.search(r"\{.*\}", argument) else [argument]:
            key, equals, text = assignment.partition("=")
            assert key and equals and not re.search(r"[\\\[\]]", key), f"cannot read --set {argument}"
            value = [_scalar(item) for item in text[1:-1].split(",")] if text.startswith("{") else _scalar(text)
            *parents, leaf = key.split(".")
            nested: dict[str, Any] = {leaf: value}
            for part in reversed(parents):
                nested = {part: nested}
            values = merged_values(values, nested)
    return values


def _files(words: list[str]) -> tuple[str, ...]:
    return tuple(
        words[i + 1].removeprefix("deploy/helm/geserve/") for i, w in enumerate(words) if w in ("-f", "--values")
    )


def _declared(path: list[str], values: Any) -> bool:
    """Whether a values file declares `path`, or a map above it that takes any key (labels and the like)."""
    for index, part in enumerate(path):
        if not isinstance(values, dict):
            return False
        if part not in values:
            return values == {} and index > 0
        values = values[part]
    return True


def test_every_value_the_readme_sets_is_one_the_chart_reads() -> None:
    # helm ignores values the chart never reads: a misspelt --set installs without what it meant to change.
    known = [yaml.safe_load((CHART / name).read_text()) for name in ("values.yaml", "values-ascend.yaml")]
    installs = _chart_installs(README.read_text())
    assert installs
    for words in installs:
        for name in _files(words):
            assert (CHART / name).is_file(), name

        def paths(values: dict[str, Any], prefix: list[str]) -> list[list[str]]:
            found = []
            for key, value in values.items():
                found += paths(value, [*prefix, key]) if isinstance(value, dict) else [[*prefix, key]]
            return found

        for path in paths(_set_values(words), []):
            assert any(_declared(path, values) for values in known), f"{'.'.join(path)} is no value of the chart"


# -- kube-prometheus-stack --------------------------------------------------------------------------


def _kube_prometheus_stack(release: str) -> dict[str, Any]:
    """The selectors of the Prometheus kube-prometheus-stack installs with its defaults as `release`:
    serviceMonitorSelectorNilUsesHelmValues and ruleSelectorNilUsesHelmValues are true, so its
    templates/prometheus/prometheus.yaml sets `matchLabels: {release: <release>}`, and the namespace
    selectors stay {} (every namespace). prometheus-community/helm-charts,
    charts/kube-prometheus-stack/values.yaml and templates/prometheus/prometheus.yaml."""
    return {
        "serviceMonitorSelector": {"matchLabels": {"release": release}},
        "serviceMonitorNamespaceSelector": {},
        "ruleSelector": {"matchLabels": {"release": release}},
        "ruleNamespaceSelector": {},
    }


def _picked(prometheus: dict[str, Any], objects: list[dict[str, Any]]) -> set[str]:
    namespace = {"kubernetes.io/metadata.name": "serving"}
    picked = set()
    for kind, prefix in (("ServiceMonitor", "serviceMonitor"), ("PrometheusRule", "rule")):
        for document in by_kind(objects, kind):
            labels = document["metadata"].get("labels", {})
            if selects(prometheus[f"{prefix}Selector"], labels) and selects(
                prometheus[f"{prefix}NamespaceSelector"], namespace
            ):
                picked.add(kind)
    return picked


def test_the_label_selector_model_follows_kubernetes() -> None:
    labels = {"release": "prom", "app": "geserve"}
    assert selects({}, labels) and not selects(None, labels)
    assert selects({"matchLabels": {"release": "prom"}}, labels)
    assert not selects({"matchLabels": {"release": "other"}}, labels)
    assert selects({"matchExpressions": [{"key": "app", "operator": "In", "values": ["geserve"]}]}, labels)
    assert not selects({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, labels)
    assert selects({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["x"]}]}, labels)


def test_labels_let_kube_prometheus_stack_pick_the_service_monitor_and_rule() -> None:
    prometheus = _kube_prometheus_stack("kube-prometheus-stack")
    assert _picked(prometheus, render_chart()) == set()  # unlabelled: silently never scraped
    labelled = render_chart(
        values={
            "metrics": {
                "serviceMonitor": {"labels": {"release": "kube-prometheus-stack"}},
                "prometheusRule": {"labels": {"release": "kube-prometheus-stack"}},
            }
        }
    )
    assert _picked(prometheus, labelled) == {"ServiceMonitor", "PrometheusRule"}
    # The chart's own labels stay: the extra ones add, never replace.
    monitor = by_kind(labelled, "ServiceMonitor")[0]
    assert monitor["metadata"]["labels"]["app.kubernetes.io/name"] == "geserve"
    # ... and the ServiceMonitor still finds the metrics Service and its port.
    service = next(s for s in by_kind(labelled, "Service") if s["metadata"]["name"].endswith("-metrics"))
    assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}


def test_the_readme_install_for_kube_prometheus_stack_is_picked_up() -> None:
    text = README.read_text()
    labelled = [words for words in _chart_installs(text) if any("labels.release=" in w for w in words)]
    assert labelled, "deploy/README.md shows no install that kube-prometheus-stack's Prometheus would pick up"
    for words in labelled:
        values = _set_values(words)
        releases = {
            values.get("metrics", {}).get(kind, {}).get("labels", {}).get("release")
            for kind in ("serviceMonitor", "prometheusRule")
        }
        assert len(releases) == 1 and None not in releases, releases  # both, to the same Prometheus
        release = releases.pop()
        objects = render_chart(_files(words) or None, values=values)
        assert _picked(_kube_prometheus_stack(release), objects) == {"ServiceMonitor", "PrometheusRule"}
    assert "serviceMonitorSelectorNilUsesHelmValues" in text  # says why, and how to do without


# -- prometheus-adapter -----------------------------------------------------------------------------


def _adapter_rules(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in by_kind(objects, "ConfigMap") if d["metadata"]["name"].endswith("-prometheus-adapter-rules")]


@pytest.mark.parametrize("apis", [(), OPERATOR_ONLY, MONITORING_APIS], ids=["plain", "operator", "adapter"])
@pytest.mark.parametrize("enabled", ["auto", True])
def test_the_adapter_rules_render_before_the_adapter_exists(apis: tuple[str, ...], enabled: object) -> None:
    # The ConfigMap is what prometheus-adapter is installed with, so it cannot wait for the API the
    # adapter serves; only the HPA, which would read a metric nobody serves yet, waits (with auto).
    objects = render_chart(api_versions=apis, values={"autoscaling": {"enabled": enabled}})
    assert len(_adapter_rules(objects)) == 1
    hpa = bool(by_kind(objects, "HorizontalPodAutoscaler"))
    assert hpa == (enabled is True or "custom.metrics.k8s.io/v1beta1" in apis)
    for document in objects:
        if document["kind"] in ("ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler"):
            validate_core(document)


def test_no_adapter_rules_without_autoscaling() -> None:
    assert _adapter_rules(render_chart(values={"autoscaling": {"enabled": False}})) == []


def test_a_misspelt_switch_fails_the_render_naming_it() -> None:
    for path in (("autoscaling",), ("metrics", "serviceMonitor"), ("metrics", "prometheusRule")):
        value: dict[str, Any] = {"enabled": "ture"}
        for part in reversed(path):
            value = {part: value}
        with pytest.raises(HelmRenderError, match=re.escape(".".join(path)) + r"\.enabled is \"ture\""):
            render_chart(values=value)


def test_the_readme_fetches_the_adapter_rules_the_chart_renders_before_the_adapter_exists() -> None:
    commands = _commands(README.read_text())
    fetch = next(words for words in commands if words[:3] == ["kubectl", "get", "configmap"])
    name, namespace = fetch[3], fetch[fetch.index("-n") + 1]
    jsonpath = next(w for w in fetch if w.startswith("jsonpath="))
    key = re.fullmatch(r"jsonpath=\{\.data\.(.+)\}", jsonpath)
    assert key, jsonpath
    install = _chart_installs(README.read_text())[0]
    assert install[2] == "geserve" and install[install.index("--namespace") + 1] == namespace
    # render_chart installs release geserve into serving, as the README does, on a cluster without the adapter.
    objects = render_chart(api_versions=OPERATOR_ONLY)
    configmap = next(d for d in by_kind(objects, "ConfigMap") if d["metadata"]["name"] == name)
    rules = yaml.safe_load(configmap["data"][key[1].replace("\\.", ".")])["rules"]
    # The README's yq turns them into prometheus-adapter's chart values, whose templates/configmap.yaml
    # appends `rules.custom` to the adapter's rules (prometheus-community/helm-charts,
    # charts/prometheus-adapter).
    adapter_values = {"rules": {"custom": rules}}
    assert 'yq \'{"rules": {"custom": .rules}}\'' in README.read_text()
    for rule in adapter_values["rules"]["custom"]:
        assert {"seriesQuery", "resources", "name", "metricsQuery"} <= set(rule)
    served = {rule["name"]["as"] for rule in rules}
    metric = by_kind(render_chart(), "HorizontalPodAutoscaler")[0]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric in served


# -- Ascend nodes -----------------------------------------------------------------------------------


def _pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return dict(deployment["spec"]["template"]["spec"])


def _pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return _pod_spec(by_kind(objects, "Deployment")[0])


def test_ascend_values_require_the_hwhiaiuser_gid() -> None:
    # The device files belong to HwHiAiUser's group, whose gid the driver installer picked per node:
    # a guessed default renders fine and fails at the first NPU open (ACL_ERROR_RT_NO_PERMISSION).
    with pytest.raises(HelmRenderError, match=re.escape("npu.supplementalGroups is required")) as failure:
        render_chart("values-ascend.yaml")
    assert "getent group HwHiAiUser" in str(failure.value)
    pod = _pod(render_chart("values-ascend.yaml", values={"npu": {"supplementalGroups": [1234]}}))
    assert pod["securityContext"]["supplementalGroups"] == [1234]
    for wrong in (1234, ["HwHiAiUser"], [12.5]):
        with pytest.raises(HelmRenderError, match=re.escape("npu.supplementalGroups")):
            render_chart("values-ascend.yaml", values={"npu": {"supplementalGroups": wrong}})
    assert "supplementalGroups" not in _pod(render_chart())["securityContext"]  # CPU nodes: none asked


def test_the_values_reach_helm_as_a_values_file_does(tmp_path: Path) -> None:
    # helm reads -f files and a chart's values.yaml alike (sigs.k8s.io/yaml: every number a float64),
    # --set as int64; the tests hand values over as a file does, so a template fit only for --set fails.
    (tmp_path / "Chart.yaml").write_text("apiVersion: v2\nname: kinds\nversion: 0.1.0\n")
    (tmp_path / "values.yaml").write_text("fromFile: 1000000\n")
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "kinds.yaml").write_text(
        "kinds: {{ kindOf .Values.fromFile }} {{ kindOf .Values.given }}\n"
    )
    rendered = render_templates(tmp_path, {"given": 1000000}, ())
    assert yaml.safe_load(rendered["kinds/templates/kinds.yaml"]) == {"kinds": "float64 float64"}


def test_any_gid_kubernetes_accepts_renders_from_a_values_file() -> None:
    # Directory-service gids often pass a million, which a float64 prints as 1e+06. Kubernetes takes
    # 0..2147483647 (kubernetes/kubernetes pkg/apis/core/validation/validation.go applies
    # staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go IsValidGroupID).
    for gids in ([1000000], [0, 2147483647], [123456789, 1000]):
        node = values_from_yaml(f"npu:\n  supplementalGroups: {json.dumps(gids)}\n")
        deployment = by_kind(render_chart("values-ascend.yaml", values=node), "Deployment")[0]
        assert _pod_spec(deployment)["securityContext"]["supplementalGroups"] == gids
        validate_core(deployment)
    for wrong in ("[-1]", "[2147483648]", "[12.5]", '["1000"]', "[true]", "[null]", "[[1000]]"):
        node = values_from_yaml(f"npu:\n  supplementalGroups: {wrong}\n")
        with pytest.raises(HelmRenderError, match=re.escape("npu.supplementalGroups holds")):
            render_chart("values-ascend.yaml", values=node)


def test_the_readme_ascend_installs_pass_the_gid() -> None:
    installs = [words for words in _chart_installs(README.read_text()) if "values-ascend.yaml" in _files(words)]
    assert installs
    for words in installs:
        groups = _set_values(words).get("npu", {}).get("supplementalGroups")
        assert isinstance(groups, list) and groups, words
        _pod(render_chart(_files(words), values=_set_values(words)))  # renders as written
    assert "getent group HwHiAiUser" in README.read_text()


def test_scheduler_and_runtime_class_are_rendered_only_when_set() -> None:
    pod = _pod(render_installed("values-ascend.yaml"))
    assert "schedulerName" not in pod and "runtimeClassName" not in pod
    chosen = render_chart(
        "values-ascend.yaml",
        values=merged_values(ASCEND_NODE, {"schedulerName": "volcano", "runtimeClassName": "ascend"}),
    )
    pod = _pod(chosen)
    assert (pod["schedulerName"], pod["runtimeClassName"]) == ("volcano", "ascend")
    validate_core(by_kind(chosen, "Deployment")[0])


def test_the_volcano_values_schedule_with_volcano_and_hand_its_npus_to_the_runtime() -> None:
    # MindCluster's Volcano inference examples (gitcode.com/Ascend/mindcluster-deploy,
    # samples/inference/volcano/infer-deploy*.yaml): schedulerName volcano, the ring-controller.atlas
    # pod label, and ASCEND_VISIBLE_DEVICES from the pod annotation named after the NPU resource.
    objects = render_chart(VOLCANO_FILES, values=ASCEND_NODE)
    deployment = by_kind(objects, "Deployment")[0]
    validate_core(deployment)
    pod = _pod(objects)
    assert pod["schedulerName"] == "volcano"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["ring-controller.atlas"].startswith("ascend-")
    assert selects(deployment["spec"]["selector"], labels)  # still the Deployment's own pods
    container = containers_of(deployment)[0]
    npus = [name for name in container["resources"]["limits"] if name.startswith("huawei.com/")]
    visible = next(e for e in container["env"] if e["name"] == "ASCEND_VISIBLE_DEVICES")
    assert visible["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{npus[0]}']"
    assert pod["securityContext"]["supplementalGroups"] == ASCEND_NODE["npu"]["supplementalGroups"]


def test_the_volcano_values_keep_the_users_own_env_given_before_or_after_them() -> None:
    # helm replaces lists wholesale: an `env` in one values file drops the `env` of every file before it.
    ascend, volcano = (yaml.safe_load((CHART / name).read_text()) for name in VOLCANO_FILES)
    mine = merged_values(ASCEND_NODE, {"env": [{"name": "ASCEND_GLOBAL_LOG_LEVEL", "value": "1"}]})
    for layers in ((ascend, mine, volcano), (ascend, volcano, mine)):
        chosen: dict[str, Any] = {}
        for layer in layers:
            chosen = merged_values(chosen, layer)
        deployment = by_kind(render_chart(values=chosen), "Deployment")[0]
        validate_core(deployment)
        env = {entry["name"]: entry for entry in containers_of(deployment)[0]["env"]}
        assert env["ASCEND_GLOBAL_LOG_LEVEL"]["value"] == "1"
        assert env["ASCEND_VISIBLE_DEVICES"]["valueFrom"]["fieldRef"]["fieldPath"].startswith("metadata.annotations[")
    # Two ASCEND_VISIBLE_DEVICES would leave the pod with whichever the kubelet applies last.
    twice = merged_values(mine, {"env": [{"name": "ASCEND_VISIBLE_DEVICES", "value": "0"}]})
    with pytest.raises(HelmRenderError, match=re.escape("ASCEND_VISIBLE_DEVICES")):
        render_chart(VOLCANO_FILES, values=twice)


def test_pod_labels_never_replace_the_selector_labels() -> None:
    with pytest.raises(HelmRenderError, match=re.escape("app.kubernetes.io/instance")):
        render_chart(values={"podLabels": {"app.kubernetes.io/instance": "other"}})


# -- probes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, "values-ascend.yaml"])
def test_probes_give_a_busy_server_more_than_the_default_second(values: str | None) -> None:
    # The health endpoints share the event loop with inference; Kubernetes' default timeoutSeconds (1)
    # fails a liveness probe on a loaded pod and restarts it, which loads the others more.
    container = containers_of(by_kind(render_installed(values), "Deployment")[0])[0]
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        timeout = container[probe].get("timeoutSeconds", 1)
        assert 1 < timeout <= container[probe]["periodSeconds"], (probe, container[probe])
    assert container["livenessProbe"]["timeoutSeconds"] >= container["readinessProbe"]["timeoutSeconds"]


# -- the dashboard ----------------------------------------------------------------------------------

_METRIC = re.compile(r"\b((?:nv|geserve)_[a-z0-9_]+)(\{[^}]*\})?")


def _legend_problems(target: dict[str, Any]) -> list[str]:
    """Why a target's series could share a legend: the labels that tell them apart but are not shown."""
    expr, legend = target["expr"], target.get("legendFormat", "")
    shown = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
    grouped = re.findall(r"\bby\s*\(([^)]*)\)", expr)
    if grouped:
        kept = {label.strip() for group in grouped for label in group.split(",")}
    else:
        # Not aggregated: one series per scraped pod, and per NPU for the device metrics.
        kept = {"pod"} | ({"gpu_uuid"} if "nv_gpu_" in expr else set())
    # namespace is left out: the panel filters by it, and pod names carry the release.
    return sorted(kept - shown - {"namespace"})


def test_the_legend_model_finds_series_sharing_a_legend() -> None:
    assert _legend_problems({"expr": "nv_gpu_utilization", "legendFormat": "{{gpu_uuid}}"}) == ["pod"]
    assert _legend_problems({"expr": "sum by (model) (x)", "legendFormat": "{{model}}"}) == []
    assert _legend_problems({"expr": "sum by (model, reason) (x)", "legendFormat": "{{model}}"}) == ["reason"]


@pytest.mark.parametrize(
    "path", [DEPLOY / "grafana" / "geserve-dashboard.json", CHART / "files" / "geserve-dashboard.json"]
)
def test_every_dashboard_series_has_a_legend_of_its_own_and_honours_the_namespace(path: Any) -> None:
    dashboard = json.loads(path.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            assert not _legend_problems(target), (panel["title"], target, _legend_problems(target))
            for name, matchers in _METRIC.findall(target["expr"]):
                assert 'namespace=~"$namespace"' in matchers, (panel["title"], name)

"""The chart's values as an install meets them: drains and scale-outs, its ServiceAccount and image, the values
schema, and what NOTES.txt tells the installer."""

from __future__ import annotations

import json
import math
import re
import shlex
import tomllib
from typing import Any

import jsonschema
import pytest
import yaml
from helm_python import HelmRenderError, HelmValuesError

from geserve.cli import parse_settings
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
from tests.support import ROOT

Object = dict[str, Any]
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())


def _schema() -> Object:
    return dict(json.loads((CHART / "values.schema.json").read_text()))


def _deployment(objects: list[Object]) -> Object:
    return by_kind(objects, "Deployment")[0]


def _pod_labels(objects: list[Object]) -> dict[str, str]:
    return dict(_deployment(objects)["spec"]["template"]["metadata"]["labels"])


# -- node drains -----------------------------------------------------------------------------------


def disruptions_allowed(budget: Object, expected: int, healthy: int) -> int:
    """The evictions a PodDisruptionBudget allows (kubernetes/kubernetes pkg/controller/disruption/disruption.go
    getExpectedPodCount, updatePdbStatus): with maxUnavailable, `expected - maxUnavailable` pods must stay healthy,
    with minAvailable that many (a percentage of `expected`, rounded up); the rest may go."""
    spec = budget["spec"]

    def scaled(value: int | str) -> int:
        if isinstance(value, str) and value.endswith("%"):
            return math.ceil(int(value[:-1]) * expected / 100)
        return int(value)

    unavailable = spec.get("maxUnavailable")
    desired = expected - scaled(unavailable) if unavailable is not None else scaled(spec["minAvailable"])
    return max(0, healthy - desired)


def test_a_node_drain_evicts_one_pod_at_a_time_and_never_blocks() -> None:
    for apis in (MONITORING_APIS, ()):
        objects = render_chart(api_versions=apis)
        budgets = by_kind(objects, "PodDisruptionBudget")
        assert len(budgets) == 1, apis
        budget = budgets[0]
        validate_core(budget)
        assert selects(budget["spec"]["selector"], _pod_labels(objects))
        hpa = by_kind(objects, "HorizontalPodAutoscaler")
        expected = hpa[0]["spec"]["minReplicas"] if hpa else _deployment(objects)["spec"]["replicas"]
        assert expected > 1
        assert disruptions_allowed(budget, expected, healthy=expected) == 1  # the drain goes on, a pod at a time
        assert disruptions_allowed(budget, expected, healthy=expected - 1) == 0  # ... once the last one is back
        # A pod that never turned ready (a model that does not load) must not hold a node drain up for ever.
        assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_the_budget_renders_only_where_more_than_one_pod_runs() -> None:
    assert by_kind(render_installed("values-ascend.yaml"), "PodDisruptionBudget") == []  # one replica
    one = {"replicaCount": 1, "autoscaling": {"minReplicas": 1}}
    assert by_kind(render_chart(values=one), "PodDisruptionBudget") == []
    # Where the HPA renders it owns the count, and its minimum is what runs at the least.
    assert by_kind(render_chart(values={"autoscaling": {"minReplicas": 1}}), "PodDisruptionBudget") == []
    assert by_kind(render_chart(api_versions=(), values={"autoscaling": {"minReplicas": 1}}), "PodDisruptionBudget")
    assert by_kind(render_chart(values={"podDisruptionBudget": {"enabled": False}}), "PodDisruptionBudget") == []
    forced = by_kind(render_chart(values=one | {"podDisruptionBudget": {"enabled": True}}), "PodDisruptionBudget")
    assert forced and forced[0]["spec"]["maxUnavailable"] == 1
    kept = render_chart(values={"podDisruptionBudget": {"minAvailable": "50%"}})
    budget = by_kind(kept, "PodDisruptionBudget")[0]
    assert budget["spec"]["minAvailable"] == "50%" and "maxUnavailable" not in budget["spec"]
    validate_core(budget)
    assert disruptions_allowed(budget, 4, healthy=4) == 2
    with pytest.raises(HelmRenderError, match=re.escape('podDisruptionBudget.enabled is "ture"')):
        render_chart(values={"podDisruptionBudget": {"enabled": "ture"}})


def test_the_pods_spread_over_nodes_and_the_spread_can_be_changed() -> None:
    objects = render_chart()
    pod = _deployment(objects)["spec"]["template"]["spec"]
    [spread] = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # a preference: too few nodes still schedule
    assert selects(spread["labelSelector"], _pod_labels(objects))
    assert spread["matchLabelKeys"] == ["pod-template-hash"]  # a rollout's new pods spread among themselves
    strict = render_chart(values={"topologySpread": {"whenUnsatisfiable": "DoNotSchedule"}})
    assert _deployment(strict)["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["whenUnsatisfiable"] == (
        "DoNotSchedule"
    )
    zones = [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "geserve"}},
        }
    ]
    mine = render_chart(values={"topologySpread": {"enabled": False}, "topologySpreadConstraints": zones})
    assert _deployment(mine)["spec"]["template"]["spec"]["topologySpreadConstraints"] == zones
    for document in (_deployment(objects), _deployment(strict), _deployment(mine)):
        validate_core(document)
    none = render_chart(values={"topologySpread": {"enabled": False}})
    assert "topologySpreadConstraints" not in _deployment(none)["spec"]["template"]["spec"]


# -- gRPC rebalancing ------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, "values-ascend.yaml"])
def test_grpc_connections_age_out_so_new_pods_get_clients(values: str | None) -> None:
    """A gRPC client keeps its connection, and the Service balances connections: without an age, pods the HPA adds
    serve only new clients. geserve sends GOAWAY after the age (grpc.max_connection_age_ms) and lets calls finish
    within the grace; both flags take milliseconds."""
    options = parse_settings(containers_of(_deployment(render_installed(values)))[0]["args"])
    age, grace = options.grpc.max_connection_age_ms, options.grpc.max_connection_age_grace_ms
    assert 60_000 <= age <= 600_000, age  # minutes, so that a scale-out is felt soon and reconnects stay rare
    assert 0 < grace < age
    channel = dict(options.grpc.channel_options())
    assert channel["grpc.max_connection_age_ms"] == age and channel["grpc.max_connection_age_grace_ms"] == grace
    off = containers_of(_deployment(render_chart(values={"grpc": {"maxConnectionAgeMs": 0}})))[0]["args"]
    assert not [arg for arg in off if arg.startswith("--grpc-max-connection-age")]


# -- service account and image ---------------------------------------------------------------------


def test_the_pods_run_as_a_service_account_without_a_token() -> None:
    for values in (None, "values-ascend.yaml"):
        objects = render_installed(values)
        [account] = by_kind(objects, "ServiceAccount")
        validate_core(account)
        assert account["automountServiceAccountToken"] is False
        pod = _deployment(objects)["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == account["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False  # whatever the account says
    theirs = render_chart(values={"serviceAccount": {"create": False, "name": "models-reader"}})
    assert by_kind(theirs, "ServiceAccount") == []
    pod = _deployment(theirs)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "models-reader" and pod["automountServiceAccountToken"] is False
    named = render_chart(
        values={"serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/r"}}}
    )
    assert by_kind(named, "ServiceAccount")[0]["metadata"]["annotations"]


def _readme_image_tags() -> dict[str, str]:
    """Dockerfile -> the tag deploy/README.md's `docker build` gives its image."""
    tags = {}
    text = (DEPLOY / "README.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["docker", "build"]:
                tags[words[words.index("-f") + 1].rpartition("/")[2]] = words[words.index("-t") + 1]
    return tags


def test_the_image_tag_defaults_to_the_release_the_chart_belongs_to() -> None:
    version = CHART_META["appVersion"]
    assert version == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    cpu = containers_of(_deployment(render_installed(None)))[0]["image"]
    ascend = containers_of(_deployment(render_installed("values-ascend.yaml")))[0]["image"]
    assert cpu == f"registry.example.com/geserve:{version}"
    assert ascend == f"registry.example.com/geserve:{version}-ascend"
    # The README builds the images under exactly those tags.
    assert _readme_image_tags() == {"Dockerfile.cpu": cpu, "Dockerfile.ascend": ascend}
    # ... and the KServe manifests run them.
    for path in sorted((DEPLOY / "kserve").glob("*.yaml")):
        for image in re.findall(r"image: (\S*geserve\S*)", path.read_text()):
            assert image in (cpu, ascend), f"{path.name}: {image}"
    pinned = render_chart("values-ascend.yaml", values=merged_values(ASCEND_NODE, {"image": {"tag": "canary"}}))
    assert containers_of(_deployment(pinned))[0]["image"] == "registry.example.com/geserve:canary"


# -- the values schema -----------------------------------------------------------------------------


def _shipped_values() -> list[Object]:
    """The values an install gets from the chart's files: values.yaml alone, and under each other file."""
    base = yaml.safe_load((CHART / "values.yaml").read_text())
    ascend = yaml.safe_load((CHART / "values-ascend.yaml").read_text())
    volcano = yaml.safe_load((CHART / "values-ascend-volcano.yaml").read_text())
    return [
        base,
        merged_values(merged_values(base, ascend), ASCEND_NODE),
        merged_values(merged_values(merged_values(base, ascend), volcano), ASCEND_NODE),
    ]


def test_the_schema_takes_the_shipped_values_and_names_every_key() -> None:
    validator = jsonschema.Draft7Validator(_schema())
    for values in _shipped_values():
        validator.validate(values)
    declared = set().union(*(values.keys() for values in _shipped_values()))
    assert set(_schema()["properties"]) == declared | {"global"}  # global: what a parent chart passes down


@pytest.mark.parametrize(
    "wrong",
    [
        {"replicaCont": 3},
        {"image": {"tga": "v1"}},
        {"podDisruptionBudget": {"maxUnavailabe": 1}},
        {"topologySpread": {"whenUnsatisfiable": "ScheduleAnyWay"}},
        {"grpc": {"maxConnectionAge": 300000}},
        {"metrics": {"serviceMonitor": {"label": {"release": "kube-prometheus-stack"}}}},
    ],
)
def test_a_misspelt_value_is_refused_rather_than_ignored(wrong: Object) -> None:
    # helm ignores a value no template reads: the install would quietly run without what was meant.
    assert not jsonschema.Draft7Validator(_schema()).is_valid(merged_values(_shipped_values()[0], wrong))
    with pytest.raises(HelmValuesError, match="schema"):
        render_chart(values=wrong)


@pytest.mark.parametrize("kind", ["serviceMonitor", "prometheusRule"])
def test_an_empty_release_label_is_refused_where_the_monitor_may_render(kind: str) -> None:
    """`--set metrics.serviceMonitor.labels.release=$RELEASE` with RELEASE unset gives an empty label, which no
    kube-prometheus-stack selects: the object renders and is never picked up."""
    for enabled in (True, "auto"):
        with pytest.raises(HelmValuesError, match="release"):
            render_chart(values={"metrics": {kind: {"enabled": enabled, "labels": {"release": ""}}}})
    off = render_chart(values={"metrics": {kind: {"enabled": False, "labels": {"release": ""}}}})
    assert not by_kind(off, {"serviceMonitor": "ServiceMonitor", "prometheusRule": "PrometheusRule"}[kind])
    labelled = render_chart(values={"metrics": {kind: {"labels": {"release": "kube-prometheus-stack"}}}})
    assert labelled


# -- NOTES.txt -------------------------------------------------------------------------------------


def _notes(values: Object | None = None, apis: tuple[str, ...] = MONITORING_APIS) -> str:
    return render_templates(CHART, values or {}, apis)["geserve/templates/NOTES.txt"]


def test_the_notes_say_what_will_not_be_scraped_and_why() -> None:
    plain = _notes(apis=())
    assert "NOT SCRAPED: no ServiceMonitor" in plain and "monitoring.coreos.com/v1 ServiceMonitor" in plain
    assert "NO RULES" in plain and "NO AUTOSCALING" in plain
    off = _notes({"metrics": {"serviceMonitor": {"enabled": False}}})
    assert "metrics.serviceMonitor.enabled is false" in off
    unlabelled = _notes()
    assert "MAYBE NOT SCRAPED" in unlabelled and "metrics.serviceMonitor.labels.release" in unlabelled
    assert "MAYBE NO RULES" in unlabelled and "NO AUTOSCALING" not in unlabelled
    release = {"labels": {"release": "kube-prometheus-stack"}}
    labelled = _notes({"metrics": {"serviceMonitor": release, "prometheusRule": release}})
    assert "SCRAPED" not in labelled and "RULES" not in labelled and "AUTOSCALING" not in labelled
    assert labelled.startswith("geserve serves KServe v2")

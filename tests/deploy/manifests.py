"""Loading deploy/: the rendered Helm chart, the KServe manifests, and the CRD schemas to check them."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from tests.support import ROOT

DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "geserve"
CRDS = ROOT.parent / "shared" / "crds"
KUBERNETES_VERSION = "1.33.0"  # pinned: kubernetes-validate ships schemas per version


# The APIs a cluster with the Prometheus Operator and prometheus-adapter serves beyond the built-in ones.
MONITORING_APIS = (
    "monitoring.coreos.com/v1",
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
    "custom.metrics.k8s.io/v1beta1",
)


# What an Ascend install passes besides values-ascend.yaml: the gid of its nodes' HwHiAiUser group.
ASCEND_NODE: dict[str, Any] = {"npu": {"supplementalGroups": [1000]}}


def merged_values(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base` as helm layers -f files and --set: maps merge, anything else replaces."""
    result = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged_values(result[key], value)
        else:
            result[key] = value
    return result


def render_chart(
    values_file: str | tuple[str, ...] | None = None,
    api_versions: tuple[str, ...] = MONITORING_APIS,
    values: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Every object the chart renders with its defaults (or values files of the chart, in order, then
    values on top, as `helm -f ... --set ...`), on a cluster serving `api_versions` besides the built-in
    APIs (the Prometheus Operator's by default)."""
    files = (values_file,) if isinstance(values_file, str) else values_file or ()
    chosen: dict[str, Any] = {}
    for name in files:
        chosen = merged_values(chosen, yaml.safe_load((CHART / name).read_text()))
    chosen = merged_values(chosen, values or {})
    rendered = render_templates(CHART, chosen, api_versions)
    objects = []
    for name, text in sorted(rendered.items()):
        if name.endswith(".yaml"):
            objects += [document for document in yaml.safe_load_all(text) if document]
    return objects


def render_templates(chart: Path, values: dict[str, Any], api_versions: tuple[str, ...]) -> dict[str, str]:
    """Template path -> text of the chart at `chart` rendered offline with `values`. The values reach
    helm as JSON, which it decodes as it decodes a `-f` file: every number a float64."""
    import helm_python as helm
    from helm_python import _native

    # helm's own `--api-versions`; the Python wrapper does not expose it, its native call does.
    options = {"name": "geserve", "namespace": "serving", "kube_version": KUBERNETES_VERSION}
    options["api_versions"] = list(api_versions)  # type: ignore[assignment]
    loaded = helm.Chart.load(chart)
    given = json.dumps(values) if values else None
    rendered: dict[str, str] = json.loads(_native.call_string("helm_render", loaded._raw(), given, json.dumps(options)))
    return rendered


def render_installed(
    values_file: str | None = None, api_versions: tuple[str, ...] = MONITORING_APIS
) -> list[dict[str, Any]]:
    """The chart as an install with one of its values files renders it: values-ascend.yaml with the
    nodes' HwHiAiUser gid, which every Ascend install must pass."""
    node = ASCEND_NODE if values_file == "values-ascend.yaml" else None
    return render_chart(values_file, api_versions=api_versions, values=node)


def kserve_objects() -> list[dict[str, Any]]:
    objects = []
    for path in sorted((DEPLOY / "kserve").glob("*.yaml")):
        objects += [document for document in yaml.safe_load_all(path.read_text()) if document]
    return objects


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema of every CRD in ../shared/crds; read once (megabytes of YAML), so
    callers must not change what it returns."""
    schemas = {}
    for path in sorted(CRDS.glob("*/*.yaml")):
        crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            # Go regexps allow "^(?i)..."; Python wants inline flags first.
            text = json.dumps(version["schema"]["openAPIV3Schema"]).replace('"^(?i)', '"(?i)^')
            schemas[(f"{group}/{version['name']}", kind)] = json.loads(text)
    return schemas


def unknown_fields(instance: Any, schema: dict[str, Any], path: str = "") -> Iterator[str]:
    """Fields the API server would drop as unknown: what a schema check alone lets through (typos)."""
    if isinstance(instance, dict) and schema.get("type") == "object":
        properties = schema.get("properties")
        open_ended = schema.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in schema
        for key, value in instance.items():
            if properties is not None and key in properties:
                yield from unknown_fields(value, properties[key], f"{path}.{key}")
            elif properties is not None and not open_ended:
                yield f"{path}.{key}"
            elif isinstance(schema.get("additionalProperties"), dict):
                yield from unknown_fields(value, schema["additionalProperties"], f"{path}.{key}")
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(instance):
            yield from unknown_fields(item, schema["items"], f"{path}[{index}]")


def validate_custom(document: dict[str, Any], schemas: dict[tuple[str, str], dict[str, Any]]) -> None:
    schema = schemas[(document["apiVersion"], document["kind"])]
    jsonschema.Draft7Validator(schema).validate(document)
    unknown = list(unknown_fields(document, schema))
    assert not unknown, f"{document['kind']} {document['metadata']['name']} has unknown fields {unknown}"


def validate_core(document: dict[str, Any]) -> None:
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def containers_of(document: dict[str, Any]) -> list[dict[str, Any]]:
    spec = document["spec"]
    if document["kind"] == "Deployment":
        return list(spec["template"]["spec"]["containers"])
    if document["kind"] in ("ClusterServingRuntime", "ServingRuntime"):
        return list(spec["containers"])
    return []


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [document for document in objects if document["kind"] == kind]

"""The Prometheus Operator's PodMonitor mirrored offline: the targets Prometheus scrapes for the pods it selects."""

from __future__ import annotations

import re
from typing import Any

Object = dict[str, Any]
Labels = dict[str, str]


def _sanitize(name: str) -> str:
    """A Kubernetes label name as Prometheus' discovery spells it in a meta label (strutil.SanitizeLabelName)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pod_targets(labels: Labels, pod: Object, pod_ip: str, namespace: str = "serving") -> list[Labels]:
    """What Prometheus' Kubernetes discovery makes of a running pod with the `pod` role: one target per declared
    port of each container, and one port-free target (the bare pod IP) per container that declares none, init
    containers included and so marked (prometheus/prometheus discovery/kubernetes/pod.go buildPod)."""
    base = {"__meta_kubernetes_namespace": namespace, "__meta_kubernetes_pod_name": "pod-0"}
    base["__meta_kubernetes_pod_ip"] = pod_ip
    base["__meta_kubernetes_pod_phase"] = "Running"
    for key, value in labels.items():
        base[f"__meta_kubernetes_pod_label_{_sanitize(key)}"] = value
        base[f"__meta_kubernetes_pod_labelpresent_{_sanitize(key)}"] = "true"
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    targets = []
    for init, containers in ((False, pod.get("containers", [])), (True, pod.get("initContainers", []))):
        for container in containers:
            meta = base | {
                "__meta_kubernetes_pod_container_name": container["name"],
                "__meta_kubernetes_pod_container_init": str(init).lower(),
            }
            ports = container.get("ports") or []
            if not ports:
                targets.append(meta | {"__address__": pod_ip})
            for port in ports:
                targets.append(
                    meta
                    | {
                        "__address__": f"{host}:{port['containerPort']}",
                        "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                        "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                    }
                )
    return targets


def relabel(labels: Labels, rules: list[Object]) -> Labels | None:
    """Prometheus' relabelling (model/relabel/relabel.go) with the actions a PodMonitor's rules use here: keep, drop
    and replace, the regex anchored at both ends, source values joined by ';', `$1` and `${1}` in the replacement.
    None where the target is dropped."""
    result = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace").lower()
        sources = rule.get("source_labels", rule.get("sourceLabels", []))
        value = rule.get("separator", ";").join(result.get(name, "") for name in sources)
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if action == "keep" and match is None:
            return None
        if action == "drop" and match is not None:
            return None
        if action == "replace" and match is not None:
            target = rule.get("target_label", rule.get("targetLabel"))
            replacement = re.sub(r"\$\{?(\d+)\}?", r"\\\1", rule.get("replacement", "$1"))
            result[target] = match.expand(replacement)
        elif action not in ("keep", "drop", "replace"):
            raise NotImplementedError(action)
    return result


def pod_monitor_rules(monitor: Object, endpoint: Object) -> list[Object]:
    """The relabelling the Prometheus Operator writes for one podMetricsEndpoint of a PodMonitor, in order: the
    running filter, the selector as keep rules, the port filter, the namespace, container and pod labels, the job,
    the endpoint label, then the endpoint's own relabelings (prometheus-operator/prometheus-operator
    pkg/prometheus/promcfg.go generatePodMonitorConfig, generateRunningFilter)."""
    name = f"{monitor['metadata'].get('namespace', 'monitoring')}/{monitor['metadata']['name']}"
    rules: list[Object] = []
    if endpoint.get("filterRunning", True):
        rules.append(
            {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"}
        )
    selector = monitor["spec"]["selector"]
    for key, value in sorted(selector.get("matchLabels", {}).items()):
        sources = [
            f"__meta_kubernetes_pod_label_{_sanitize(key)}",
            f"__meta_kubernetes_pod_labelpresent_{_sanitize(key)}",
        ]
        rules.append({"action": "keep", "source_labels": sources, "regex": f"({value});true"})
    for expression in selector.get("matchExpressions", []):
        key, operator = _sanitize(expression["key"]), expression["operator"]
        values = "|".join(expression.get("values", []))
        if operator in ("In", "NotIn"):
            sources = [f"__meta_kubernetes_pod_label_{key}", f"__meta_kubernetes_pod_labelpresent_{key}"]
            action = "keep" if operator == "In" else "drop"
            rules.append({"action": action, "source_labels": sources, "regex": f"({values});true"})
        else:
            action = "keep" if operator == "Exists" else "drop"
            rules.append(
                {"action": action, "source_labels": [f"__meta_kubernetes_pod_labelpresent_{key}"], "regex": "true"}
            )
    if endpoint.get("port"):
        rules.append(
            {
                "action": "keep",
                "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                "regex": endpoint["port"],
            }
        )
    elif endpoint.get("portNumber"):
        number = str(endpoint["portNumber"])
        rules.append(
            {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_number"], "regex": number}
        )
    elif endpoint.get("targetPort") is not None:
        raise NotImplementedError("targetPort is deprecated: use port or portNumber")
    rules += [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": name},
    ]
    if endpoint.get("port"):
        rules.append({"target_label": "endpoint", "replacement": endpoint["port"]})
    rules += endpoint.get("relabelings", [])
    return rules


def pod_monitor_scrapes(monitor: Object, targets: list[Labels]) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """What Prometheus scrapes of the discovered `targets` of one pod: the URL and the labels of every target the
    PodMonitor's endpoints keep, once per label set (after relabelling the labels starting with `__` are dropped,
    and targets left with the same labels are one: prometheus/prometheus scrape/target.go, scrape/scrape.go sync)."""
    scraped = set()
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        rules = pod_monitor_rules(monitor, endpoint)
        for target in targets:
            labels = relabel(target, rules)
            if labels is None:
                continue
            url = f"{endpoint.get('scheme', 'http')}://{labels['__address__']}{endpoint.get('path', '/metrics')}"
            public = tuple(sorted((key, value) for key, value in labels.items() if not key.startswith("__")))
            scraped.add((url, (("instance", labels["__address__"]), *public)))
    return scraped


def selects(selector: Object | None, labels: Labels) -> bool:
    """A Kubernetes LabelSelector: {} selects everything; matchLabels and matchExpressions all hold."""
    if selector is None:
        return False
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        holds = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not holds:
            return False
    return True

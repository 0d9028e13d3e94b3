"""KServe's and Knative's rules mirrored offline: the predictor pod KServe builds, and what Knative accepts of it."""

from __future__ import annotations

import copy
import re
from decimal import Decimal
from typing import Any

Object = dict[str, Any]

# corev1.Container's fields (k8s.io/api/core/v1 types.go): what KServe marshals of `spec.predictor.model`,
# whose other keys (modelFormat, runtime, storageUri, ...) belong to the ModelSpec around it.
CONTAINER_FIELDS = frozenset(
    {
        "name", "image", "command", "args", "workingDir", "ports", "envFrom", "env", "resources",
        "resizePolicy", "restartPolicy", "restartPolicyRules", "volumeMounts", "volumeDevices", "livenessProbe",
        "readinessProbe", "startupProbe", "lifecycle", "terminationMessagePath", "terminationMessagePolicy",
        "imagePullPolicy", "securityContext", "stdin", "stdinOnce", "tty",
    }
)  # fmt: skip
# corev1.PodSpec's fields: the part of `spec.predictor` (a v1beta1.PodSpec inlined beside the component
# extension fields such as minReplicas) that reaches the pod.
POD_FIELDS = frozenset(
    {
        "volumes", "initContainers", "containers", "ephemeralContainers", "restartPolicy",
        "terminationGracePeriodSeconds", "activeDeadlineSeconds", "dnsPolicy", "nodeSelector",
        "serviceAccountName", "serviceAccount", "automountServiceAccountToken", "nodeName", "hostNetwork",
        "hostPID", "hostIPC", "shareProcessNamespace", "securityContext", "imagePullSecrets", "hostname",
        "subdomain", "affinity", "schedulerName", "tolerations", "hostAliases", "priorityClassName", "priority",
        "dnsConfig", "readinessGates", "runtimeClassName", "enableServiceLinks", "preemptionPolicy", "overhead",
        "topologySpreadConstraints", "setHostnameAsFQDN", "os", "hostUsers", "schedulingGates", "resourceClaims",
    }
)  # fmt: skip
# The lists a strategic merge patch merges element by element, by these keys (the patchMergeKey tags in
# k8s.io/api/core/v1 types.go); every other list is replaced by the patch's.
MERGE_KEYS = {
    "ports": "containerPort",
    "env": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "volumes": "name",
    "containers": "name",
    "initContainers": "name",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
}
# The runtime's pod-level fields KServe's MergePodSpec carries over
# (kserve/kserve pkg/controller/v1beta1/inferenceservice/utils/utils.go).
RUNTIME_POD_FIELDS = ("nodeSelector", "affinity", "tolerations", "volumes", "imagePullSecrets")
RUNTIME_CONTAINER = "kserve-container"  # constants.InferenceServiceContainerName

DEPLOYMENT_MODE = "serving.kserve.io/deploymentMode"
RAW, SERVERLESS = "raw", "serverless"
# KServe 0.16 renamed RawDeployment to Standard and Serverless to Knative and still reads the old names
# (kserve/kserve pkg/constants/constants.go, GetDeploymentMode in .../inferenceservice/utils/utils.go).
MODES = {"RawDeployment": RAW, "Standard": RAW, "Serverless": SERVERLESS, "Knative": SERVERLESS}

KNATIVE_DEFAULT_USER_PORT = 8080  # knative.dev/serving pkg/apis/serving/v1 DefaultUserPort
# Ports the queue-proxy and Knative's own listeners hold (knative/serving pkg/apis/serving/k8s_validation.go
# reservedPorts): backend HTTP, backend HTTP/2, queue admin, the two metrics ports and profiling.
KNATIVE_RESERVED_PORTS = frozenset({8012, 8013, 8022, 9090, 9091, 8008})
KNATIVE_PORT_NAMES = frozenset({"", "http1", "h2c"})  # k8s_validation.go validPortNames
# Pod fields Knative takes without a feature flag (knative/serving pkg/apis/serving/fieldmask.go PodSpecMask);
# the others are either behind a config-features flag, named here, that is off by default
# (pkg/apis/config/features.go defaultFeaturesConfig), or never allowed.
KNATIVE_POD_FIELDS = frozenset(
    {"serviceAccountName", "containers", "volumes", "imagePullSecrets", "enableServiceLinks"}
)
KNATIVE_POD_FLAGS = {
    "affinity": "kubernetes.podspec-affinity",
    "hostAliases": "kubernetes.podspec-hostaliases",
    "nodeSelector": "kubernetes.podspec-nodeselector",
    "runtimeClassName": "kubernetes.podspec-runtimeclassname",
    "tolerations": "kubernetes.podspec-tolerations",
    "securityContext": "kubernetes.podspec-securitycontext",
    "priorityClassName": "kubernetes.podspec-priorityclassname",
    "schedulerName": "kubernetes.podspec-schedulername",
    "initContainers": "kubernetes.podspec-init-containers",
    "topologySpreadConstraints": "kubernetes.podspec-topologyspreadconstraints",
    "dnsPolicy": "kubernetes.podspec-dnspolicy",
    "dnsConfig": "kubernetes.podspec-dnsconfig",
}
# Volume sources: secret, configMap and projected always; emptyDir behind a flag that is on by default.
KNATIVE_VOLUME_SOURCES = frozenset({"secret", "configMap", "projected", "emptyDir"})
KNATIVE_VOLUME_FLAGS = {
    "hostPath": "kubernetes.podspec-volumes-hostpath",
    "persistentVolumeClaim": "kubernetes.podspec-persistent-volume-claim",
    "csi": "kubernetes.podspec-volumes-csi",
}
# Container fields Knative's ContainerMask never takes: the queue-proxy owns the preStop hook.
KNATIVE_CONTAINER_DISALLOWED = frozenset({"lifecycle", "stdin", "stdinOnce", "tty", "volumeDevices"})
KUBERNETES_DEFAULT_GRACE_SECONDS = 30  # k8s.io/api/core/v1 DefaultTerminationGracePeriodSeconds


def strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    """`patch` over `base` as k8s.io/apimachinery strategicpatch.StrategicMergePatch merges two objects whose
    empty fields were left out (Go's omitempty): maps recursively, keyed lists element by element (the
    base's order, then the patch's new elements), other lists and scalars replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for name, value in patch.items():
            merged[name] = strategic_merge(base[name], value, name) if name in base else copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        merge_key = MERGE_KEYS[key]
        result = [copy.deepcopy(item) for item in base]
        for item in patch:
            found = next((i for i, old in enumerate(result) if old.get(merge_key) == item.get(merge_key)), None)
            if found is None:
                result.append(copy.deepcopy(item))
            else:
                result[found] = strategic_merge(result[found], item)
        return result
    return copy.deepcopy(patch)


def merge_runtime_container(runtime_container: Object, isvc_container: Object) -> Object:
    """KServe's MergeRuntimeContainers (kserve/kserve pkg/controller/v1beta1/inferenceservice/utils/utils.go):
    a strategic merge patch of the InferenceService's container over the runtime's, the runtime's name kept
    where the patch has none, and the args of both concatenated rather than replaced."""
    merged = strategic_merge(runtime_container, isvc_container)
    merged["name"] = merged.get("name") or runtime_container["name"]
    args = [*runtime_container.get("args", []), *isvc_container.get("args", [])]
    if args:
        merged["args"] = args
    return dict(merged)


def predictor_pod(runtime: Object, isvc: Object) -> Object:
    """The predictor's pod spec as KServe's buildPodSpec makes it for `spec.predictor.model`
    (kserve/kserve pkg/controller/v1beta1/inferenceservice/components/predictor.go): the runtime's
    kserve-container merged with the model's container, the pod fields merged by MergePodSpec."""
    predictor = isvc["spec"]["predictor"]
    model = predictor["model"]
    containers = runtime["spec"]["containers"]
    runtime_container = next((c for c in containers if c["name"] == RUNTIME_CONTAINER), None)
    assert runtime_container is not None, f"{runtime['metadata']['name']} has no {RUNTIME_CONTAINER} container"
    isvc_container = {key: value for key, value in model.items() if key in CONTAINER_FIELDS}
    runtime_pod = {key: runtime["spec"][key] for key in RUNTIME_POD_FIELDS if key in runtime["spec"]}
    isvc_pod = {key: value for key, value in predictor.items() if key in POD_FIELDS}
    pod: Object = strategic_merge(runtime_pod, isvc_pod)
    pod["containers"] = [merge_runtime_container(runtime_container, isvc_container)]
    pod["containers"] += [c for c in containers if c["name"] != RUNTIME_CONTAINER]
    return pod


def deployment_modes(isvc: Object) -> tuple[str, ...]:
    """The modes an InferenceService may run in: the one its annotation names, else either, since the
    default is the cluster's (inferenceservice-config's deploy.defaultDeploymentMode)."""
    annotations = isvc["metadata"].get("annotations", {})
    if DEPLOYMENT_MODE not in annotations:
        return (SERVERLESS, RAW)
    value = annotations[DEPLOYMENT_MODE]
    # KServe silently falls back to the cluster's default for a value it does not know.
    assert value in MODES, f"{isvc['metadata']['name']}: unknown {DEPLOYMENT_MODE} {value!r}"
    return (MODES[value],)


def serving_port(container: Object) -> tuple[int, str]:
    """The port traffic reaches and its name: the container's first port, else 8080 unnamed. Knative's
    getUserPort (knative/serving pkg/reconciler/revision/resources/deploy.go) and KServe's raw-mode Service
    (kserve/kserve .../reconcilers/service/service_reconciler.go createDefaultSvc) agree on it."""
    ports = container.get("ports") or []
    if not ports:
        return KNATIVE_DEFAULT_USER_PORT, ""
    return int(ports[0]["containerPort"]), str(ports[0].get("name", ""))


def knative_violations(pod: Object) -> list[str]:
    """What Knative's webhook rejects in a Knative Service with this pod spec and default config-features
    (knative/serving pkg/apis/serving/k8s_validation.go ValidatePodSpec, fieldmask.go)."""
    problems = []
    for field in pod:
        if field not in KNATIVE_POD_FIELDS:
            flag = KNATIVE_POD_FLAGS.get(field)
            problems.append(f"{field} needs {flag}" if flag else f"{field} is not allowed")
    for volume in pod.get("volumes", []):
        for source in set(volume) - {"name"} - KNATIVE_VOLUME_SOURCES:
            flag = KNATIVE_VOLUME_FLAGS.get(source)
            problems.append(f"volume {volume['name']}: {source} needs {flag}" if flag else f"{source} volume")
    ports = [port for container in pod["containers"] for port in container.get("ports", [])]
    if len(ports) > 1:  # validateContainersPorts
        problems.append(f"{len(ports)} container ports: only a single port is allowed across all containers")
    for port in ports[:1]:  # validateContainerPorts checks the user port
        if port.get("name", "") not in KNATIVE_PORT_NAMES:
            problems.append(f"port name {port['name']!r} is not allowed (empty, http1 or h2c)")
        if port.get("protocol", "TCP") != "TCP":
            problems.append(f"port protocol {port['protocol']}")
        if port["containerPort"] in KNATIVE_RESERVED_PORTS:
            problems.append(f"port {port['containerPort']} is reserved")
    for container in pod["containers"]:
        for field in KNATIVE_CONTAINER_DISALLOWED & set(container):
            problems.append(f"container {container['name']}: {field} is not allowed")
        port_name = serving_port(container)[1] or "http"  # validateContainersPorts names an unnamed port "http"
        for probe_name in ("livenessProbe", "readinessProbe"):  # validateProbe
            probe = container.get(probe_name, {})
            for handler in ("httpGet", "tcpSocket"):
                port = probe.get(handler, {}).get("port")
                if isinstance(port, str) and port != port_name:
                    problems.append(f"{probe_name}.{handler}.port {port!r} must match the container port")
    return problems


def knative_release_for_probes(container: Object) -> tuple[int, int]:
    """The oldest Knative release whose webhook admits the probe ports of this serving container. Before 1.1 a
    readiness or liveness probe could name no port at all; 1.1 accepts the serving port only (knative/serving
    #12225); 1.3 accepts any other (#12606, pkg/apis/serving/k8s_validation.go validateProbe)."""
    user_port = serving_port(container)[0]
    needed = (1, 0)
    for probe_name in ("livenessProbe", "readinessProbe"):
        for handler in ("httpGet", "tcpSocket"):
            port = container.get(probe_name, {}).get(handler, {}).get("port")
            if port is not None:
                needed = max(needed, (1, 1) if port == user_port else (1, 3))
    return needed


def http_probe_ports(container: Object, mode: str) -> dict[str, int]:
    """The port each HTTP probe of the serving container is actually sent to. Raw mode: as written (kubelet).
    Knative: the queue-proxy sends the readiness probe to its explicit port, else to the user port
    (.../revision/resources/queue.go makeQueueContainer); the liveness probe goes to the user port
    (deploy.go rewriteUserProbe); kubelet runs the startup probe as written."""
    user_port = serving_port(container)[0]
    sent = {}
    for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
        http_get = container.get(probe_name, {}).get("httpGet")
        if http_get is None:
            continue
        port = http_get.get("port")
        if mode == SERVERLESS and (probe_name == "livenessProbe" or (probe_name == "readinessProbe" and not port)):
            port = user_port
        assert isinstance(port, int), f"{probe_name} names port {port!r}: give the number geserve listens on"
        sent[probe_name] = port
    return sent


def pre_stop_seconds(container: Object) -> int:
    """How long the container's preStop hook holds SIGTERM back: `sleep N`, or nothing."""
    pre_stop = container.get("lifecycle", {}).get("preStop")
    if pre_stop is None:
        return 0
    command = pre_stop.get("exec", {}).get("command", [])
    assert len(command) == 2 and command[0] == "sleep", f"preStop {pre_stop} is not a `sleep N`"
    return int(command[1])


_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")
_FACTORS = {
    None: Decimal(1), "m": Decimal("0.001"), "k": Decimal(10) ** 3, "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9, "T": Decimal(10) ** 12, "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}  # fmt: skip


def quantity(text: str | int) -> Decimal:
    """A Kubernetes resource quantity (k8s.io/apimachinery resource.Quantity) as a number."""
    match = _QUANTITY.match(str(text))
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    return Decimal(match.group(1)) * _FACTORS[match.group(2)]


# KServe's own ClusterServingRuntimes, as its chart installs them (kserve/kserve charts/kserve-resources/templates/
# clusterservingruntimes.yaml, from config/runtimes/kserve-*.yaml), ModelMesh's Triton runtime (.../templates/
# modelmesh/clusterservingruntimes.yaml), and kserve-openvino (config/runtimes/kserve-openvino.yaml, which the
# kustomization beside it leaves out: installed by hand, `kubectl apply -f`): the fields runtime selection and the
# runtime webhook read. Each format is (name, version, autoSelect, priority); a version of None is left unset.
def _runtime(
    protocols: list[str], formats: list[tuple[str, str | None, bool, int | None]], multi: bool = False
) -> Object:
    entries = []
    for name, version, auto_select, priority in formats:
        entry: Object = {"name": name}
        if version is not None:
            entry["version"] = version
        if auto_select:
            entry["autoSelect"] = True
        if priority is not None:
            entry["priority"] = priority
        entries.append(entry)
    return {"protocolVersions": protocols, "multiModel": multi, "supportedModelFormats": entries}


KSERVE_RUNTIMES: dict[str, Object] = {
    "kserve-tritonserver": _runtime(
        ["v2", "grpc-v2"],
        [
            ("tensorrt", "8", True, 1), ("tensorflow", "1", True, 1), ("tensorflow", "2", True, 1),
            ("onnx", "1", True, 1), ("pytorch", "1", False, None), ("triton", "2", True, 1),
        ],
    ),
    "kserve-mlserver": _runtime(
        ["v2"],
        [
            ("sklearn", "0", True, 2), ("sklearn", "1", True, 2), ("xgboost", "1", True, 2), ("xgboost", "2", True, 2),
            ("lightgbm", "3", True, 2), ("lightgbm", "4", True, 2), ("mlflow", "1", True, 1), ("mlflow", "2", True, 1),
        ],
    ),
    "kserve-sklearnserver": _runtime(["v1", "v2"], [("sklearn", "1", True, 1)]),
    "kserve-xgbserver": _runtime(["v1", "v2"], [("xgboost", "1", True, 1)]),
    "kserve-lgbserver": _runtime(["v1", "v2"], [("lightgbm", "3", True, 1)]),
    "kserve-tensorflow-serving": _runtime(["v1", "grpc-v1"], [("tensorflow", "1", True, 2), ("tensorflow", "2", True, 2)]),
    "kserve-torchserve": _runtime(["v1", "v2", "grpc-v2"], [("pytorch", "1", True, 2)]),
    "kserve-paddleserver": _runtime(["v1", "v2"], [("paddle", "2", True, 1)]),
    "kserve-pmmlserver": _runtime(["v1", "v2"], [("pmml", "3", True, 1), ("pmml", "4", True, 1)]),
    "kserve-huggingfaceserver": _runtime(["v1", "v2"], [("huggingface", "1", True, 1)]),
    # OpenVINO Model Server auto-selects onnx "1" at priority 2, above kserve-tritonserver's 1.
    "kserve-openvino": _runtime(
        ["v1", "v2", "grpc-v2"],
        [("openvino", "10", True, 1), ("onnx", "1", True, 2), ("tensorflow", "1", True, 3), ("huggingface", None, True, None)],
    ),
    "triton-2.x": _runtime(
        ["grpc-v2"],
        [
            ("keras", "2", True, None), ("onnx", "1", True, None), ("pytorch", "1", True, None),
            ("tensorflow", "1", True, None), ("tensorflow", "2", True, None), ("tensorrt", "7", True, None),
        ],
        multi=True,
    ),
}  # fmt: skip


def priority_collisions(new: Object, existing: Object) -> list[str]:
    """The formats for which KServe's runtime webhook refuses the runtime spec `new` beside `existing`
    (kserve/kserve pkg/webhook/admission/servingruntime/servingruntime_webhook.go validateServingRuntimePriority):
    both single- or both multi-model, a protocol version in common, and a format of the same name and version that
    both auto-select at the same priority. A format that is not auto-selected is never compared."""
    if bool(new.get("multiModel")) != bool(existing.get("multiModel")) or existing.get("disabled"):
        return []
    if not set(new.get("protocolVersions") or []) & set(existing.get("protocolVersions") or []):
        return []
    collisions = []
    for theirs in existing.get("supportedModelFormats", []):
        for ours in new.get("supportedModelFormats", []):
            same = ours["name"].lower() == theirs["name"].lower() and ours.get("version") == theirs.get("version")
            auto = ours.get("autoSelect") is True and theirs.get("autoSelect") is True
            if same and auto and ours.get("priority") is not None and ours.get("priority") == theirs.get("priority"):
                collisions.append(f"{ours['name']}:{ours.get('version')}")
    return collisions


def runtime_supports_model(spec: Object, model: Object) -> bool:
    """RuntimeSupportsModel (kserve/kserve pkg/apis/serving/v1beta1/predictor_model.go): the model's format label
    (`mt:<name>` or `mt:<name>:<version>`) among the runtime's; without a named runtime only the formats the runtime
    auto-selects have labels."""
    labels = set()
    for entry in spec.get("supportedModelFormats", []):
        if model.get("runtime") or entry.get("autoSelect") is True:
            labels.add(f"mt:{entry['name']}")
            if entry.get("version") is not None:
                labels.add(f"mt:{entry['name']}:{entry['version']}")
    model_format = model["modelFormat"]
    version = model_format.get("version")
    return (f"mt:{model_format['name']}:{version}" if version is not None else f"mt:{model_format['name']}") in labels


def _protocol_supported(spec: Object, protocol: str | None) -> bool:
    """ServingRuntimeSpec.IsProtocolVersionSupported: a runtime that lists no protocol takes every one."""
    listed = spec.get("protocolVersions") or []
    return not protocol or not listed or protocol in listed


def select_runtime(model: Object, runtimes: list[tuple[str, Object]]) -> str | None:
    """The ClusterServingRuntime KServe's predictor reconciler gives `spec.predictor.model`, `runtimes` in the order
    KServe lists them (newest first), or None where it reports NoSupportingRuntime
    (kserve/kserve pkg/controller/v1beta1/inferenceservice/components/predictor.go). A named runtime is taken if it
    is enabled, supports the model's protocolVersion when one is given and any of its formats matches. Otherwise
    GetSupportingRuntimes keeps the enabled single-model runtimes that auto-select the format and support the model's
    protocol (v1 when none is given), and sortSupportedRuntimeByPriority puts the highest priority of the format
    first, a runtime without one last; equals keep the list order here, which Go's sort.Slice does not promise."""
    named = model.get("runtime")
    if named:
        spec = dict(runtimes).get(named)
        if spec is None or spec.get("disabled") or not _protocol_supported(spec, model.get("protocolVersion")):
            return None
        return named if runtime_supports_model(spec, model) else None
    protocol = model.get("protocolVersion") or "v1"
    candidates = [
        (name, spec)
        for name, spec in runtimes
        if not spec.get("disabled")
        and not spec.get("multiModel")
        and runtime_supports_model(spec, model)
        and _protocol_supported(spec, protocol)
    ]

    def rank(candidate: tuple[str, Object]) -> tuple[bool, int]:
        # GetPriority: the first entry of the format's name, whatever its version or autoSelect.
        entry = next(e for e in candidate[1]["supportedModelFormats"] if e["name"] == model["modelFormat"]["name"])
        priority = entry.get("priority")
        return (priority is None, -(priority or 0))

    candidates.sort(key=rank)
    return candidates[0][0] if candidates else None


# -- metrics -------------------------------------------------------------------------------------------------------

# The annotations KServe's pod webhook reads and writes (kserve/kserve pkg/constants/constants.go).
ENABLE_METRIC_AGGREGATION = "serving.kserve.io/enable-metric-aggregation"
ENABLE_PROMETHEUS_SCRAPING = "serving.kserve.io/enable-prometheus-scraping"
KSERVE_CONTAINER_PROMETHEUS_PORT = "prometheus.kserve.io/port"
KSERVE_CONTAINER_PROMETHEUS_PATH = "prometheus.kserve.io/path"
PROMETHEUS_SCRAPE = "prometheus.io/scrape"
PROMETHEUS_PORT = "prometheus.io/port"
PROMETHEUS_PATH = "prometheus.io/path"
QUEUE_PROXY_AGGREGATE_PORT = 9088  # QueueProxyAggregatePrometheusMetricsPort: qpext's listener
DEFAULT_POD_PROMETHEUS_PORT = 9091  # DefaultPodPrometheusPort: queue-proxy's user metrics (Knative's 9091)
DEFAULT_KSERVE_CONTAINER_PROMETHEUS_PORT = 8080  # metrics_aggregate_injector.go defaultKserveContainerPrometheusPort
# inferenceservice-config's metricsAggregator as KServe ships it (config/configmap/inferenceservice.yaml, the chart's
# kserve.metricsaggregator values): both off.
METRICS_AGGREGATOR_DEFAULTS = {"enableMetricAggregation": "false", "enablePrometheusScraping": "false"}
# Annotations KServe never copies from the InferenceService or the runtime onto the predictor
# (constants.ServiceAnnotationDisallowedList, the inferenceservice-config default).
SERVICE_ANNOTATION_DISALLOWED = frozenset(
    {
        "autoscaling.knative.dev/min-scale",
        "autoscaling.knative.dev/max-scale",
        "internal.serving.kserve.io/storage-initializer-sourceuri",
        "kubectl.kubernetes.io/last-applied-configuration",
        "modelFormat",
    }
)
# The labels KServe adds to every predictor pod (buildObjectMeta: constants.InferenceServicePodLabelKey and
# KServiceComponentLabel).
ISVC_POD_LABEL = "serving.kserve.io/inferenceservice"
COMPONENT_LABEL = "component"
# Knative's queue-proxy container and its ports (knative/serving pkg/reconciler/revision/resources/queue.go,
# pkg/networking/constants.go): the request port (8012, or 8013 where the user port is h2c), HTTPS, the autoscaler's
# and the user's metrics.
QUEUE_PROXY = "queue-proxy"
KNATIVE_USER_PORT_NAME = "user-port"  # deploy.go makeServingContainer names the serving port so


def _allowed(annotations: dict[str, str] | None) -> dict[str, str]:
    return {key: value for key, value in (annotations or {}).items() if key not in SERVICE_ANNOTATION_DISALLOWED}


def predictor_metadata(runtime: Object, isvc: Object) -> tuple[dict[str, str], dict[str, str]]:
    """The labels and annotations KServe puts on the predictor (and so on its pods) before its pod webhook runs:
    the runtime's, then the InferenceService's, then `spec.predictor`'s, each later one winning, and the labels that
    mark a predictor pod (kserve/kserve pkg/controller/v1beta1/inferenceservice/components/predictor.go
    buildPredictorResources, buildObjectMeta). Both the Knative revision and the raw Deployment carry them to the pod
    (.../reconcilers/knative/ksvc_reconciler.go, .../reconcilers/deployment/deployment_reconciler.go)."""
    spec, predictor = runtime["spec"], isvc["spec"]["predictor"]
    labels = {
        **spec.get("labels", {}),
        **isvc["metadata"].get("labels", {}),
        **predictor.get("labels", {}),
        ISVC_POD_LABEL: isvc["metadata"]["name"],
        COMPONENT_LABEL: "predictor",
    }
    annotations = {
        **_allowed(spec.get("annotations")),
        **_allowed(isvc["metadata"].get("annotations")),
        **_allowed(predictor.get("annotations")),
    }
    return labels, annotations


def inject_metrics_aggregator(
    annotations: dict[str, str], queue_proxy: bool, config: dict[str, str] = METRICS_AGGREGATOR_DEFAULTS
) -> tuple[dict[str, str], dict[str, str]]:
    """KServe's pod webhook on a predictor pod's annotations: the annotations it leaves, and the environment it gives
    the queue-proxy container (kserve/kserve pkg/webhook/admission/pod/metrics_aggregate_injector.go
    InjectMetricsAggregator, setMetricAggregationEnvVarsAndPorts). A switch the pod does not carry comes from
    inferenceservice-config's metricsAggregator (`config`). Aggregation only sets the queue-proxy's environment, so it
    does nothing in raw mode, which has no queue-proxy; scraping then writes prometheus.io/port: qpext's aggregate
    port with aggregation, else queue-proxy's own 9091, never the runtime's port."""
    result = dict(annotations)
    aggregate = result.setdefault(ENABLE_METRIC_AGGREGATION, config["enableMetricAggregation"])
    env = {}
    if aggregate == "true" and queue_proxy:
        env = {
            "KSERVE_CONTAINER_PROMETHEUS_METRICS_PORT": result.get(
                KSERVE_CONTAINER_PROMETHEUS_PORT, str(DEFAULT_KSERVE_CONTAINER_PROMETHEUS_PORT)
            ),
            "KSERVE_CONTAINER_PROMETHEUS_METRICS_PATH": result.get(KSERVE_CONTAINER_PROMETHEUS_PATH, "/metrics"),
            "AGGREGATE_PROMETHEUS_METRICS_PORT": str(QUEUE_PROXY_AGGREGATE_PORT),
        }
    if result.setdefault(ENABLE_PROMETHEUS_SCRAPING, config["enablePrometheusScraping"]) == "true":
        port = QUEUE_PROXY_AGGREGATE_PORT if aggregate == "true" else DEFAULT_POD_PROMETHEUS_PORT
        result[PROMETHEUS_PORT] = str(port)
        result[PROMETHEUS_PATH] = "/metrics"
    return result, env


def predictor_pod_annotations(
    runtime: Object, isvc: Object, mode: str, config: dict[str, str] = METRICS_AGGREGATOR_DEFAULTS
) -> tuple[dict[str, str], dict[str, str]]:
    """The annotations of a running predictor pod and its queue-proxy's environment (empty in raw mode)."""
    _, annotations = predictor_metadata(runtime, isvc)
    return inject_metrics_aggregator(annotations, queue_proxy=mode == SERVERLESS, config=config)


def annotation_scrape(annotations: dict[str, str]) -> tuple[int, str] | None:
    """The port and path a Prometheus that discovers pods by annotation scrapes (the `kubernetes-pods` job of
    prometheus-community/helm-charts charts/prometheus values.yaml): pods with prometheus.io/scrape "true", at
    prometheus.io/port (else the declared port) and prometheus.io/path (else /metrics)."""
    if annotations.get(PROMETHEUS_SCRAPE) != "true":
        return None
    port = annotations.get(PROMETHEUS_PORT)
    assert port is not None, "prometheus.io/scrape without prometheus.io/port: Prometheus scrapes every declared port"
    return int(port), annotations.get(PROMETHEUS_PATH, "/metrics")


def running_pod(runtime: Object, isvc: Object, mode: str) -> Object:
    """The predictor pod as it runs, with the containers the cluster adds to what KServe's controller builds: in
    Knative mode the serving container's one port named user-port (knative/serving .../revision/resources/deploy.go)
    and the queue-proxy (queue.go); the storage initializer as an init container where the model has a storageUri
    (kserve/kserve pkg/webhook/admission/pod/storage_initializer_injector.go); the model agent beside a multi-model
    runtime (agent_injector.go, its port 9081)."""
    pod = copy.deepcopy(predictor_pod(runtime, isvc))
    container = pod["containers"][0]
    if mode == SERVERLESS:
        port, _ = serving_port(container)
        container["ports"] = [{"name": KNATIVE_USER_PORT_NAME, "containerPort": port}]
        http2 = serving_port(predictor_pod(runtime, isvc)["containers"][0])[1] == "h2c"
        pod["containers"].append(
            {
                "name": QUEUE_PROXY,
                "ports": [
                    {"name": "queue-port", "containerPort": 8013 if http2 else 8012},
                    {"name": "https-port", "containerPort": 8112},
                    {"name": "http-autometric", "containerPort": 9090},
                    {"name": "http-usermetric", "containerPort": 9091},
                ],
            }
        )
    if runtime["spec"].get("multiModel"):
        pod["containers"].append({"name": "agent", "ports": [{"name": "agent-port", "containerPort": 9081}]})
    if isvc["spec"]["predictor"]["model"].get("storageUri"):
        pod["initContainers"] = [{"name": "storage-initializer"}]
    return pod

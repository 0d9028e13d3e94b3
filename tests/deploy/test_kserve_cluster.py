"""deploy/kserve as a cluster takes it: the pods KServe builds from runtime and service, what Knative admits."""

from __future__ import annotations

import re
import shlex
from decimal import Decimal
from typing import Any

import pytest

from geserve.cli import parse_settings
from geserve.settings import Settings
from tests.deploy.kserve import (
    KSERVE_RUNTIMES,
    KUBERNETES_DEFAULT_GRACE_SECONDS,
    RAW,
    SERVERLESS,
    deployment_modes,
    http_probe_ports,
    knative_release_for_probes,
    knative_violations,
    merge_runtime_container,
    pre_stop_seconds,
    predictor_pod,
    priority_collisions,
    quantity,
    select_runtime,
    serving_port,
)
from tests.deploy.manifests import DEPLOY, by_kind, kserve_objects, validate_core

Object = dict[str, Any]

# KServe's own Triton runtime (kserve/kserve config/runtimes/kserve-tritonserver.yaml): its container args, which
# the geserve image answers as well.
KSERVE_TRITON_ARGS = [
    "tritonserver",
    "--model-store=/mnt/models",
    "--grpc-port=9000",
    "--http-port=8080",
    "--allow-grpc=true",
    "--allow-http=true",
]
# ModelMesh's Triton runtime (kserve/modelmesh-serving config/runtimes/triton-2.x.yaml): the container
# command, which replaces the image's entrypoint, and the liveness probe run inside the container.
MODELMESH_TRITON_COMMAND = [
    "/bin/sh",
    "-c",
    "mkdir -p /models/_triton_models; chmod 777 /models/_triton_models; exec tritonserver"
    ' "--model-repository=/models/_triton_models" "--model-control-mode=explicit"'
    ' "--strict-model-config=false" "--strict-readiness=false" "--allow-http=true" "--allow-sagemaker=false" ',
]
MODELMESH_TRITON_LIVENESS = [
    "curl",
    "--fail",
    "--silent",
    "--show-error",
    "--max-time",
    "9",
    "http://localhost:8000/v2/health/live",
]


def _runtimes() -> dict[str, Object]:
    return {r["metadata"]["name"]: r for r in by_kind(kserve_objects(), "ClusterServingRuntime")}


def _services() -> list[Object]:
    return by_kind(kserve_objects(), "InferenceService")


def _pods() -> list[tuple[Object, Object]]:
    """Every InferenceService with the predictor pod spec KServe builds for it."""
    runtimes = _runtimes()
    pods = [
        (isvc, predictor_pod(runtimes[isvc["spec"]["predictor"]["model"]["runtime"]], isvc)) for isvc in _services()
    ]
    assert pods
    return pods


def _options(container: Object) -> Settings:
    return parse_settings(container["args"])


def _name(isvc: Object) -> str:
    return str(isvc["metadata"]["name"])


def test_the_merge_follows_kserve() -> None:
    runtime = {
        "name": "kserve-container",
        "image": "runtime",
        "args": ["--a"],
        "ports": [{"containerPort": 8080, "name": "http1"}],
        "env": [{"name": "X", "value": "1"}],
        "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}},
    }
    isvc = {
        "args": ["--b"],
        "ports": [{"containerPort": 9000, "name": "h2c"}],
        "env": [{"name": "X", "value": "2"}, {"name": "Y", "value": "3"}],
        "resources": {"limits": {"memory": "4Gi"}},
    }
    merged = merge_runtime_container(runtime, isvc)
    assert merged["name"] == "kserve-container" and merged["image"] == "runtime"
    assert merged["args"] == ["--a", "--b"]  # concatenated, not replaced
    assert [p["containerPort"] for p in merged["ports"]] == [8080, 9000]  # merged by containerPort
    assert merged["env"] == [{"name": "X", "value": "2"}, {"name": "Y", "value": "3"}]
    assert merged["resources"] == {"requests": {"cpu": "1"}, "limits": {"memory": "4Gi"}}


def test_every_inference_service_is_admitted_in_each_mode_it_may_run_in() -> None:
    rejected = {}
    for isvc, pod in _pods():
        validate_core({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": _name(isvc)}, "spec": pod})
        if SERVERLESS in deployment_modes(isvc):
            # A service that does not choose raw mode must pass Knative with its config-features as installed.
            rejected[_name(isvc)] = knative_violations(pod)
    assert rejected and not any(rejected.values()), rejected


def test_knative_rejects_what_it_should() -> None:
    """The rules above are not vacuous: two ports, a hostPath volume, a node selector, a preStop hook."""
    runtime = _runtimes()["geserve"]
    isvc: Object = {
        "metadata": {"name": "x"},
        "spec": {
            "predictor": {
                "nodeSelector": {"a": "b"},
                "volumes": [{"name": "d", "hostPath": {"path": "/d"}}],
                "model": {
                    "runtime": "geserve",
                    "ports": [{"containerPort": 9000, "name": "h2c"}, {"containerPort": 9001, "name": "grpc"}],
                    "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
                    "volumeMounts": [{"name": "d", "mountPath": "/d"}],
                },
            }
        },
    }
    problems = "\n".join(knative_violations(predictor_pod(runtime, isvc)))
    for expected in (
        "kubernetes.podspec-nodeselector",
        "kubernetes.podspec-volumes-hostpath",
        "only a single port is allowed",
        "lifecycle",
    ):
        assert expected in problems


def test_traffic_reaches_the_listener_for_its_protocol_and_probes_reach_http() -> None:
    for isvc, pod in _pods():
        container = pod["containers"][0]
        options = _options(container)
        port, name = serving_port(container)
        grpc = isvc["spec"]["predictor"]["model"].get("protocolVersion") == "grpc-v2"
        # Knative and KServe's ingress route a port named h2c as HTTP/2, any other as HTTP/1.1.
        assert (name == "h2c") == grpc, f"{_name(isvc)}: port {name!r} for protocol grpc={grpc}"
        assert port == (options.grpc.port if grpc else options.http.port), _name(isvc)
        for mode in deployment_modes(isvc):
            sent = http_probe_ports(container, mode)
            assert {"readinessProbe", "startupProbe"} <= set(sent), _name(isvc)
            for probe_name, probe_port in sent.items():
                # /v2/health/* is HTTP: only the HTTP listener answers it.
                assert probe_port == options.http.port, f"{_name(isvc)} ({mode}): {probe_name} goes to {probe_port}"


def test_the_knative_release_the_services_need_is_stated() -> None:
    """Knative's webhook admits a probe on a port other than the serving port only from 1.3 on, one on the serving
    port from 1.1 on: the REST services (serving and probing 8080) need 1.1, the gRPC ones (serving 9000) 1.3, and
    the README names the release and what to do on an older one."""
    needed = {}
    for isvc, pod in _pods():
        if SERVERLESS in deployment_modes(isvc):
            grpc = isvc["spec"]["predictor"]["model"].get("protocolVersion") == "grpc-v2"
            needed[_name(isvc)] = release = knative_release_for_probes(pod["containers"][0])
            assert release == ((1, 3) if grpc else (1, 1)), _name(isvc)
    major, minor = max(needed.values())
    kserve_section = (DEPLOY / "README.md").read_text().split("## KServe", 1)[1]
    paragraph = next((p for p in kserve_section.split("\n\n") if f"Knative {major}.{minor} or later" in p), None)
    assert paragraph is not None, f"the README does not say the services need Knative {major}.{minor} or later"
    assert "raw mode" in paragraph and "RawDeployment" in paragraph


def test_runtime_probes_give_a_busy_server_time() -> None:
    for name, runtime in _runtimes().items():
        container = runtime["spec"]["containers"][0]
        for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe_name in container:
                # Kubernetes' default timeoutSeconds is 1: one slow answer under load counts as a failure.
                assert container[probe_name].get("timeoutSeconds", 1) >= 2, f"{name} {probe_name}"


def test_pods_drain_within_their_grace_period_in_raw_mode() -> None:
    for isvc, pod in _pods():
        container = pod["containers"][0]
        options = _options(container)
        drain, exit_timeout = options.server.drain_delay_secs, options.server.exit_timeout_secs
        assert drain > 0, f"{_name(isvc)}: no --drain-delay-secs, a rollout drops connections"
        if RAW not in deployment_modes(isvc):
            continue  # Knative's queue-proxy drains and its revision timeout is the grace period
        pre_stop = pre_stop_seconds(container)
        grace = pod.get("terminationGracePeriodSeconds", KUBERNETES_DEFAULT_GRACE_SECONDS)
        # The endpoint removal reaches every node while the pod still serves, then in-flight requests end.
        assert pre_stop + drain >= 5, _name(isvc)
        assert grace >= pre_stop + drain + exit_timeout + 5, f"{_name(isvc)}: grace {grace}"


def test_services_that_need_knative_feature_flags_run_in_raw_mode() -> None:
    services = _services()
    ascend = next(s for s in services if "huawei.com/Ascend310P" in str(s))
    assert deployment_modes(ascend) == (RAW,)


_RUNTIME_PORT = re.compile(r"runtime's (?:[\w-]+ )?ports?\b", re.IGNORECASE)


def test_comments_speak_only_of_ports_the_runtimes_declare() -> None:
    """The ClusterServingRuntimes declare no ports, so a comment in deploy/kserve that speaks of the runtime's port
    (one an InferenceService would replace or add to) describes a pod KServe does not build."""
    declared = [name for name, runtime in _runtimes().items() if runtime["spec"]["containers"][0].get("ports")]
    for path in sorted((DEPLOY / "kserve").glob("*.yaml")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _RUNTIME_PORT.search(line.partition("#")[2]):
                assert declared, f"{path.name}:{number}: no runtime declares a port: {line.strip()}"


# The gid of the group that owns /dev/davinci*, as the chart asks for it; `id -g HwHiAiUser` would give the
# account's primary group instead, which need not be that one.
NPU_GROUP_COMMAND = "getent group HwHiAiUser | cut -d: -f3"


def test_the_npu_group_is_a_value_the_user_sets() -> None:
    """HwHiAiUser's group id is whatever the driver's installer chose on the nodes: every manifest that sets
    supplementalGroups says, beside it, how to find the right one, with the command the chart names."""
    found = 0
    for path in sorted((DEPLOY / "kserve").glob("*.yaml")):
        text = path.read_text()
        assert "id -g HwHiAiUser" not in text, path.name
        lines = text.splitlines()
        for number, line in enumerate(lines):
            if "supplementalGroups:" in line:
                found += 1
                nearby = "\n".join(lines[max(0, number - 3) : number + 1])
                assert NPU_GROUP_COMMAND in nearby, f"{path.name}:{number + 1}"
    assert found
    readme = (DEPLOY / "README.md").read_text()
    assert "id -g HwHiAiUser" not in readme
    kserve_section = readme.split("## KServe", 1)[1]
    assert "supplementalGroups" in kserve_section and NPU_GROUP_COMMAND in kserve_section
    chart = (DEPLOY / "helm" / "geserve" / "templates" / "deployment.yaml").read_text()
    assert NPU_GROUP_COMMAND in chart


def test_trained_models_fit_their_service_memory_limit() -> None:
    """KServe's TrainedModel controller places a model only while IsMemoryResourceAvailable holds: the sum of
    the TrainedModels' memory within the parent's own `spec.predictor.model.resources.limits.memory`, the
    runtime's limit not counted (kserve/kserve pkg/controller/v1alpha1/trainedmodel/controller.go,
    pkg/controller/v1beta1/inferenceservice/utils/utils.go), in a multi-model predictor (IsMMSPredictor:
    no storageUri of its own)."""
    objects = kserve_objects()
    services = {_name(s): s for s in by_kind(objects, "InferenceService")}
    runtimes = _runtimes()
    trained = by_kind(objects, "TrainedModel")
    assert trained
    for parent_name in {tm["spec"]["inferenceService"] for tm in trained}:
        parent = services[parent_name]["spec"]["predictor"]["model"]
        assert "storageUri" not in parent and "storage" not in parent
        assert runtimes[parent["runtime"]]["spec"]["multiModel"] is True
        limit = quantity(parent.get("resources", {}).get("limits", {}).get("memory", 0))
        wanted = sum(
            (
                quantity(tm["spec"]["model"]["memory"])
                for tm in trained
                if tm["spec"]["inferenceService"] == parent_name
            ),
            Decimal(0),
        )
        assert 0 < wanted <= limit, f"{parent_name}: TrainedModels want {wanted} bytes, its own limit is {limit}"


def test_quantities_parse_as_kubernetes_reads_them() -> None:
    assert quantity("512Mi") == 512 * 2**20 and quantity("4Gi") == 4 * 2**30
    assert quantity("1G") == 10**9 and quantity("100m") == Decimal("0.1") and quantity(0) == 0
    with pytest.raises(ValueError):
        quantity("4 GB")


def _model(name: str, version: str | None = None, runtime: str | None = None, protocol: str | None = None) -> Object:
    model: Object = {"modelFormat": {"name": name} | ({"version": version} if version else {})}
    if runtime:
        model["runtime"] = runtime
    if protocol:
        model["protocolVersion"] = protocol
    return model


def test_the_runtime_selection_model_follows_kserve() -> None:
    """The rules below are not vacuous: an equal auto-selected priority is refused, a higher one wins, a format that
    is not auto-selected is reached only by naming the runtime, and the model's protocol must be served."""
    triton = KSERVE_RUNTIMES["kserve-tritonserver"]
    onnx = {"name": "onnx", "version": "1", "autoSelect": True, "priority": 1}
    rival = {"protocolVersions": ["grpc-v2"], "supportedModelFormats": [onnx]}
    assert priority_collisions(rival, triton) == ["onnx:1"]
    assert priority_collisions(rival | {"multiModel": True}, triton) == []
    assert priority_collisions(rival | {"protocolVersions": ["v1"]}, triton) == []
    higher = rival | {"supportedModelFormats": [onnx | {"priority": 2}]}
    assert priority_collisions(higher, triton) == []
    runtimes = [("kserve-tritonserver", triton), ("rival", higher)]
    assert select_runtime(_model("onnx", protocol="grpc-v2"), runtimes) == "rival"
    assert select_runtime(_model("onnx", protocol="v2"), runtimes) == "kserve-tritonserver"  # rival lacks v2
    assert select_runtime(_model("onnx"), runtimes) is None  # v1 by default: neither serves it
    hidden = rival | {"supportedModelFormats": [{"name": "onnx", "version": "1"}]}
    assert priority_collisions(hidden, triton) == []
    runtimes = [("hidden", hidden), ("kserve-tritonserver", triton)]
    assert select_runtime(_model("onnx", protocol="grpc-v2"), runtimes) == "kserve-tritonserver"
    assert select_runtime(_model("onnx", runtime="hidden", protocol="grpc-v2"), runtimes) == "hidden"
    assert select_runtime(_model("onnx", runtime="hidden", protocol="v2"), runtimes) is None


def test_installing_geserve_is_admitted_beside_kserve_runtimes() -> None:
    """KServe's runtime webhook refuses a ClusterServingRuntime whose auto-selected format and version carry the
    priority another runtime gives them (kserve-tritonserver: onnx 1 at priority 1)."""
    for name, runtime in _runtimes().items():
        for theirs, spec in KSERVE_RUNTIMES.items():
            assert not priority_collisions(runtime["spec"], spec), f"{name} beside {theirs}"
            assert not priority_collisions(spec, runtime["spec"]), f"{theirs} beside {name}"


def test_services_that_name_no_runtime_keep_kserve_runtimes() -> None:
    """An InferenceService that names no runtime gets what it got before geserve was installed, for every format a
    KServe runtime auto-selects, whether geserve's runtimes are the newest (listed first) or the oldest."""
    ours = [(name, runtime["spec"]) for name, runtime in _runtimes().items()]
    theirs = list(KSERVE_RUNTIMES.items())
    checked = 0
    for spec in KSERVE_RUNTIMES.values():
        for entry in spec["supportedModelFormats"]:
            if entry.get("autoSelect") is not True:
                continue
            for version in (None, entry.get("version")):
                for protocol in (None, "v1", "v2", "grpc-v2"):
                    model = _model(entry["name"], version, protocol=protocol)
                    before = select_runtime(model, theirs)
                    for order in (ours + theirs, theirs + ours):
                        checked += 1
                        assert select_runtime(model, order) == before, f"{model} now goes to geserve"
    assert checked


def test_services_that_name_geserve_get_it() -> None:
    runtimes = [(name, runtime["spec"]) for name, runtime in _runtimes().items()] + list(KSERVE_RUNTIMES.items())
    for isvc in _services():
        model = isvc["spec"]["predictor"]["model"]
        assert model.get("runtime"), f"{_name(isvc)} relies on auto-selection"
        assert select_runtime(model, runtimes) == model["runtime"], _name(isvc)
    for name, runtime in _runtimes().items():
        for entry in runtime["spec"]["supportedModelFormats"]:
            for protocol in (None, *runtime["spec"]["protocolVersions"]):
                model = _model(entry["name"], runtime=name, protocol=protocol)
                assert select_runtime(model, runtimes) == name, model


def _run_instructions(dockerfile: str) -> list[str]:
    """The RUN instructions of the final stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile)
    final = re.split(r"^FROM\s", text, flags=re.M)[-1]
    return [line[4:] for line in final.splitlines() if line.startswith("RUN ")]


@pytest.mark.parametrize("image", ["Dockerfile.cpu", "Dockerfile.ascend"])
def test_the_images_answer_the_triton_runtimes_of_kserve_and_modelmesh(image: str) -> None:
    assert KSERVE_TRITON_ARGS[0] == "tritonserver"  # geserve's entry point drops it
    options = parse_settings(KSERVE_TRITON_ARGS[1:])
    assert (options.http.port, options.grpc.port) == (8080, 9000)
    script = MODELMESH_TRITON_COMMAND[2]
    words = shlex.split(script.split("exec ", 1)[1])
    assert words[0] == "tritonserver"
    options = parse_settings(words[1:])
    assert MODELMESH_TRITON_LIVENESS[-1].startswith(f"http://localhost:{options.http.port}/")
    # The liveness probe runs `curl` in the container: the image must have it.
    installs = [run for run in _run_instructions((DEPLOY / "docker" / image).read_text()) if "curl" in run]
    assert any(re.search(r"(apt-get install|yum install|apk add)[^|&;()]*\bcurl\b", run) for run in installs), image


def test_the_readmes_priority_for_unnamed_onnx_services_is_admitted_and_wins() -> None:
    """deploy/README.md's advice for taking unnamed ONNX services: the priority it names must be admitted beside every
    KServe runtime (kserve-openvino auto-selects onnx 1 at priority 2, kserve-tritonserver at 1) and must then win the
    selection for the protocols geserve serves."""
    section = (DEPLOY / "README.md").read_text().split("**Choosing the runtime.**", 1)[1].split("\n\n", 1)[0]
    advice = re.search(r"`onnx` to `autoSelect: true` with\s+`priority: (\d+)`", section)
    assert advice is not None, section
    priority = int(advice[1])
    for name, runtime in _runtimes().items():
        spec = dict(runtime["spec"])
        spec["supportedModelFormats"] = [
            {**entry, "autoSelect": True, "priority": priority} if entry["name"] == "onnx" else entry
            for entry in spec["supportedModelFormats"]
        ]
        for theirs, other in KSERVE_RUNTIMES.items():
            assert not priority_collisions(spec, other), f"{name} at onnx priority {priority} beside {theirs}"
            assert not priority_collisions(other, spec), f"{theirs} beside {name} at onnx priority {priority}"
        if spec.get("multiModel"):
            continue  # never auto-selected
        runtimes = [*KSERVE_RUNTIMES.items(), (name, spec)]
        for protocol in spec["protocolVersions"]:
            assert select_runtime(_model("onnx", "1", protocol=protocol), runtimes) == name, (name, protocol)

"""The Ascend chip the deployment targets is one chip: the default image, the chart and the ATC recipes of
docs/ascend.md."""

from __future__ import annotations

import re

import yaml

from tests.deploy.manifests import CHART, DEPLOY, by_kind, containers_of, render_installed
from tests.support import ROOT

_CHIP = re.compile(r"(?i)(?:ascend)?(\d{3})([a-z]?)\d*")


def chip(name: str) -> str:
    """The chip family in a CANN image tag (`310p`), an ATC --soc_version (`Ascend310P3`) or a device
    plugin's resource (`Ascend310P`): `310P`."""
    match = _CHIP.fullmatch(name)
    assert match is not None, f"'{name}' names no Ascend chip"
    return (match[1] + match[2]).upper()


def image_chip() -> str:
    """The chip of the CANN base image deploy/docker/Dockerfile.ascend builds on by default
    (ascendai/cann:<version>-<chip>-<os>-py<python>)."""
    text = (DEPLOY / "docker" / "Dockerfile.ascend").read_text()
    match = re.search(r"^ARG CANN_IMAGE=ascendai/cann:[^-\s]+-([a-z0-9]+)-", text, re.M)
    assert match is not None, "Dockerfile.ascend has no default ascendai/cann image"
    return chip(match[1])


def test_the_chip_helpers_read_each_way_of_naming_a_chip() -> None:
    assert chip("310p") == chip("Ascend310P3") == chip("Ascend310P") == "310P"
    assert chip("910b") == chip("Ascend910B3") == "910B" and chip("Ascend910") == "910"


def test_the_docs_atc_recipes_compile_for_the_default_image_chip() -> None:
    # `<this host's chip>` stands for the chip geserve asks the host for when it compiles at load.
    versions = re.findall(r"--soc_version=([^\s<]\S*)", (ROOT / "docs" / "ascend.md").read_text())
    assert versions, "docs/ascend.md has no ATC recipe"
    assert {chip(version) for version in versions} == {image_chip()}, versions


def test_the_chart_asks_for_npus_of_the_default_image_chip() -> None:
    target = image_chip()
    values = yaml.safe_load((CHART / "values-ascend.yaml").read_text())
    deployment = by_kind(render_installed("values-ascend.yaml"), "Deployment")[0]
    resources = containers_of(deployment)[0]["resources"]
    npus = [
        name for kind in ("requests", "limits") for name in resources.get(kind, {}) if name.startswith("huawei.com/")
    ]
    assert npus, resources
    for name in npus:
        # The device plugin names a family; 910B chips are handed out as huawei.com/Ascend910.
        assert target.startswith(chip(name.removeprefix("huawei.com/"))), (name, target)
    for label in values.get("nodeSelector", {}).values():
        if "Ascend" in str(label):
            assert target.startswith(chip(str(label).rpartition("-")[2])), (label, target)
    # The docs show the same build, so a copied command builds the image the chart expects.
    assert f"{target.lower()}-" in (DEPLOY / "README.md").read_text().split("--build-arg CANN_IMAGE=", 1)[1][:60]


def test_the_kserve_ascend_example_asks_for_npus_of_the_default_image_chip() -> None:
    target = image_chip()
    text = (DEPLOY / "kserve" / "inferenceservice-ascend-om.yaml").read_text()
    named = re.findall(r"huawei[.-](?:com/)?(Ascend\w+)", text)
    assert named, "the Ascend InferenceService asks for no NPU"
    assert all(target.startswith(chip(name)) for name in named), (named, target)


def test_the_ascend_deployments_require_the_npu_rather_than_fall_back_to_the_cpu() -> None:
    """A pod given no NPU, or an image whose CANN environment is broken, must fail its loads (and stay unready)
    rather than serve `ge` models with ONNX Runtime behind a ready probe."""
    deployment = by_kind(render_installed("values-ascend.yaml"), "Deployment")[0]
    assert "--npu=required" in containers_of(deployment)[0]["args"]
    isvc = yaml.safe_load((DEPLOY / "kserve" / "inferenceservice-ascend-om.yaml").read_text())
    assert "--npu=required" in isvc["spec"]["predictor"]["model"]["args"]

"""pyproject.toml's metadata: where the project lives, the Python versions it is tested on, test tools as ranges."""

from __future__ import annotations

import re
import sys
import tomllib

from packaging.requirements import Requirement

from tests.support import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Pinned exactly: code generators whose output a test compares byte for byte with the committed files
# (test_protos.py), and helm-python-sdk, whose private native renderer tests/deploy/manifests.py calls.
EXACT = {"grpcio-tools", "mypy-protobuf", "helm-python-sdk"}
# Tools whose next minor release may fail `make test` on unchanged code (new lint rules, other inference).
BOUNDED = {"ruff", "mypy", "kubernetes-validate"}


def _classified_versions() -> list[tuple[int, int]]:
    prefix = "Programming Language :: Python :: "
    found = [c.removeprefix(prefix) for c in PROJECT["classifiers"] if c.startswith(prefix)]
    return sorted((int(v.split(".")[0]), int(v.split(".")[1])) for v in found if re.fullmatch(r"\d+\.\d+", v))


def test_the_urls_name_each_page_under_one_home() -> None:
    urls = PROJECT["urls"]
    assert set(urls) == {"Homepage", "Documentation", "Source", "Issues"}
    home = urls["Homepage"]
    assert home.startswith("https://")
    assert all(url.startswith(home) for url in urls.values()), urls


def test_classifiers_name_every_tested_python_from_the_floor_up() -> None:
    versions = _classified_versions()
    floor = re.fullmatch(r">=(\d+)\.(\d+)", PROJECT["requires-python"])
    assert floor is not None
    assert versions[0] == (int(floor.group(1)), int(floor.group(2)))
    assert versions == [(3, minor) for minor in range(versions[0][1], versions[-1][1] + 1)], "no gaps"
    # The suite is run on each Python that is tested (CI's, `make test PYTHON=...`): it must be one the package
    # declares, and the README's first lines say the same.
    assert sys.version_info[:2] in versions, f"Python {sys.version_info[:2]} is tested but has no classifier"
    listed = ", ".join(f"{major}.{minor}" for major, minor in versions[:-1]) + " and {}.{}".format(*versions[-1])
    assert f"({listed} are tested)" in (ROOT / "README.md").read_text()


def test_test_tools_are_ranges_except_the_exact_pins() -> None:
    for text in PROJECT["optional-dependencies"]["test"]:
        requirement = Requirement(text)
        operators = {spec.operator for spec in requirement.specifier}
        if requirement.name in EXACT:
            assert operators == {"=="}, text
            continue
        assert not operators & {"==", "==="}, f"{text}: a range, not a pin"
        if requirement.name in BOUNDED:
            assert operators == {">=", "<"}, f"{text}: a floor and an upper bound"

"""`make models` is reproducible: two builds give the same bytes, and the committed models are what it builds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnx

from tests.support import MODEL_REPOSITORY, ROOT

# The models built from onnx.helper graphs alone: their bytes depend on nothing but the script. `digits` is also
# trained by scikit-learn, whose coefficients may move in the last bits from one release to the next, so it is
# held to reproducibility (two builds, one environment) and to its fixed identity fields, not to the committed bytes.
HELPER_BUILT = ("simple", "simple_string", "simple_sequence", "sequence_controls", "sequence_accumulator")


def _build(repository: Path) -> dict[str, bytes]:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_models.py"), "--repository", str(repository)],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    return {
        str(path.relative_to(repository)): path.read_bytes() for path in sorted(repository.rglob("*")) if path.is_file()
    }


def test_two_builds_write_the_same_bytes_and_the_committed_models(tmp_path: Path) -> None:
    first = _build(tmp_path / "first")
    second = _build(tmp_path / "second")
    assert sorted(first) == sorted(second)
    differing = [name for name in first if first[name] != second[name]]
    assert not differing, f"scripts/make_models.py is not reproducible: {differing} differ between two builds"
    for name in HELPER_BUILT:
        built = first[f"{name}/1/model.onnx"]
        assert built == (MODEL_REPOSITORY / name / "1" / "model.onnx").read_bytes(), f"run `make models`: {name}"
    committed = [name for name in first if (MODEL_REPOSITORY / name).is_file()]
    assert sorted(committed) == sorted(first), "every file the script writes is committed"


def test_every_graph_is_named_after_its_model_and_claims_no_converter_version() -> None:
    for path in sorted(MODEL_REPOSITORY.glob("*/1/model.onnx")):
        model = onnx.load(str(path))
        name = path.parent.parent.name
        assert model.graph.name == name, f"{path}: graph name {model.graph.name!r}"
        assert model.producer_name == "geserve" and model.producer_version == "", path

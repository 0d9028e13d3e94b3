"""The real `.om` samples live in the repository (tests/data/om-samples), tracked by git, with their licence terms."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support import ROOT

SAMPLES = ROOT / "tests" / "data" / "om-samples"


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def test_every_described_sample_is_here_and_tracked_by_git() -> None:
    """A clone (CI, an Ascend host) gets the files: each is committed, none is ignored."""
    if _git("rev-parse", "--is-inside-work-tree").returncode != 0:
        pytest.fail(f"{ROOT} is not a git work tree; the samples must come from a clone")
    expected = json.loads((SAMPLES / "expected.json").read_text())
    files = [*sorted(expected), "expected.json", "PROVENANCE.md", "LICENSE"]
    for name in files:
        assert (SAMPLES / name).is_file(), f"{name} is missing from {SAMPLES}"
    relative = [str((SAMPLES / name).relative_to(ROOT)) for name in files]
    tracked = _git("ls-files", "--error-unmatch", *relative)
    assert tracked.returncode == 0, tracked.stderr
    ignored = _git("check-ignore", "--no-index", *relative)
    assert ignored.stdout == "", f"ignored by .gitignore: {ignored.stdout}"


def test_the_licence_terms_travel_with_the_samples() -> None:
    """Apache-2.0 (section 4): recipients get a copy of the licence and the files' origin."""
    provenance = (SAMPLES / "PROVENANCE.md").read_text()
    assert "Apache-2.0" in provenance
    for name in json.loads((SAMPLES / "expected.json").read_text()):
        assert f"`{name}`" in provenance, f"PROVENANCE.md does not say where {name} comes from"
    licence = (SAMPLES / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence

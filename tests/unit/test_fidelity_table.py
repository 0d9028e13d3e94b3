"""tests/fakes/acl/FIDELITY.md names only tests that exist, and no sample path that does not."""

from __future__ import annotations

import re

from tests.support import ROOT

FIDELITY = ROOT / "tests" / "fakes" / "acl" / "FIDELITY.md"


def test_every_test_the_table_names_exists() -> None:
    text = FIDELITY.read_text()
    defined = {
        match
        for path in (ROOT / "tests").rglob("test_*.py")
        for match in re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.M)
    }
    named = re.findall(r"`(test_\w+?)(_\.\.\.)?`", text)
    assert named
    for name, abbreviated in named:
        found = any(test.startswith(name) for test in defined) if abbreviated else name in defined
        assert found, f"FIDELITY.md names {name}{abbreviated}, which no test defines"


def test_the_samples_it_cites_are_the_vendored_ones() -> None:
    text = FIDELITY.read_text()
    assert "shared/om-samples" not in text
    assert "tests/data/om-samples/" in text and (ROOT / "tests" / "data" / "om-samples").is_dir()

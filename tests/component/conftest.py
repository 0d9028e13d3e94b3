"""Fixtures of the component tests: the pyACL simulator, importable as `acl` for one test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FAKES = Path(__file__).resolve().parents[1] / "fakes"


@pytest.fixture
def acl(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The simulator, importable as `acl` for this test only, in a fresh state."""
    monkeypatch.syspath_prepend(str(FAKES))
    for name in ("ACL_SIM_RUN_MODE", "ACL_SIM_FAULT_FILE", "ACL_SIM_REPORT_DIR", "ASCEND_RT_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    import acl as simulator
    from acl._state import RUNTIME

    RUNTIME.reset()
    yield simulator
    RUNTIME.reset()

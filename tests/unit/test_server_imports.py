"""What starting the server imports: no backend's code, which only the worker that runs it loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT

# The backend modules the front-end process needs: the protocols, and the registry of names and flags.
FRONT_END_BACKEND_MODULES = ("geserve.backends.base", "geserve.backends.registry")


@pytest.mark.parametrize("module", ["geserve.server", "geserve.cli"])
def test_the_server_imports_no_backend(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        f"loaded = sorted(m for m in sys.modules if m.startswith('geserve.backends.') "
        f"and m not in {FRONT_END_BACKEND_MODULES!r})\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr

"""Fuzz suites: bounded hypothesis runs (no example database, no deadline) against real parts."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.support import GeserveProcess, copy_model

# Bounded so that the whole suite stays inside `make test`'s budget; raise with HYPOTHESIS_PROFILE=long.
settings.register_profile(
    "bounded", max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", max_examples=2000, deadline=None, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "bounded"))


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    """A server with numeric and BYTES models, the repository API and client shared memory on."""
    root = tmp_path_factory.mktemp("fuzz")
    repository: Path = root / "models"
    for name in ("simple", "simple_string"):
        copy_model(name, repository)
    process = GeserveProcess(
        root / "geserve.log",
        f"--model-repository={repository}",
        "--model-control-mode=explicit",
        "--load-model=*",
        "--allow-client-shm=true",
    ).wait_live()
    yield process
    assert process.stop() == 0, process.log()
    assert "Traceback" not in process.log(), process.log()

"""Two geserve servers on one machine: neither's sweep takes the other's segments; the suite counts only its own."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from geserve.workers.runs import sweep_orphaned_segments
from tests.conftest import geserve_segments
from tests.support import EchoLoad, GeserveProcess, segments_of_server, write_identity_model

pytestmark = pytest.mark.e2e


def test_another_live_server_keeps_its_segments_and_is_left_out_of_the_suite_checks(
    launch: Callable[..., GeserveProcess], tmp_path: Path
) -> None:
    repository = tmp_path / "models"
    write_identity_model(repository, "echo")
    before = geserve_segments()  # as the suite's leak check starts
    # A developer's `make run`, say: started here, but not one of the suite's servers.
    stranger = GeserveProcess(tmp_path / "stranger.log", f"--model-repository={repository}", suite_owned=False)
    try:
        stranger.wait_live()
        theirs = segments_of_server(stranger.process.pid)
        assert theirs, "the other server made no segments: the test proves nothing"
        assert not theirs & (geserve_segments() - before), "the suite's leak check counts another server's segments"
        ours = launch(f"--model-repository={repository}").wait_live()  # which sweeps /dev/shm as it starts
        mine = segments_of_server(ours.process.pid)
        assert mine and mine <= geserve_segments() - before  # the suite's own server is counted
        assert not set(sweep_orphaned_segments()) & theirs
        assert theirs <= segments_of_server(stranger.process.pid), "a live server's segments were swept"
        with EchoLoad(stranger, threads=2) as load:
            time.sleep(0.5)
        assert set(load.outcomes) == {"ok"}, load.outcomes
        assert ours.stop() == 0
        assert not segments_of_server(ours.process.pid)
    finally:
        assert stranger.stop() == 0, stranger.log()
    assert not segments_of_server(stranger.process.pid)

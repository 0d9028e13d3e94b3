"""`make soak` and `make chaos` in miniature, so the harnesses themselves stay working between full runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reliability import chaos, soak

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]


def test_a_short_soak_passes_with_every_kind_of_traffic_checked(tmp_path: Path) -> None:
    report = soak.run(5.0, tmp_path)
    assert report["passed"], report["failures"]
    assert set(report["by_kind"]) == {kind.name for kind in soak.SOAK_KINDS}
    assert report["idle"]["frontend_rss_mib"] > 0 and report["settled"]["t_s"] > report["last"]["t_s"]
    assert all(counts["ok"] > 0 for counts in report["by_kind"].values())
    assert len(report["samples"]) >= 2 and report["last"]["workers"] >= 5
    assert "| **all," in soak.table(report)


def test_sigterm_under_load_loses_nothing(tmp_path: Path) -> None:
    result = chaos.sigterm_under_load(tmp_path)
    assert result["passed"], result["checks"]
    assert result["ok"] > 0 and result["lost"] == 0


def test_a_shrunk_region_is_refused_by_name_and_served_again_once_replaced(tmp_path: Path) -> None:
    result = chaos.shrunk_region(tmp_path, phase_s=1.5)
    assert result["passed"], json.dumps({"checks": result["checks"], "phases": result["phases"]})
    assert result["phases"]["shrunk"]["HTTP / simple, inputs in the region"]["failed"] > 0


def test_hostile_clients_are_refused_or_dropped_and_the_traffic_is_served(tmp_path: Path) -> None:
    result = chaos.hostile_clients(tmp_path, phase_s=2.5, unread=3)
    assert result["passed"], result["checks"]
    assert result["ok"] > 0 and result["failed"] == 0


def test_sigterm_to_the_process_group_while_draining_fails_nothing_in_the_window(tmp_path: Path) -> None:
    result = chaos.group_sigterm_while_draining(tmp_path, drain_s=2)
    assert result["passed"], result["checks"]
    assert result["served_in_window"] > 0


def test_a_region_flood_is_refused_at_the_cap_and_traffic_runs_on(tmp_path: Path) -> None:
    result = chaos.region_flood(tmp_path, cap=8)
    assert result["passed"], result["checks"]
    assert result["registered"] == 8


def test_oversized_ids_and_parameters_beside_load_are_refused_and_the_rest_served(tmp_path: Path) -> None:
    result = chaos.oversized_requests(tmp_path, phase_s=1.0)
    assert result["passed"], result["checks"]
    assert all(count > 0 for count in result["hostile"].values()) and result["ok"] > 0

"""The shutdown plan's deadlines and the ports every layout binds the same way."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from geserve.cli import parse_settings
from geserve.lifecycle import KILL_MARGIN_S, ShutdownPlan, bind_ports
from geserve.settings import ServerSettings, Settings
from tests.support import free_ports


def test_the_deadlines_follow_the_drain_and_the_exit_timeout() -> None:
    before = time.monotonic()
    deadlines = ShutdownPlan.of(ServerSettings(drain_delay_secs=3, exit_timeout_secs=10)).begin()
    after = time.monotonic()
    assert before + 3 <= deadlines.refuse_at <= after + 3
    assert deadlines.done_by == pytest.approx(deadlines.refuse_at + 10)
    assert deadlines.kill_by == pytest.approx(deadlines.done_by + KILL_MARGIN_S)
    assert 2.5 < deadlines.until_refuse() <= 3
    assert 12.5 < deadlines.left() <= 13


def test_without_a_drain_refusing_is_due_at_once() -> None:
    deadlines = ShutdownPlan.of(ServerSettings(drain_delay_secs=30, exit_timeout_secs=5)).begin(drain=False)
    assert deadlines.until_refuse() == 0
    assert 4.5 < deadlines.left() <= 5


def test_a_spent_deadline_leaves_nothing_rather_than_a_negative_time() -> None:
    deadlines = ShutdownPlan(drain_s=0, exit_timeout_s=0).begin()
    time.sleep(0.01)
    assert deadlines.left() == 0
    assert deadlines.until_refuse() == 0


def _settings(http: int, grpc: int, metrics: int) -> Settings:
    return parse_settings(
        ["--model-repository", ".", f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}"]
    )


def test_the_http_and_metrics_ports_are_bound_and_the_grpc_port_only_checked() -> None:
    http, grpc, metrics = free_ports(3)
    ports = bind_ports(_settings(http, grpc, metrics), check_grpc=True)
    assert ports is not None
    try:
        assert ports.http is not None and ports.http.getsockname()[1] == http
        assert ports.metrics is not None and ports.metrics.getsockname()[1] == metrics
        with socket.socket() as probe:  # the gRPC port is free again for the gRPC server
            probe.bind(("127.0.0.1", grpc))
    finally:
        ports.close()
    assert ports.http is None and ports.metrics is None


@pytest.mark.parametrize("taken", ["http", "grpc", "metrics"])
def test_a_taken_port_is_an_error_naming_it_and_nothing_stays_bound(
    taken: str, caplog: pytest.LogCaptureFixture
) -> None:
    numbers = dict(zip(("http", "grpc", "metrics"), free_ports(3), strict=True))
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", numbers[taken]))
        holder.listen()
        with caplog.at_level(logging.ERROR, logger="geserve.lifecycle"):
            assert bind_ports(_settings(**numbers), check_grpc=True) is None
    assert f":{numbers[taken]}: " in caplog.text
    for name, port in numbers.items():
        if name != taken:
            with socket.socket() as probe:
                probe.bind(("0.0.0.0", port))

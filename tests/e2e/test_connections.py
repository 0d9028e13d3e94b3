"""HTTP connections against a live server: read deadlines, the connection cap, and a shutdown without resets."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from tests.support import (
    EchoLoad,
    GeserveProcess,
    connect_http,
    http_status,
    read_until_closed,
    server_pids,
    start_echo,
)

DEADLINES = ("--http-header-timeout-secs=1", "--http-body-timeout-secs=1", "--http-keepalive-timeout-secs=2")


def infer_body(values: list[float]) -> bytes:
    tensor = {"name": "INPUT0", "shape": [1, len(values)], "datatype": "FP32", "data": values}
    return json.dumps({"inputs": [tensor]}).encode()


def assert_serving(server: GeserveProcess) -> None:
    assert http_status(f"http://{server.url}/v2/health/ready") == 200


def open_descriptors(server: GeserveProcess) -> int:
    """The descriptors of the server's own processes: those that hold its connections, whichever serve them."""
    return sum(len(os.listdir(f"/proc/{pid}/fd")) for pid in server_pids(server))


def test_headers_that_trickle_in_get_408_and_the_connection_closes(
    launch: Callable[..., GeserveProcess], repository: Path
) -> None:
    server = start_echo(launch, repository, *DEADLINES)
    sock = connect_http(server)
    sock.sendall(b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: geserve\r\n")
    started = time.monotonic()
    for _ in range(20):  # one header line every 0.2 s: never finished
        time.sleep(0.2)
        try:
            sock.sendall(b"X-Slow: 1\r\n")
        except BrokenPipeError:
            break
    answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert b'{"error":"request headers did not arrive within 1 seconds"}' in answer
    assert time.monotonic() - started < 10
    assert_serving(server)


def test_a_body_that_stops_arriving_gets_408(launch: Callable[..., GeserveProcess], repository: Path) -> None:
    server = start_echo(launch, repository, *DEADLINES)
    sock = connect_http(server)
    body = infer_body([1.0, 2.0])
    head = f"POST /v2/models/echo/infer HTTP/1.1\r\nHost: geserve\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body[:10])
    answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert b'{"error":"the request body stopped arriving for 1 seconds"}' in answer
    assert_serving(server)
    assert "Traceback" not in server.log()


def test_a_body_that_stalls_after_its_request_was_answered_gets_no_second_answer(
    launch: Callable[..., GeserveProcess], repository: Path
) -> None:
    server = start_echo(launch, repository, *DEADLINES, "--http-max-input-size=1000")
    sock = connect_http(server)
    head = "POST /v2/models/echo/infer HTTP/1.1\r\nHost: geserve\r\nContent-Length: 100000\r\n\r\n"
    sock.sendall(head.encode() + b"{" * 10)  # answered 400 from the length alone; the rest never comes
    answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer
    assert answer.count(b"HTTP/1.1 ") == 1, answer  # the body deadline closes it without a 408 after the 400
    assert_serving(server)


def test_a_connection_that_sends_nothing_is_closed(launch: Callable[..., GeserveProcess], repository: Path) -> None:
    server = start_echo(launch, repository, *DEADLINES)
    assert read_until_closed(connect_http(server)) == b""
    assert_serving(server)


def test_past_the_connection_cap_a_new_connection_gets_503_and_slowloris_cannot_hold_descriptors(
    launch: Callable[..., GeserveProcess], repository: Path
) -> None:
    server = start_echo(launch, repository, *DEADLINES, "--http-max-connections=20")
    baseline = open_descriptors(server)
    held = [connect_http(server) for _ in range(20)]
    for sock in held:
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\n")  # started, never finished
    time.sleep(0.2)
    refused = [connect_http(server) for _ in range(200)]
    for sock in refused:
        answer = read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer
        assert b"retry-after: 1\r\n" in answer
        assert b'{"error":"the server has reached its limit of 20 HTTP connections; retry later"}' in answer
    # Every slow connection ends at its header deadline, so the cap frees itself.
    for sock in held:
        assert read_until_closed(sock).startswith(b"HTTP/1.1 408 ")
    assert_serving(server)
    deadline = time.monotonic() + 10
    while open_descriptors(server) > baseline + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_descriptors(server) <= baseline + 2


def test_sigterm_under_keep_alive_load_answers_every_request_it_read_and_resets_none(
    launch: Callable[..., GeserveProcess], repository: Path
) -> None:
    server = start_echo(launch, repository)
    with EchoLoad(server, threads=8) as load:
        time.sleep(1.5)
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(60)
        time.sleep(0.3)
    assert server.stop() == 0  # exited already: collects the status and closes the log
    assert load.outcomes["ok"] > 100, load.outcomes
    # Requests read before the listener closed are answered (200, or 503 once the server stops
    # admitting); everything after that is refused at connect. Nothing is reset, dropped unanswered
    # or answered wrongly.
    assert set(load.outcomes) <= {"ok", "HTTP 503", "refused"}, load.outcomes
    assert "did not stop" not in server.log()

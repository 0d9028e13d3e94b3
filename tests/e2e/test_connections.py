"""HTTP connections against a live server: read deadlines, the connection cap, and a shutdown without resets."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.support import (
    EchoLoad,
    GeserveProcess,
    binary_infer_request,
    connect_http,
    http_status,
    read_until_closed,
    server_pids,
    start_echo,
    wait_until,
    write_identity_model,
)

DEADLINES = ("--http-header-timeout-secs=1", "--http-body-timeout-secs=1", "--http-keepalive-timeout-secs=2")


def infer_body(values: list[float]) -> bytes:
    tensor = {"name": "INPUT0", "shape": [1, len(values)], "datatype": "FP32", "data": values}
    return json.dumps({"inputs": [tensor]}).encode()


def assert_serving(server: GeserveProcess) -> None:
    assert http_status(f"http://{server.url}/v2/health/ready") == 200


def open_descriptors(server: GeserveProcess) -> int:
    """The sockets of the server's own processes: those that hold its connections, whichever serve them. Other
    descriptors are left out: gRPC's core opens pollers and event descriptors of its own a while after startup."""
    count = 0
    for pid in server_pids(server):
        for name in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # closed while listed
                count += os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:")
    return count


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
    # Every slow connection ends at its header deadline, so the cap frees itself (a slot once the server has seen
    # the close it made, a moment after the client read the 408 and the end).
    for sock in held:
        assert read_until_closed(sock).startswith(b"HTTP/1.1 408 ")
    assert wait_until(lambda: http_status(f"http://{server.url}/v2/health/ready") == 200, 5)
    deadline = time.monotonic() + 10
    counts = [open_descriptors(server)]
    while counts[-1] > baseline + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
        counts.append(open_descriptors(server))
    assert counts[-1] <= baseline + 2, (baseline, counts[-5:])


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


# Bodies of both sizes: one that comes with its head, one read in place (over 16 KiB: geserve/http/direct.py).
SMALL, LARGE = np.arange(4, dtype=np.float32).reshape(1, 4), np.arange(20_000, dtype=np.float32).reshape(1, 20_000)
Response = tuple[bytes, dict[bytes, bytes], bytes]


def echo_request(data: np.ndarray, model: str = "echo", extra_headers: str = "") -> bytes:
    head, body = binary_infer_request(data, model, extra_headers)
    return head + body


def responses(received: bytes) -> list[Response]:
    """Every response in what a connection received before its close: status line, headers, body."""
    found: list[Response] = []
    while received:
        head, rest = received.split(b"\r\n\r\n", 1)
        status, *lines = head.split(b"\r\n")
        headers = {name.lower(): value.strip() for name, value in (line.split(b":", 1) for line in lines)}
        length = int(headers.get(b"content-length", b"0"))
        assert len(rest) >= length, received
        found.append((status, headers, rest[:length]))
        received = rest[length:]
    return found


def assert_echoed(response: Response, data: np.ndarray) -> None:
    status, headers, body = response
    assert status == b"HTTP/1.1 200 OK", response
    header_length = int(headers[b"inference-header-content-length"])
    np.testing.assert_array_equal(np.frombuffer(body[header_length:], dtype=np.float32), data.ravel())


def assert_refused(response: Response, message: str) -> None:
    status, headers, body = response
    assert status == b"HTTP/1.1 400 Bad Request", response
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"connection"] == b"close"
    assert json.loads(body) == {"error": message}


def server_holds(server: GeserveProcess, client_port: int) -> bool:
    """Whether the server's end of the loopback connection from `client_port` is still open."""
    ends = f":{server.http_port:04X} 0100007F:{client_port:04X} "
    return any(ends in line for line in Path("/proc/net/tcp").read_text().splitlines())


def assert_infers(server: GeserveProcess) -> None:
    """A good request on a new connection is answered."""
    sock = connect_http(server)
    sock.sendall(echo_request(SMALL, extra_headers="Connection: close\r\n"))
    [answer] = responses(read_until_closed(sock))
    assert_echoed(answer, SMALL)


AFTER_A_REQUEST = (
    "the bytes after the previous request on this connection are not an HTTP/1.1 request "
    "(a request body longer than its Content-Length runs into them)"
)


@pytest.mark.parametrize("data", [SMALL, LARGE], ids=["small", "read-in-place"])
def test_a_body_longer_than_its_content_length_gets_its_answer_then_400(
    launch: Callable[..., GeserveProcess], repository: Path, data: np.ndarray
) -> None:
    server = start_echo(launch, repository)
    sock = connect_http(server)
    sock.sendall(echo_request(data) + b"\x00garbage that is no request\r\n\r\n")
    first, second = responses(read_until_closed(sock))
    assert_echoed(first, data)
    assert b"connection" not in first[1]  # the connection was still open for what followed
    assert_refused(second, AFTER_A_REQUEST)
    # Bytes that are not HTTP on a connection of their own.
    sock = connect_http(server)
    sock.sendall(b"\x00garbage\r\n\r\n")
    [answer] = responses(read_until_closed(sock))
    assert_refused(answer, "the request is not valid HTTP/1.1")
    assert_infers(server)
    assert "Traceback" not in server.log()


@pytest.mark.parametrize("data", [SMALL, LARGE], ids=["small", "read-in-place"])
def test_a_body_shorter_than_its_content_length_then_a_half_close_gets_400_at_once(
    launch: Callable[..., GeserveProcess], repository: Path, data: np.ndarray
) -> None:
    server = start_echo(launch, repository, "--http-body-timeout-secs=30")
    request = echo_request(data)
    sock = connect_http(server)
    sock.sendall(request[:-5])
    sock.shutdown(socket.SHUT_WR)
    started = time.monotonic()
    [answer] = responses(read_until_closed(sock))
    assert time.monotonic() - started < 5  # not at the body deadline
    _, body = binary_infer_request(data)
    assert_refused(
        answer,
        "the request body is shorter than its Content-Length: the client closed its side of the connection "
        f"after {len(body) - 5} of {len(body)} bytes",
    )
    # Within a head: as unfinished.
    sock = connect_http(server)
    sock.sendall(request[:30])
    sock.shutdown(socket.SHUT_WR)
    [answer] = responses(read_until_closed(sock))
    assert_refused(answer, "the client closed its side of the connection within a request head")
    assert_infers(server)
    assert "Traceback" not in server.log()


@pytest.mark.parametrize("data", [SMALL, LARGE], ids=["small", "read-in-place"])
def test_a_client_that_half_closes_after_its_request_gets_the_answer(
    launch: Callable[..., GeserveProcess], repository: Path, data: np.ndarray
) -> None:
    server = start_echo(launch, repository)
    sock = connect_http(server)
    sock.sendall(echo_request(data))
    sock.shutdown(socket.SHUT_WR)
    received = read_until_closed(sock)
    # A request that takes longer than HALF_CLOSE_PROBE_S (a loaded machine) is answered after a 100 Continue.
    [answer] = responses(received.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n"))
    assert_echoed(answer, data)
    # The answer says `connection: close` when the FIN was read before it was written; a client delayed between
    # its request and its FIN (a loaded machine) may be answered first, without it. Either way the server closed
    # the connection after the FIN: `read_until_closed` returned.
    assert answer[1].get(b"connection", b"close") == b"close"
    assert_infers(server)
    assert "Traceback" not in server.log()


def test_a_half_closed_client_whose_request_runs_long_is_asked_with_100_continue_and_answered(
    launch: Callable[..., GeserveProcess], repository: Path
) -> None:
    write_identity_model(repository, "slow", delay_ms=1500)
    server = start_echo(launch, repository)
    sock = connect_http(server)
    sock.sendall(echo_request(SMALL, "slow"))
    sock.shutdown(socket.SHUT_WR)
    received = read_until_closed(sock)
    assert received.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"), received
    [answer] = responses(received.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n"))
    assert_echoed(answer, SMALL)
    assert "Traceback" not in server.log()


def test_a_client_that_closes_while_its_request_runs_is_dropped_before_the_answer(
    launch: Callable[..., GeserveProcess], repository: Path
) -> None:
    """TCP shows a close as the same FIN as a half-close: the 100 Continue draws the closed socket's reset."""
    write_identity_model(repository, "slow", delay_ms=5000)
    server = start_echo(launch, repository)
    sock = connect_http(server)
    client_port = sock.getsockname()[1]
    sock.sendall(echo_request(SMALL, "slow"))
    time.sleep(0.2)
    sock.close()
    started = time.monotonic()
    assert wait_until(lambda: not server_holds(server, client_port), timeout_s=10)
    assert time.monotonic() - started < 3  # the answer would have come after 5 s
    assert_infers(server)
    assert "Traceback" not in server.log()


def test_pipelined_requests_are_answered_in_order_then_what_follows_them(
    launch: Callable[..., GeserveProcess], repository: Path
) -> None:
    server = start_echo(launch, repository)
    sent = [SMALL, LARGE, SMALL * 2]
    pipelined = b"".join(echo_request(data) for data in sent)
    # On a connection kept open: every answer, in order.
    sock = connect_http(server)
    sock.sendall(pipelined + echo_request(SMALL, extra_headers="Connection: close\r\n"))
    answers = responses(read_until_closed(sock))
    for answer, data in zip(answers, [*sent, SMALL], strict=True):
        assert_echoed(answer, data)
    # Then a half-close: every answer, the last one closing.
    sock = connect_http(server)
    sock.sendall(pipelined)
    sock.shutdown(socket.SHUT_WR)
    answers = responses(read_until_closed(sock).replace(b"HTTP/1.1 100 Continue\r\n\r\n", b""))
    for answer, data in zip(answers, sent, strict=True):
        assert_echoed(answer, data)
    assert answers[-1][1][b"connection"] == b"close"
    # Then bytes that are not HTTP: every answer, then 400.
    sock = connect_http(server)
    sock.sendall(pipelined + b"\x00garbage\r\n\r\n")
    *answers, refusal = responses(read_until_closed(sock))
    for answer, data in zip(answers, sent, strict=True):
        assert_echoed(answer, data)
    assert_refused(refusal, AFTER_A_REQUEST)
    assert_infers(server)
    assert "Traceback" not in server.log()


def test_a_head_too_large_behind_a_running_request_is_refused_after_its_answer(
    launch: Callable[..., GeserveProcess], repository: Path
) -> None:
    write_identity_model(repository, "slow", delay_ms=500)
    server = start_echo(launch, repository, "--http-max-header-size=16384")
    sock = connect_http(server)
    sock.sendall(echo_request(SMALL, "slow"))
    time.sleep(0.1)  # running
    sock.sendall(f"GET /v2/health/ready HTTP/1.1\r\nX-Big: {'a' * 20000}\r\n\r\n".encode())
    first, second = responses(read_until_closed(sock))
    assert_echoed(first, SMALL)
    assert second[0] == b"HTTP/1.1 431 Request Header Fields Too Large", second
    assert_infers(server)
    assert "Traceback" not in server.log()

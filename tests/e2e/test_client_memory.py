"""What one client can make the server hold: HTTP request heads are capped, unread responses are dropped, BYTES
inputs have a bounded element count."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import (
    GeserveProcess,
    binary_infer_request,
    connect_http,
    read_until_closed,
    start_echo,
    write_identity_model,
)

pytestmark = pytest.mark.e2e

Launch = Callable[..., GeserveProcess]
# 8 MiB of FP32 values each way: far more than the kernel's socket buffers hold for a client that does not read.
ELEMENTS = 1 << 21


def good_request(server: GeserveProcess) -> None:
    data = np.arange(16, dtype=np.float32).reshape(1, 16)
    tensor = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    tensor.set_data_from_numpy(data)
    result = httpclient.InferenceServerClient(server.url).infer("echo", [tensor])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)


def head_of(extra: str) -> bytes:
    return f"GET /v2/health/ready HTTP/1.1\r\nHost: geserve\r\n{extra}\r\n".encode()


def test_a_request_head_over_the_cap_gets_431_and_the_server_serves_on(launch: Launch, tmp_path: Path) -> None:
    server = start_echo(launch, tmp_path, "--http-max-header-size=16384")
    sock = connect_http(server)
    sock.sendall(head_of(f"X-Big: {'a' * 12000}\r\n"))  # within the cap: answered
    assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
    sock.close()
    for heads in (
        head_of(f"X-Big: {'a' * (200 << 10)}\r\n"),  # one header of 200 KiB
        head_of("".join(f"X-{index}: 1\r\n" for index in range(5000))),  # many small ones
        b"GET /" + b"a" * (100 << 10) + b" HTTP/1.1\r\n",  # a request line that never ends
    ):
        sock = connect_http(server)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # answered before all of it was taken
            sock.sendall(heads)
        answer = read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), answer[:200]
        assert b"the request line and headers exceed 16384 bytes; see --http-max-header-size" in answer
        good_request(server)
    assert "Traceback" not in server.log()


def large_infer(extra_headers: str = "") -> bytes:
    return b"".join(binary_infer_request(np.ones((1, ELEMENTS), dtype=np.float32), extra_headers=extra_headers))


def never_reading(server: GeserveProcess, extra_headers: str = "") -> socket.socket:
    """A connection whose client asks for 8 MiB and reads none of it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(15)
    sock.connect(("127.0.0.1", server.http_port))
    sock.sendall(large_infer(extra_headers))
    return sock


def wait_for_log(server: GeserveProcess, text: str, times: int = 1, timeout_s: float = 20.0) -> None:
    give_up_at = time.monotonic() + timeout_s
    while server.log().count(text) < times:
        assert time.monotonic() < give_up_at, f"{text!r} never logged:\n{server.log()[-3000:]}"
        time.sleep(0.1)


def assert_dropped(sock: socket.socket) -> None:
    """The server closed the connection before the client had read the response."""
    received = 0
    try:
        while chunk := sock.recv(1 << 20):
            received += len(chunk)
    except ConnectionResetError:
        pass  # the close came as a reset: the server had unsent bytes left when it dropped them
    sock.close()
    assert received < ELEMENTS * 4


def assert_an_unread_response_is_dropped(
    launch: Launch, tmp_path: Path, flag: str, logged: str, extra_headers: str = ""
) -> GeserveProcess:
    """On an echo server with `flag`, a client that reads none of its response is dropped, the server logging
    `logged`, and the next client is served; the server, for a test to go on with."""
    server = start_echo(launch, tmp_path, flag)
    sock = never_reading(server, extra_headers)
    wait_for_log(server, logged)
    assert_dropped(sock)
    good_request(server)
    return server


def test_a_response_left_unread_past_the_send_timeout_closes_its_connection(launch: Launch, tmp_path: Path) -> None:
    server = assert_an_unread_response_is_dropped(
        launch, tmp_path, "--http-send-timeout-secs=1", "response bytes went unread for 1 seconds"
    )
    # A client that reads, however slowly, is not cut off.
    sock = never_reading(server)
    received = 0
    while received < ELEMENTS * 4:
        chunk = sock.recv(1 << 16)
        assert chunk, "the server closed the connection of a client that reads"
        received += len(chunk)
        time.sleep(0.002)
    sock.close()
    assert "Traceback" not in server.log()


def test_a_response_left_unread_after_the_server_closed_its_side_is_dropped_too(launch: Launch, tmp_path: Path) -> None:
    """`Connection: close`: answered, then closed once LINGER_S (2 s) passed; a closed transport would still wait
    for its queued bytes forever, and a send timeout beyond the linger must end it."""
    assert_an_unread_response_is_dropped(
        launch,
        tmp_path,
        "--http-send-timeout-secs=3",
        "response bytes went unread for 3 seconds",
        "Connection: close\r\n",
    )


def test_unsent_response_bytes_over_the_cap_close_the_connection(launch: Launch, tmp_path: Path) -> None:
    server = assert_an_unread_response_is_dropped(
        launch, tmp_path, "--http-max-unsent-bytes=1048576", "over --http-max-unsent-bytes"
    )
    assert "Traceback" not in server.log()


def test_a_bytes_input_over_the_element_limit_is_refused_over_both_protocols(launch: Launch, tmp_path: Path) -> None:
    write_identity_model(tmp_path, "strings", dtype="TYPE_STRING", dims="-1", max_batch_size=0)
    server = start_echo(launch, tmp_path, "--max-bytes-tensor-elements=1000")
    refusal = (
        "inference input 'INPUT0' for model 'strings' has 1001 BYTES elements, more than the 1000 allowed; "
        "see --max-bytes-tensor-elements"
    )
    for client_module, url in ((httpclient, server.url), (grpcclient, f"127.0.0.1:{server.grpc_port}")):
        client = client_module.InferenceServerClient(url)
        for count in (1001, 1000):
            data = np.array([b"a"] * count, dtype=object)
            tensor = client_module.InferInput("INPUT0", [count], "BYTES")
            tensor.set_data_from_numpy(data)
            if count > 1000:
                with pytest.raises(InferenceServerException) as error:
                    client.infer("strings", [tensor])
                assert refusal in str(error.value.message())
            else:
                assert list(client.infer("strings", [tensor]).as_numpy("OUTPUT0")) == list(data)
        good_request(server)
    assert "Traceback" not in server.log()

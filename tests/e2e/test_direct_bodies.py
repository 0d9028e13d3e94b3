"""Large infer bodies, read straight into one buffer: every way such a body can arrive, answered right."""

from __future__ import annotations

import concurrent.futures
import gzip
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from tests.support import GeserveProcess, binary_infer_request, connect_http, http_status, read_until_closed, start_echo

# 64k FP32 values: 256 KiB of tensor data, far above the size from which bodies are read in place.
ELEMENTS = 1 << 16


def values(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(ELEMENTS, dtype=np.float32)


def binary_request(data: np.ndarray, extra_headers: str = "") -> tuple[bytes, bytes]:
    """The head and the body of a binary-tensor infer request for `echo`."""
    return binary_infer_request(data.reshape(1, -1), extra_headers=extra_headers)


class ResponseReader:
    """Reads HTTP/1.1 responses one after the other from a keep-alive connection."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    def _fill(self) -> None:
        chunk = self._sock.recv(1 << 20)
        assert chunk, "the server closed the connection"
        self._buffer += chunk

    def head(self) -> tuple[int, dict[str, str]]:
        while b"\r\n\r\n" not in self._buffer:
            self._fill()
        head, self._buffer = self._buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
        return int(status_line.split()[1]), headers

    def response(self) -> tuple[int, dict[str, str], bytes]:
        status, headers = self.head()
        length = int(headers["content-length"])
        while len(self._buffer) < length:
            self._fill()
        body, self._buffer = self._buffer[:length], self._buffer[length:]
        return status, headers, body


def output_of(headers: dict[str, str], body: bytes) -> np.ndarray:
    header_length = int(headers["inference-header-content-length"])
    return np.frombuffer(body[header_length:], dtype=np.float32)


def assert_echoed(response: tuple[int, dict[str, str], bytes], data: np.ndarray) -> None:
    status, headers, body = response
    assert status == 200, body[:300]
    np.testing.assert_array_equal(output_of(headers, body), data)


def assert_serving(server: GeserveProcess) -> None:
    assert http_status(f"http://{server.url}/v2/health/ready") == 200
    with httpclient.InferenceServerClient(server.url) as client:
        data = values(99)
        tensor = httpclient.InferInput("INPUT0", [1, data.size], "FP32")
        tensor.set_data_from_numpy(data[None, :])
        np.testing.assert_array_equal(client.infer("echo", [tensor]).as_numpy("OUTPUT0")[0], data)


def test_a_body_that_trickles_in_is_answered_with_its_own_values(
    launch: Callable[..., GeserveProcess], repository: Path
) -> None:
    server = start_echo(launch, repository)
    sock = connect_http(server)
    data = values(1)
    head, body = binary_request(data)
    sock.sendall(head + body[:1000])  # the head and the start of the body in one read
    for offset in range(1000, len(body), 32 << 10):
        time.sleep(0.01)
        sock.sendall(body[offset : offset + (32 << 10)])
    assert_echoed(ResponseReader(sock).response(), data)
    sock.close()
    assert_serving(server)


def test_large_and_small_requests_follow_each_other_on_one_connection(
    launch: Callable[..., GeserveProcess], repository: Path
) -> None:
    server = start_echo(launch, repository)
    sock = connect_http(server)
    reader = ResponseReader(sock)
    for seed in range(3):
        data = values(seed)
        head, body = binary_request(data)
        sock.sendall(head + body)
        assert_echoed(reader.response(), data)
    small = np.arange(4, dtype=np.float32)
    head, body = binary_request(small)
    sock.sendall(head + body)
    assert_echoed(reader.response(), small)
    # Pipelined: a large request and a small one in the same send, answered in order.
    large = values(7)
    first, second = binary_request(large), binary_request(small)
    sock.sendall(first[0] + first[1] + second[0] + second[1])
    assert_echoed(reader.response(), large)
    assert_echoed(reader.response(), small)
    sock.close()
    assert_serving(server)


def test_a_client_that_expects_100_continue_gets_it_before_sending_the_body(
    launch: Callable[..., GeserveProcess], repository: Path
) -> None:
    server = start_echo(launch, repository)
    sock = connect_http(server)
    reader = ResponseReader(sock)
    data = values(2)
    head, body = binary_request(data, "Expect: 100-continue\r\n")
    sock.sendall(head)
    status, _ = reader.head()
    assert status == 100
    sock.sendall(body)
    assert_echoed(reader.response(), data)
    sock.close()
    assert_serving(server)


def test_a_compressed_large_body_is_answered(launch: Callable[..., GeserveProcess], repository: Path) -> None:
    server = start_echo(launch, repository)
    sock = connect_http(server)
    data = values(6)
    head, body = binary_request(data)
    packed = gzip.compress(body, compresslevel=1)
    assert len(packed) > 16 << 10
    head = head.replace(f"Content-Length: {len(body)}".encode(), f"Content-Length: {len(packed)}".encode())
    sock.sendall(head[:-2] + b"Content-Encoding: gzip\r\n\r\n" + packed)
    assert_echoed(ResponseReader(sock).response(), data)
    sock.close()


def test_a_client_that_leaves_mid_body_changes_nothing(launch: Callable[..., GeserveProcess], repository: Path) -> None:
    server = start_echo(launch, repository)
    for cut in (1000, 100_000):
        sock = connect_http(server)
        head, body = binary_request(values(3))
        sock.sendall(head + body[:cut])
        time.sleep(0.1)
        sock.close()
    assert_serving(server)
    assert "Traceback" not in server.log()


def test_a_large_body_that_stops_arriving_gets_408(launch: Callable[..., GeserveProcess], repository: Path) -> None:
    server = start_echo(launch, repository, "--http-body-timeout-secs=1")
    sock = connect_http(server)
    head, body = binary_request(values(4))
    sock.sendall(head + body[: len(body) // 2])
    received = read_until_closed(sock)
    assert received.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), received[:300]
    assert b'{"error":"the request body stopped arriving for 1 seconds"}' in received
    assert_serving(server)


def test_a_body_shorter_than_the_tensors_it_declares_is_refused(
    launch: Callable[..., GeserveProcess], repository: Path
) -> None:
    server = start_echo(launch, repository)
    sock = connect_http(server)
    data = values(5)
    head, body = binary_request(data)
    short = body[: -(4 << 10)]
    head = head.replace(f"Content-Length: {len(body)}".encode(), f"Content-Length: {len(short)}".encode())
    sock.sendall(head + short)
    status, _, answer = ResponseReader(sock).response()
    assert status == 400, answer
    assert b"unexpected end of binary data for input 'INPUT0'" in answer, answer
    sock.close()
    assert_serving(server)


def test_concurrent_clients_each_get_their_own_large_tensor_back(
    launch: Callable[..., GeserveProcess], repository: Path
) -> None:
    server = start_echo(launch, repository)

    def client_run(client_index: int) -> int:
        checked = 0
        with httpclient.InferenceServerClient(server.url) as client:
            for request in range(8):
                data = values(1000 * client_index + request)
                tensor = httpclient.InferInput("INPUT0", [1, data.size], "FP32")
                tensor.set_data_from_numpy(data[None, :], binary_data=True)
                result = client.infer("echo", [tensor], outputs=[httpclient.InferRequestedOutput("OUTPUT0")])
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0")[0], data)
                checked += 1
        return checked

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(client_run, range(8))) == 64


def test_bodies_around_every_read_size_split_anywhere_are_answered_in_order(
    launch: Callable[..., GeserveProcess], repository: Path
) -> None:
    """Sizes on both sides of the in-place threshold and the scratch read, sent in random pieces, one or two
    requests per send, over one keep-alive connection: each answer carries its own request's values."""
    server = start_echo(launch, repository)
    rng = np.random.default_rng(11)
    sock = connect_http(server)
    reader = ResponseReader(sock)
    sent: list[np.ndarray] = []
    stream = b""
    for index in range(24):
        elements = int(rng.choice([1000, 4090, 4100, 15_000, 16_500, 40_000, 70_000]))
        data = rng.standard_normal(elements, dtype=np.float32)
        head, body = binary_request(data)
        stream += head + body
        sent.append(data)
        if index % 2 == 0:
            continue  # two requests go out together (pipelined)
        while stream:
            piece = int(rng.integers(1, 100_000))
            sock.sendall(stream[:piece])
            stream = stream[piece:]
        for data in sent:
            assert_echoed(reader.response(), data)
        sent = []
    sock.close()
    assert_serving(server)

"""HTTP/1.1 connections: read deadlines, a connection cap, closes that never reset a request, and lost clients."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, cast

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from geserve.codecs.digits import decimal_value
from geserve.http.direct import (
    BODY_EXTENSION,
    DIRECT_MIN_BYTES,
    BodyAllocator,
    BufferedReader,
    DirectBody,
    InPlaceBodies,
    heap_body,
)
from geserve.http.disconnect import DISCONNECT_EXTENSION, ClientWatch
from geserve.http.errors import raw_error_response
from geserve.settings import HttpSettings

logger = logging.getLogger(__name__)

# Once the server has sent its FIN, how long it keeps reading (and dropping) what the client still
# sends. Closing a socket with unread bytes makes the kernel answer them with a reset, which the
# client sees as ECONNRESET instead of a clean end of the connection.
LINGER_S = 2.0
# On shutdown, how long an idle keep-alive connection stays open for a request already on its way.
SHUTDOWN_GRACE_S = 0.5
# Warnings about refused or timed-out connections are summed up at most this often.
WARN_INTERVAL_S = 60.0
# After a client's FIN, how long a request still running waits before the client is asked whether it still reads
# (see `_probe_half_closed`), and then how often the answer is looked for.
HALF_CLOSE_PROBE_S = 0.25
# The question: an interim response, which HTTP/1.1 clients skip even unasked (RFC 9110, section 15.2).
INTERIM_RESPONSE = b"HTTP/1.1 100 Continue\r\n\r\n"


def default_max_connections() -> int:
    """Half the process's file-descriptor limit: the other half stays for models, workers and gRPC."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(soft // 2, 1) if soft != resource.RLIM_INFINITY else 1 << 16


class _Tally:
    """Counts refused and timed-out connections; logs a summary now and then, never one line each."""

    def __init__(self, listener: str) -> None:
        self.listener = listener
        self.counts: dict[str, int] = {}
        self._last_warning = float("-inf")

    def add(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        now = time.monotonic()
        if now - self._last_warning >= WARN_INTERVAL_S:
            self._last_warning = now
            summary = ", ".join(f"{count} {name}" for name, count in sorted(self.counts.items()))
            logger.warning("%s: closed slow or excess connections so far: %s", self.listener, summary)


class _GentleTransport:
    """The transport as uvicorn's request cycles see it: their close() lingers instead of resetting."""

    __slots__ = ("_protocol", "_raw")

    def __init__(self, raw: asyncio.Transport, protocol: GuardedHttpProtocol) -> None:
        self._raw = raw
        self._protocol = protocol

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._raw.write(data)
        self._protocol.check_unsent()

    def close(self) -> None:
        self._protocol.close_gently()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._raw.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class OpenConnections(Protocol):
    """How many HTTP connections the server holds open, where several processes accept them."""

    def total(self, own: int) -> int:
        """The server's count, this process holding `own`."""
        ...

    def update(self, own: int) -> None:
        """This process now holds `own`."""
        ...


class ThisProcessOnly:
    """One process accepts every connection: its own count is the server's."""

    def total(self, own: int) -> int:
        return own

    def update(self, own: int) -> None:
        pass


class Listening(Protocol):
    """Whether the listening socket, which several processes may hold, is still open in any of them."""

    def opened(self) -> None:
        """This process listens."""
        ...

    def closed(self) -> None:
        """This process has closed its listening socket."""
        ...

    def closed_everywhere(self) -> bool: ...


class ListeningHere:
    """One process holds the listening socket: closed here is closed everywhere."""

    def __init__(self) -> None:
        self._open = False

    def opened(self) -> None:
        self._open = True

    def closed(self) -> None:
        self._open = False

    def closed_everywhere(self) -> bool:
        return not self._open


@dataclass(frozen=True, slots=True)
class TransportHooks:
    """What the transport of one of several protocol processes shares with the others: where bodies read in
    place go (their request arena), the count of open connections the cap applies to, and whether the listening
    socket is still open in another of them."""

    allocate_body: BodyAllocator = heap_body
    connections: OpenConnections = field(default_factory=ThisProcessOnly)
    listening: Listening = field(default_factory=ListeningHere)


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines, a connection cap and lingering closes; an infer request's
    body of known length is read straight into one buffer (`BufferedReader` feeds this protocol).

    Subclassed per listener by `protocol_for`, which binds the limits, the set of admitted connections and
    the app's choice of the requests whose bodies are read in place.
    """

    limits: ClassVar[HttpSettings] = HttpSettings()
    max_connections: ClassVar[int] = 1
    reads_in_place: ClassVar[staticmethod[[str, str], bool]]  # the app's InPlaceBodies
    hooks: ClassVar[TransportHooks]
    admitted: ClassVar[set[GuardedHttpProtocol]]
    tally: ClassVar[_Tally]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lingering = False
        self._raw: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._reading_head = False  # between a request's first byte and the end of its headers
        self._last_body_at = 0.0
        self._shutting_down = False
        self._linger_timer: asyncio.TimerHandle | None = None
        self._direct: DirectBody | None = None  # the body being read straight into its buffer
        self._head_bytes: int | None = None  # bytes of the request head so far, while one is being read
        self._send_deadline: asyncio.TimerHandle | None = None  # armed while writing is paused
        self._unsent_at_check = 0  # what was waiting to be sent when the send deadline was last armed
        self._client = ClientWatch()  # a running infer request learns through it that the client went away
        # Once no more requests are read (bytes that are not HTTP, a head too large or too slow, the client's FIN),
        # those read whole are answered first, then `_refusal` (the error for what could not be read, if any),
        # then the connection closes: an answer written at once would land in the middle of one in progress.
        self._done_reading = False
        self._refusal: bytes | None = None
        self._parsing: Literal["head", "body"] | None = None  # where the parser is within a request
        self._body_declared: int | None = None  # the Content-Length of the body being read, if it has one
        self._body_read = 0
        self._serving: RequestResponseCycle | None = None  # the request answered now; later ones wait in the pipeline
        self._eof = False  # the client's FIN has arrived: it sends nothing more
        self._probe_timer: asyncio.TimerHandle | None = None
        self._probed = False

    # -- connection ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._raw = transport
        self.transport = cast(asyncio.Transport, _GentleTransport(transport, self))
        if self.hooks.connections.total(len(self.admitted)) >= self.max_connections:
            self.tally.add("over the connection cap")
            message = f"the server has reached its limit of {self.max_connections} HTTP connections; retry later"
            transport.write(raw_error_response(503, message, (b"retry-after", b"1")))
            self.close_gently()
            return
        self.admitted.add(self)
        self.hooks.connections.update(len(self.admitted))
        # uvicorn arms its keep-alive timer only after a response; a connection that never sends is idle too.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._abandon_direct()
        if self.cycle is not None and not self.cycle.response_complete:
            self._client.lost()  # its request is cancelled in the core, and in the model that runs it
        self.admitted.discard(self)
        self.hooks.connections.update(len(self.admitted))
        self._cancel_deadline()
        self._cancel_send_deadline()
        self._cancel_probe()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        self.lingering = self._done_reading = True  # nothing more is read or written
        super().connection_lost(exc)

    def eof_received(self) -> bool:  # type: ignore[override]
        """The client's FIN: it sends nothing more, and may still read (a half-close) or not (a close; TCP tells
        them apart only once something is sent, see `_probe_half_closed`). uvicorn's answer, closing the
        transport, would drop the answers of requests it sent whole: they are still answered, an unfinished
        request gets 400, and then the connection closes. True keeps the transport open for writing."""
        self._eof = True
        if self.lingering:
            return False  # our FIN is out too: the connection is over
        if not self._done_reading:
            refusal = None
            if self._parsing == "head":
                refusal = raw_error_response(400, "the client closed its side of the connection within a request head")
            elif self._parsing == "body":
                refusal = raw_error_response(400, self._body_cut_short())
            self._stop_reading(refusal)
        if not self.lingering:  # requests are still being answered
            if self._refusal is None and self.cycle is not None:
                self.cycle.keep_alive = False  # the last answer says `connection: close`, and closes
            self._probe_timer = self.loop.call_later(HALF_CLOSE_PROBE_S, self._probe_half_closed)
        return True

    def _body_cut_short(self) -> str:
        declared = self._body_declared
        if declared is None:
            return "the client closed its side of the connection before the last chunk of the request body"
        return (
            "the request body is shorter than its Content-Length: the client closed its side of the connection "
            f"after {self._body_read} of {declared} bytes"
        )

    def data_received(self, data: bytes) -> None:
        if self._done_reading:
            return  # after our FIN, or before it while earlier requests are answered: read only to drop it
        if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
            # The first byte of a request, even bytes the parser skips (blank lines), starts the header clock.
            self._reading_head = True
            self._head_bytes = 0
            self._deadline = self.loop.call_later(self.limits.header_timeout_s, self._headers_too_slow)
        if self._head_bytes is not None:
            self._head_bytes += len(data)
        super().data_received(data)
        # Still in a head after the whole read: all of it was head. httptools has no limit of its own (h11 has
        # h11_max_incomplete_event_size) and keeps what it parsed, so the head is bounded here, a read at a time.
        if self._head_bytes is not None and self._head_bytes > self.limits.max_header_bytes and not self._done_reading:
            self._head_too_large()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that do not parse as HTTP, which it writes at once: after a request whose
        body is longer than its Content-Length, in the middle of that request's answer (and then the answer
        fails, writing after the FIN). Here the requests before those bytes are answered first."""
        if self._done_reading:
            return  # the rest of a read after the last request read
        if self._parsing == "body":
            message = "the request body is not valid HTTP/1.1 chunked encoding"
        elif self.cycle is not None:
            message = (
                "the bytes after the previous request on this connection are not an HTTP/1.1 request "
                "(a request body longer than its Content-Length runs into them)"
            )
        else:
            message = "the request is not valid HTTP/1.1"
        self._stop_reading(raw_error_response(400, message))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._done_reading:
            return
        self._parsing = "head"
        if self._head_bytes is None:
            self._head_bytes = 0  # a request pipelined behind another: counted from the next read

    # -- requests ----------------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        if self._done_reading:
            return  # a request behind one that was refused, in the same read
        self._cancel_deadline()
        self._reading_head = False
        self._head_bytes = None
        # A head that came whole in one read was never counted there: its parsed size is.
        parsed = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if parsed > self.limits.max_header_bytes:
            self._head_too_large()  # no request cycle starts: what follows in this read is dropped
            return
        earlier = self.cycle
        super().on_headers_complete()
        if self.cycle is None or self.cycle is earlier:
            return
        self._parsing = "body"
        self._body_read = 0
        lengths = [value for name, value in self.headers if name == b"content-length"]
        self._body_declared = decimal_value(lengths[0].decode("latin-1")) if len(lengths) == 1 else None
        cast(dict[str, Any], self.scope.setdefault("extensions", {}))[DISCONNECT_EXTENSION] = self._client
        if self._shutting_down:
            self.cycle.keep_alive = False  # answered, then closed
        if self.cycle.more_body and not self.cycle.response_complete:
            self._last_body_at = self.loop.time()
            self._deadline = self.loop.call_later(self.limits.body_timeout_s, self._body_too_slow)
            self._start_direct()

    def on_body(self, body: bytes) -> None:
        if self._done_reading:
            return
        self._last_body_at = self.loop.time()
        self._body_read += len(body)
        if self._direct is None:
            super().on_body(body)
        else:
            self._direct.write(body)  # the parser reaches message complete itself

    def on_message_complete(self) -> None:
        if self._done_reading and self._direct is None:
            return  # the rest of a read after a refused head
        self._parsing = None
        self._cancel_deadline()
        direct, self._direct = self._direct, None
        if direct is not None and self.cycle is not None:
            body = direct.complete()
            if not self.cycle.response_complete:  # answered early, the body is of no more use
                self.cycle.body = body  # type: ignore[assignment]  # a fallback receive() copies it
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._release_body()
        super().on_response_complete()  # starts the next request of the pipeline, if one waits
        self._finish_if_answered()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._serving = cycle
        super()._start_asgi_task(cycle, app)

    def _release_body(self) -> None:
        """Once a request is answered, nothing of the connection holds its body read in place: the protocol
        keeps its last scope and cycle until the next request, which an idle keep-alive client may never send."""
        cycle = self.cycle
        if cycle is None or not cycle.response_complete:
            return  # a pipelined request's cycle is current: the answered one is no longer held here
        extensions = cast(dict[str, Any], cycle.scope.get("extensions", {}))
        direct = extensions.pop(BODY_EXTENSION, None)
        if isinstance(direct, DirectBody):
            direct.release()
        if isinstance(cycle.body, memoryview):
            cycle.body = b""

    # -- bodies read in place ----------------------------------------------------------------

    def _start_direct(self) -> None:
        """A request the app reads in place, whose body has a known length within the limit: read it straight
        into one buffer (the parser never sees it) and hand it to the handler through the scope."""
        if not self.reads_in_place(self.scope["method"], self.scope["path"]):
            return
        lengths = [value for name, value in self.headers if name == b"content-length"]
        if len(lengths) != 1 or any(name == b"transfer-encoding" for name, _ in self.headers):
            return
        length = lengths[0].decode("latin-1")
        size = decimal_value(length)
        if size is None or not DIRECT_MIN_BYTES <= size <= self.limits.max_input_size:
            return
        assert self.cycle is not None
        # Weakly: the cycle's scope holds the body, which holds this function; a strong reference here would make
        # a cycle that keeps the whole body until the collector's next full pass.
        cycle_ref = weakref.ref(self.cycle)

        def on_read() -> None:  # what uvicorn's receive() does before it waits for the body
            cycle = cycle_ref()
            if cycle is None:
                return
            if cycle.waiting_for_100_continue and not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                cycle.waiting_for_100_continue = False
            if not cycle.response_complete:
                self.flow.resume_reading()

        self._direct = DirectBody(size, on_read, self.hooks.allocate_body)
        extensions = cast(dict[str, Any], self.scope.setdefault("extensions", {}))
        extensions[BODY_EXTENSION] = self._direct

    def direct_target(self) -> memoryview | None:
        """Where the next read goes when it is part of a body read in place."""
        if self._direct is None or self._done_reading:
            return None
        return self._direct.remaining()

    def body_received(self, nbytes: int) -> None:
        """`nbytes` of the body were read into `direct_target()`."""
        self._last_body_at = self.loop.time()
        self._body_read += nbytes
        assert self._direct is not None
        if self._direct.received(nbytes):
            # The parser still waits for the body it never saw: the next request starts on a fresh one.
            self.parser = _new_parser(self)
            self.on_message_complete()

    def _abandon_direct(self) -> None:
        direct, self._direct = self._direct, None
        if direct is not None:
            direct.abandon()

    def timeout_keep_alive_handler(self) -> None:
        self.close_gently()

    def shutdown(self) -> None:
        """Server shutdown: a request in progress is answered and then closed; an idle connection gets a
        moment for a request already on its way, then a lingering close."""
        self._shutting_down = True
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
        else:
            self.loop.call_later(SHUTDOWN_GRACE_S, self._close_if_idle)

    def _close_if_idle(self) -> None:
        if not self._reading_head and (self.cycle is None or self.cycle.response_complete):
            self.close_gently()

    # -- deadlines ---------------------------------------------------------------------------

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_too_slow(self) -> None:
        self._deadline = None
        self.tally.add("slow request headers")
        message = f"request headers did not arrive within {self.limits.header_timeout_s:g} seconds"
        self._stop_reading(raw_error_response(408, message))

    def _body_too_slow(self) -> None:
        self._deadline = None
        silent_for = self.loop.time() - self._last_body_at
        if silent_for < self.limits.body_timeout_s:
            self._deadline = self.loop.call_later(self.limits.body_timeout_s - silent_for, self._body_too_slow)
            return
        self.tally.add("stalled request bodies")
        message = f"the request body stopped arriving for {self.limits.body_timeout_s:g} seconds"
        self._stop_reading(raw_error_response(408, message))

    def _head_too_large(self) -> None:
        self._cancel_deadline()
        self._head_bytes = None
        self.tally.add("oversized request heads")
        limit = self.limits.max_header_bytes
        message = f"the request line and headers exceed {limit} bytes; see --http-max-header-size"
        self._stop_reading(raw_error_response(431, message))

    # -- responses a client does not read ----------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_deadline is None and self._raw is not None:
            self._unsent_at_check = self._raw.get_write_buffer_size()
            self._send_deadline = self.loop.call_later(self.limits.send_timeout_s, self._send_too_slow)

    def resume_writing(self) -> None:
        self._cancel_send_deadline()
        super().resume_writing()

    def _cancel_send_deadline(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _send_too_slow(self) -> None:
        """Writing is still paused: the client read nothing of what waits for it for send_timeout_s."""
        self._send_deadline = None
        raw = self._raw
        if raw is None:
            return
        # Closing or not: a transport closed with bytes still queued waits for them to be sent, however long.
        unsent = raw.get_write_buffer_size()
        if unsent < self._unsent_at_check:  # it reads, slowly: a client on a slow link is not cut off
            self._unsent_at_check = unsent
            self._send_deadline = self.loop.call_later(self.limits.send_timeout_s, self._send_too_slow)
            return
        self._drop_unread(f"{unsent} response bytes went unread for {self.limits.send_timeout_s:g} seconds")

    def check_unsent(self) -> None:
        """After a write: more waiting to be sent than the cap closes the connection."""
        raw = self._raw
        if raw is not None and not raw.is_closing() and raw.get_write_buffer_size() > self.limits.max_unsent_bytes:
            unsent = raw.get_write_buffer_size()
            self._drop_unread(f"{unsent} response bytes wait to be sent, over --http-max-unsent-bytes")

    def _drop_unread(self, why: str) -> None:
        """Close a connection whose client does not read what it asked for: its responses would stay in memory
        for as long as it holds the connection. Nothing more can reach it, so no lingering: a reset."""
        self.tally.add("unread responses")
        logger.info("%s: closed a connection from %s: %s", self.tally.listener, _peer(self.client), why)
        self._cancel_send_deadline()
        assert self._raw is not None
        self._raw.abort()  # connection_lost follows: a request still running is cancelled there

    # -- the last request read -----------------------------------------------------------------

    def _stop_reading(self, refusal: bytes | None) -> None:
        """Read no more requests: those read whole are answered, then `refusal` (the error for what could not be
        read, if any), then the connection closes. A request whose body is cut short is never served: the refusal
        is its answer (unless its handler answered already, as it may before reading it all), and a handler
        still waiting for the body sees a disconnect."""
        self._done_reading = True
        self._cancel_deadline()
        self._reading_head = False
        self._head_bytes = None
        cycle = self.cycle
        if self._parsing == "body" and cycle is not None:
            self._abandon_direct()
            if cycle.response_started:
                refusal = None  # one answer to a request
            if not cycle.response_complete:
                self._drop(cycle)
        self._parsing = None
        self._refusal = refusal
        self._finish_if_answered()

    def _drop(self, cycle: RequestResponseCycle) -> None:
        """A request that will not be served, whether its handler runs already or it waits in the pipeline."""
        cycle.disconnected = True
        cycle.message_event.set()
        for waiting in self.pipeline:
            if waiting[0] is cycle:
                self.pipeline.remove(waiting)
                # The protocol's current cycle is the last one read: the one before it again.
                previous = self.pipeline[0][0] if self.pipeline else self._serving
                assert previous is not None  # a request waited behind it
                self.cycle = previous
                return

    def _finish_if_answered(self) -> None:
        """Once nothing is read any more and every request read is answered: the refusal, then the close."""
        if not self._done_reading or self.lingering or self.pipeline:
            return
        serving = self._serving
        if serving is not None and not serving.response_complete and not serving.disconnected:
            return
        refusal, self._refusal = self._refusal, None
        if refusal is not None and self._raw is not None:
            self._raw.write(refusal)
        self.close_gently()

    def _probe_half_closed(self) -> None:
        """A request still runs after the client's FIN. A client that only half-closed waits for its answer; one
        that closed its socket does not, and its request should be cancelled, as it is when the connection is
        lost. TCP tells them apart only once something is sent (a closed socket answers with a reset), so an
        interim response is sent, and the socket is then checked for the reset until the request is answered."""
        self._probe_timer = None
        raw, serving = self._raw, self._serving
        if raw is None or self.lingering:
            return  # all answered
        if self._probed:
            if _reset(raw):
                raw.abort()  # connection_lost cancels the request
                return
        elif serving is not None and not serving.response_started:  # an answer being written finds a reset itself
            if serving.scope["http_version"] != "1.1":
                raw.abort()  # 1xx responses are not for HTTP/1.0 clients: no way to ask, taken as gone
                return
            self._probed = True
            serving.waiting_for_100_continue = False
            raw.write(INTERIM_RESPONSE)
        self._probe_timer = self.loop.call_later(HALF_CLOSE_PROBE_S, self._probe_half_closed)

    def _cancel_probe(self) -> None:
        if self._probe_timer is not None:
            self._probe_timer.cancel()
            self._probe_timer = None

    # -- closing -----------------------------------------------------------------------------

    def close_gently(self) -> None:
        """FIN after what is queued, then read and drop until the client closes or LINGER_S passes."""
        raw = self._raw
        if raw is None or self.lingering or raw.is_closing():
            return
        self.lingering = self._done_reading = True
        self._cancel_deadline()
        self._cancel_probe()
        self._unset_keepalive_if_required()
        self.flow.resume_reading()
        if self._eof or not raw.can_write_eof():
            # After the client's FIN everything it sent has been read: a plain close (once what is queued is
            # sent) leaves the kernel nothing to reset.
            raw.close()
            return
        raw.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, raw.close)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown peer"


def _reset(raw: asyncio.Transport) -> bool:
    """Whether the peer answered with a reset what was last sent (the socket holds the error)."""
    sock = raw.get_extra_info("socket")
    if sock is None:
        return False
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)) != 0
    except OSError:
        return True


def _new_parser(protocol: HttpToolsProtocol) -> httptools.HttpRequestParser:
    parser = httptools.HttpRequestParser(protocol)
    parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn sets up its own
    return parser


def _no_bodies_in_place(method: str, path: str) -> bool:
    return False


def protocol_class(
    listener: str,
    limits: HttpSettings,
    reads_in_place: InPlaceBodies | None = None,
    hooks: TransportHooks | None = None,
) -> type[GuardedHttpProtocol]:
    """The protocol class of one listener: its own limits and its own count of admitted connections;
    `reads_in_place` says which requests' bodies go straight into one buffer (none if not given)."""
    cap = limits.max_connections or default_max_connections()
    attributes = {
        "limits": limits,
        "max_connections": cap,
        "admitted": set(),
        "tally": _Tally(listener),
        "reads_in_place": staticmethod(reads_in_place or _no_bodies_in_place),
        "hooks": hooks or TransportHooks(),
    }
    name = f"GuardedHttpProtocol[{listener}]"
    return cast(type[GuardedHttpProtocol], type(name, (GuardedHttpProtocol,), attributes))


def protocol_for(
    listener: str,
    limits: HttpSettings,
    reads_in_place: InPlaceBodies | None = None,
    hooks: TransportHooks | None = None,
) -> Callable[..., BufferedReader]:
    """What uvicorn builds each connection with, for one listener: a reader over its protocol class."""
    protocol = protocol_class(listener, limits, reads_in_place, hooks)

    def create(**arguments: Any) -> BufferedReader:
        return BufferedReader(protocol(**arguments))

    return create

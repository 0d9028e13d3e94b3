"""Request bodies read from ASGI with a size cap, and gzip/deflate both ways."""

from __future__ import annotations

import zlib
from typing import Any

from geserve.codecs.digits import decimal_over, shortened
from geserve.errors import InvalidArgumentError
from geserve.offload import COMPRESSION_BYTES, off_loop


class ClientDisconnectedError(Exception):
    """The client went away before its body arrived: nothing to answer."""


def too_large(size: int | str, limit: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"Request JSON size of {size} bytes exceeds the maximum allowed value of {limit} bytes. "
        "Use --http-max-input-size to increase the limit."
    )


async def read_body(receive: Any, declared_length: str | None, limit: int) -> bytes:
    """The whole request body as sent; bodies over `limit` bytes are refused early."""
    if declared_length is not None and decimal_over(declared_length, limit):
        raise too_large(shortened(declared_length), limit)
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnectedError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit)
        chunks.append(chunk)
        more = message.get("more_body", False)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def decoded(body: bytes | memoryview, encoding: str, limit: int) -> bytes | memoryview:
    """A body as sent, decompressed per its Content-Encoding; more than `limit` bytes decompressed are refused."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise InvalidArgumentError(f"unsupported Content-Encoding '{encoding}'; gzip and deflate are supported")
    return await off_loop(len(body), COMPRESSION_BYTES, _decompress, body, encoding, limit)


def _decompress(body: bytes | memoryview, encoding: str, limit: int) -> bytes:
    decompressor = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        data = decompressor.decompress(body, limit + 1)
    except zlib.error as error:
        raise InvalidArgumentError(f"failed to decompress the {encoding} request body: {error}") from None
    if len(data) > limit or decompressor.unconsumed_tail:
        raise too_large(len(data), limit)
    return data


def accepted_encoding(accept_encoding: str) -> str:
    accepted = accept_encoding.lower()
    for encoding in ("gzip", "deflate"):
        if encoding in accepted:
            return encoding
    return ""


async def compress(data: bytes, encoding: str) -> bytes:
    return await off_loop(len(data), COMPRESSION_BYTES, _compress, data, encoding)


def _compress(data: bytes, encoding: str) -> bytes:
    compressor = zlib.compressobj(wbits=31 if encoding == "gzip" else 15)
    return compressor.compress(data) + compressor.flush()

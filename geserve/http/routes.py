"""HTTP handlers for health, metadata, config and infer, calling InferenceService."""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.exceptions import HTTPException
from starlette.responses import Response

from geserve.core.service import InferenceService
from geserve.errors import InvalidArgumentError
from geserve.http import binary
from geserve.repository.config import config_to_json
from geserve.types import ModelMetadata

# Above this size, (de)compression runs on a thread so the event loop keeps serving.
_OFFLOAD_BYTES = 1 << 16


def _json(content: Any) -> Response:
    return Response(orjson.dumps(content), media_type="application/json")


def _version(version: str | None) -> str:
    # Triton's route regex only matches numeric versions; anything else is an unknown path.
    if version is None:
        return ""
    if not version.isdigit():
        raise HTTPException(404, "Not Found")
    return version


def _metadata_json(metadata: ModelMetadata) -> dict[str, Any]:
    return {
        "name": metadata.name,
        "versions": list(metadata.versions),
        "platform": metadata.platform,
        "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in metadata.inputs],
        "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in metadata.outputs],
    }


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, decompressed; bodies over `limit` bytes (either way) are refused early."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise InvalidArgumentError(f"unsupported Content-Encoding '{encoding}'; gzip and deflate are supported")
    if len(body) > _OFFLOAD_BYTES:
        return await asyncio.to_thread(_decompress, body, encoding, limit)
    return _decompress(body, encoding, limit)


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    decompressor = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        data = decompressor.decompress(body, limit + 1)
    except zlib.error as error:
        raise InvalidArgumentError(f"failed to decompress the {encoding} request body: {error}") from None
    if len(data) > limit or decompressor.unconsumed_tail:
        raise _too_large(len(data), limit)
    return data


def _too_large(size: int, limit: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"Request JSON size of {size} bytes exceeds the maximum allowed value of {limit} bytes. "
        "Use --http-max-input-size to increase the limit."
    )


def _accepted_encoding(request: Request) -> str:
    accepted = request.headers.get("accept-encoding", "").lower()
    for encoding in ("gzip", "deflate"):
        if encoding in accepted:
            return encoding
    return ""


def _compress(data: bytes, encoding: str) -> bytes:
    compressor = zlib.compressobj(wbits=31 if encoding == "gzip" else 15)
    return compressor.compress(data) + compressor.flush()


def build_router(service: InferenceService, max_input_size: int) -> APIRouter:
    """All v2 routes of this slice, bound to one service."""
    router = APIRouter()

    @router.get("/v2/health/live")
    async def health_live() -> Response:
        return Response(status_code=200 if service.live else 400)

    @router.get("/v2/health/ready")
    async def health_ready() -> Response:
        return Response(status_code=200 if service.ready else 400)

    @router.get("/v2")
    async def server_metadata() -> Response:
        name, version, extensions = service.server_metadata()
        return _json({"name": name, "version": version, "extensions": list(extensions)})

    # Matched before the model routes, as in Triton: "stats" is no model name here.
    @router.get("/v2/models/stats")
    async def all_statistics() -> Response:
        return _json({"model_stats": service.statistics()})

    @router.get("/v2/models/{model_name}/stats")
    @router.get("/v2/models/{model_name}/versions/{version}/stats")
    async def model_statistics(model_name: str, version: str | None = None) -> Response:
        return _json({"model_stats": service.statistics(model_name, _version(version))})

    @router.get("/v2/models/{model_name}")
    @router.get("/v2/models/{model_name}/versions/{version}")
    async def model_metadata(model_name: str, version: str | None = None) -> Response:
        return _json(_metadata_json(service.model_metadata(model_name, _version(version))))

    @router.get("/v2/models/{model_name}/ready")
    @router.get("/v2/models/{model_name}/versions/{version}/ready")
    async def model_ready(model_name: str, version: str | None = None) -> Response:
        if service.model_ready(model_name, _version(version)):
            return Response(status_code=200)
        raise InvalidArgumentError("Model version not ready")

    @router.get("/v2/models/{model_name}/config")
    @router.get("/v2/models/{model_name}/versions/{version}/config")
    async def model_config(model_name: str, version: str | None = None) -> Response:
        return _json(config_to_json(service.model_config(model_name, _version(version))))

    @router.post("/v2/models/{model_name}/infer")
    @router.post("/v2/models/{model_name}/versions/{version}/infer")
    async def infer(request: Request, model_name: str, version: str | None = None) -> Response:
        model_version = _version(version)
        body = await read_body(request, max_input_size)
        header_length = request.headers.get(binary.HEADER_LENGTH)
        view = memoryview(body)
        if header_length is None:
            header_size = len(body)
        elif not header_length.isdigit() or int(header_length) > len(body):
            raise InvalidArgumentError(
                f"inference header size should be in range (0, {len(body)}), got: {header_length}"
            )
        else:
            header_size = int(header_length)
        if header_size == 0 and header_length is not None:
            model = service.model_version(model_name, model_version)
            infer_request = binary.decode_raw_request(view, model, model_version)
            encoding = binary.ALL_BINARY
        else:
            header = binary.loads(view[:header_size])
            infer_request, encoding = binary.decode_request(header, view[header_size:], model_name, model_version)
        response = await service.infer(infer_request)
        json_header, blobs = binary.encode_response(response, encoding)
        headers = {}
        if blobs:
            content = b"".join((json_header, *blobs))
            headers[binary.HEADER_LENGTH] = str(len(json_header))
            media_type = "application/octet-stream"
        else:
            content = json_header
            media_type = "application/json"
        compression = _accepted_encoding(request)
        if compression:
            if len(content) > _OFFLOAD_BYTES:
                content = await asyncio.to_thread(_compress, content, compression)
            else:
                content = _compress(content, compression)
            headers["Content-Encoding"] = compression
        return Response(content, media_type=media_type, headers=headers)

    return router

"""Bare echo servers on geserve's own stacks, the floor for `make bench`'s latency ratios: an ASGI app on
uvicorn (httptools) and a grpc.aio servicer, each answering `identity` with its input and doing nothing else.

`python -m tests.perf.echo_servers http|grpc PORT`
"""

from __future__ import annotations

import sys
from typing import Any

import grpc
import orjson
import uvicorn
import uvloop

from geserve._generated import grpc_service_pb2 as pb
from geserve._generated import model_config_pb2 as mc

MODEL = "identity"
METADATA = {
    "name": MODEL, "versions": ["1"], "platform": "onnxruntime_onnx",
    "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 16]}],
    "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 16]}],
}  # fmt: skip
CONFIG = {
    "name": MODEL, "platform": "onnxruntime_onnx", "max_batch_size": 32,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [16]}],
    "dynamic_batching": {},
}  # fmt: skip
HEADER_LENGTH = b"inference-header-content-length"


async def _json(send: Any, body: bytes, status: int = 200, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """GET metadata and config, POST infer answered with the request's own tensor bytes."""
    if scope["type"] != "http":
        return
    path = scope["path"]
    if scope["method"] == "GET":
        if path == f"/v2/models/{MODEL}":
            await _json(send, orjson.dumps(METADATA))
        elif path == f"/v2/models/{MODEL}/config":
            await _json(send, orjson.dumps(CONFIG))
        elif path == "/v2":
            await _json(send, b'{"name":"echo","version":"1","extensions":[]}')
        elif path.startswith("/v2/health"):
            await _json(send, b"")
        else:
            await _json(send, b'{"error":"not found"}', 404)
        return
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = b"".join(chunks)
    headers = dict(scope["headers"])
    length = int(headers.get(HEADER_LENGTH, len(body)))
    request = orjson.loads(body[:length])
    tensor = request["inputs"][0]
    data = body[length:]
    output = {"name": "OUTPUT0", "datatype": tensor["datatype"], "shape": tensor["shape"]}
    if data:
        output["parameters"] = {"binary_data_size": len(data)}
    else:
        output["data"] = tensor["data"]
    header = orjson.dumps({"model_name": MODEL, "model_version": "1", "outputs": [output]})
    extra = [(HEADER_LENGTH, str(len(header)).encode())] if data else []
    response = header + data
    content_type = b"application/octet-stream" if data else b"application/json"
    start_headers = [(b"content-type", content_type), (b"content-length", str(len(response)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": start_headers + extra})
    await send({"type": "http.response.body", "body": response})


async def _infer(request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
    tensor = request.inputs[0]
    output = pb.ModelInferResponse.InferOutputTensor(name="OUTPUT0", datatype=tensor.datatype, shape=tensor.shape)
    return pb.ModelInferResponse(
        model_name=MODEL, model_version="1", outputs=[output], raw_output_contents=request.raw_input_contents
    )


async def _metadata(request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
    tensors = {
        key: [pb.ModelMetadataResponse.TensorMetadata(**tensor) for tensor in METADATA[key]]
        for key in ("inputs", "outputs")
    }
    return pb.ModelMetadataResponse(name=MODEL, versions=["1"], platform="onnxruntime_onnx", **tensors)


async def _config(request: pb.ModelConfigRequest, context: Any) -> pb.ModelConfigResponse:
    config = mc.ModelConfig(name=MODEL, platform="onnxruntime_onnx", max_batch_size=32)
    config.input.add(name="INPUT0", data_type=mc.TYPE_FP32, dims=[16])
    config.output.add(name="OUTPUT0", data_type=mc.TYPE_FP32, dims=[16])
    config.dynamic_batching.SetInParent()
    return pb.ModelConfigResponse(config=config)


async def _ready(request: Any, context: Any) -> Any:
    return pb.ServerReadyResponse(ready=True)


async def _server_metadata(request: Any, context: Any) -> Any:
    return pb.ServerMetadataResponse(name="echo", version="1")


async def serve_grpc(port: int) -> None:
    def unary(function: Any, request: Any, response: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            function, request_deserializer=request.FromString, response_serializer=response.SerializeToString
        )

    handlers = {
        "ModelInfer": unary(_infer, pb.ModelInferRequest, pb.ModelInferResponse),
        "ModelMetadata": unary(_metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse),
        "ModelConfig": unary(_config, pb.ModelConfigRequest, pb.ModelConfigResponse),
        "ServerReady": unary(_ready, pb.ServerReadyRequest, pb.ServerReadyResponse),
        "ServerMetadata": unary(_server_metadata, pb.ServerMetadataRequest, pb.ServerMetadataResponse),
    }
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("inference.GRPCInferenceService", handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    kind, port = sys.argv[1], int(sys.argv[2])
    if kind == "http":
        uvicorn.run(echo_app, host="127.0.0.1", port=port, http="httptools", loop="uvloop", log_level="warning",
                    access_log=False)  # fmt: skip
    else:
        uvloop.run(serve_grpc(port))  # geserve's loop too


if __name__ == "__main__":
    main()

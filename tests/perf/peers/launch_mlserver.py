"""Start MLServer with a read-only model-config shim (perf_analyzer needs `/config` and gRPC ModelConfig).

Runs inside MLServer's own venv: `python launch_mlserver.py <models folder>`. Each model folder holds a
`config.json` with the Triton ModelConfig fields perf_analyzer reads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import grpc
from mlserver.cli import main as mlserver_main
from mlserver.grpc import server as grpc_server
from mlserver.rest import server as rest_server
from starlette.requests import Request
from starlette.responses import JSONResponse

CONFIGS: dict[str, dict[str, Any]] = {}
TYPES = {"FP32": 11, "INT32": 8, "INT64": 9, "FP64": 12, "BYTES": 13}


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _tensor(tensor: dict[str, Any]) -> bytes:
    dims = b"".join(_varint(d) for d in tensor["dims"])
    return (
        _field(1, tensor["name"].encode())
        + _varint(2 << 3)
        + _varint(TYPES[tensor["datatype"]])
        + _field(tensor["dims_field"], dims)
    )


def model_config_response(config: dict[str, Any]) -> bytes:
    """inference.ModelConfigResponse{config: ModelConfig{...}}, encoded by hand: MLServer's own
    protobuf modules already own the `inference.*` names, so a second set cannot be loaded here."""
    body = _field(1, config["name"].encode()) + _field(2, config["platform"].encode())
    body += _varint(4 << 3) + _varint(config["max_batch_size"])
    body += b"".join(_field(5, _tensor({**t, "dims_field": 4})) for t in config["input"])
    body += b"".join(_field(6, _tensor({**t, "dims_field": 3})) for t in config["output"])
    body += _field(11, b"")  # dynamic_batching {}
    return _field(1, body)


def _json_config(config: dict[str, Any]) -> dict[str, Any]:
    def tensor(t: dict[str, Any]) -> dict[str, Any]:
        return {
            "name": t["name"],
            "data_type": f"TYPE_{'STRING' if t['datatype'] == 'BYTES' else t['datatype']}",
            "dims": t["dims"],
        }

    return {
        "name": config["name"],
        "platform": config["platform"],
        "max_batch_size": config["max_batch_size"],
        "input": [tensor(t) for t in config["input"]],
        "output": [tensor(t) for t in config["output"]],
        "dynamic_batching": {},
    }


async def http_config(request: Request) -> JSONResponse:
    name = request.path_params["model_name"]
    if name not in CONFIGS:
        return JSONResponse({"error": f"Request for unknown model: '{name}' is not found"}, status_code=400)
    return JSONResponse(_json_config(CONFIGS[name]))


_create_app = rest_server.create_app


def create_app(*args: Any, **kwargs: Any) -> Any:
    app = _create_app(*args, **kwargs)
    for path in ("/v2/models/{model_name}/config", "/v2/models/{model_name}/versions/{model_version}/config"):
        app.router.add_route(path, http_config, methods=["GET"])
        # Routes registered later lose to MLServer's `/v2/models/{model_name}/...` patterns: move ours first.
        app.router.routes.insert(0, app.router.routes.pop())
    return app


async def grpc_config(request: bytes, context: Any) -> bytes:
    name = _request_name(request)
    if name not in CONFIGS:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Request for unknown model: '{name}' is not found")
    return model_config_response(CONFIGS[name])


def _request_name(request: bytes) -> str:
    # ModelConfigRequest{string name = 1; string version = 2}
    position = 0
    while position < len(request):
        key = request[position]
        length = request[position + 1]
        if key == 0x0A:
            return request[position + 2 : position + 2 + length].decode()
        position += 2 + length
    return ""


_create_server = grpc_server.GRPCServer._create_server


def create_server(self: Any) -> Any:
    server = _create_server(self)
    handler = grpc.unary_unary_rpc_method_handler(grpc_config, request_deserializer=None, response_serializer=None)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {"ModelConfig": handler}),)
    )
    return server


def main() -> None:
    folder = Path(sys.argv[1])
    for config_file in folder.glob("*/config.json"):
        config = json.loads(config_file.read_text())
        CONFIGS[config["name"]] = config
    rest_server.create_app = create_app
    grpc_server.GRPCServer._create_server = create_server
    sys.argv = ["mlserver", "start", str(folder)]
    mlserver_main()


if __name__ == "__main__":
    main()

"""Generated protobuf code is current, and its messages are wire-compatible with tritonclient's."""

from __future__ import annotations

import filecmp
import json
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

GENERATED = ROOT / "geserve" / "_generated"

# Prints every message's fields (name, number, type, label, type name) and every service method.
DUMP = r"""
import json, sys, importlib
from google.protobuf import descriptor_pb2
out = {}
for module_name in sys.argv[1:]:
    module = importlib.import_module(module_name)
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    def walk(prefix, messages):
        for message in messages:
            name = prefix + message.name
            out[name] = sorted((f.name, f.number, f.type, f.label, f.type_name.rsplit(".", 1)[-1]) for f in message.field)
            walk(name + ".", message.nested_type)
    walk(proto.package + ".", proto.message_type)
    for enum in proto.enum_type:
        out["enum " + enum.name] = sorted((v.name, v.number) for v in enum.value)
    for service in proto.service:
        out["service " + service.name] = sorted(
            (m.name, m.input_type, m.output_type, m.client_streaming, m.server_streaming) for m in service.method
        )
print(json.dumps(out))
"""


def _dump(*modules: str) -> dict[str, list[list[object]]]:
    # Separate interpreters: both sets of modules register the same `inference.*` names.
    result = subprocess.run(
        [sys.executable, "-c", DUMP, *modules], check=True, capture_output=True, text=True, cwd=ROOT
    )
    data: dict[str, list[list[object]]] = json.loads(result.stdout)
    return data


def test_generated_code_is_current(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    generated = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    committed = sorted(p.name for p in GENERATED.iterdir() if p.is_file())
    assert generated == committed
    _, mismatch, errors = filecmp.cmpfiles(tmp_path, GENERATED, generated, shallow=False)
    assert not mismatch and not errors, f"run `make protos`: {mismatch or errors} differ from protos/"


def test_wire_compatible_with_tritonclient() -> None:
    ours = _dump("geserve._generated.model_config_pb2", "geserve._generated.grpc_service_pb2")
    theirs = _dump("tritonclient.grpc.model_config_pb2", "tritonclient.grpc.service_pb2")
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name] == theirs[name], name

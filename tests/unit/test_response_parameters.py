"""Response parameters: checked as Triton's python backend checks them, and kept by every codec they cross."""

from __future__ import annotations

import json
import pickle
from typing import Any

import numpy as np
import pytest

from geserve.backends.python import pb_utils
from geserve.grpc import convert
from geserve.http.codec import ALL_BINARY, OutputEncoding, encode_response
from geserve.multiprocess.framing import decode, encode
from geserve.types import InferResponse, ModelOutputs, OutputTensor, response_parameters, with_parameters
from geserve.workers.messages import BatchPlaced, BlsReply, Partial

PARAMETERS = {"flag": True, "count": 7, "text": "x"}


def _response(parameters: dict[str, Any]) -> InferResponse:
    output = OutputTensor("OUT", "INT32", np.arange(4, dtype=np.int32))
    return InferResponse("m", "1", (output,), "id", parameters)


def test_pb_utils_takes_a_dict_or_its_json_text() -> None:
    assert json.loads(pb_utils.InferenceResponse(parameters=PARAMETERS).parameters()) == PARAMETERS
    assert json.loads(pb_utils.InferenceResponse(parameters=json.dumps(PARAMETERS)).parameters()) == PARAMETERS
    assert pb_utils.InferenceResponse().parameters() == "{}"


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"f": 0.5}, "Expect parameters values to have type bool/int/str, found type <class 'float'>"),
        ({"n": None}, "Expect parameters values to have type bool/int/str, found type <class 'NoneType'>"),
        ({1: "int key"}, "Expect parameters keys to have type str, found type <class 'int'>"),
        ([], "Expect dict, got <class 'list'>"),
        ("[1]", "Expect dict, got <class 'list'>"),
        ("{", "Expect parameters to be a JSON object"),
        ({"big": 1 << 63}, "does not fit in an int64"),
    ],
)
def test_pb_utils_refuses_what_triton_refuses(parameters: Any, message: str) -> None:
    with pytest.raises(pb_utils.TritonModelException, match=message.replace("(", r"\(").replace(")", r"\)")):
        pb_utils.InferenceResponse(parameters=parameters)


def test_model_outputs_keep_their_parameters_through_pickle() -> None:
    outputs = with_parameters({"OUT": np.arange(3)}, PARAMETERS)
    assert isinstance(outputs, ModelOutputs)
    copy = pickle.loads(pickle.dumps(outputs, protocol=5))
    assert response_parameters(copy) == PARAMETERS
    np.testing.assert_array_equal(copy["OUT"], np.arange(3))
    plain: dict[str, np.ndarray] = {}
    assert with_parameters(plain, {}) is plain
    assert response_parameters(plain) == {} and response_parameters(None) == {}


def test_worker_messages_carry_response_parameters() -> None:
    placed = BatchPlaced(3, (), ((),), 1, 2, (PARAMETERS,))
    assert pickle.loads(pickle.dumps(placed)).parameters == (PARAMETERS,)
    partial = Partial(1, {"OUT": np.arange(2)}, (), None, False, PARAMETERS)
    assert pickle.loads(pickle.dumps(partial)).parameters == PARAMETERS
    reply = BlsReply(5, (), None, True, PARAMETERS)
    assert pickle.loads(pickle.dumps(reply)).parameters == PARAMETERS


def test_engine_frames_carry_response_parameters() -> None:
    body = memoryview(bytearray(b"".join(bytes(part) for part in encode(_response(PARAMETERS)))[8:]))
    assert decode(body).parameters == PARAMETERS


def test_http_json_and_binary_headers_carry_response_parameters() -> None:
    for encoding in (ALL_BINARY, OutputEncoding(default_binary=False)):
        header, _ = encode_response(_response(PARAMETERS), encoding)
        assert json.loads(header)["parameters"] == PARAMETERS
    header, _ = encode_response(_response({}), ALL_BINARY)
    assert "parameters" not in json.loads(header)


def test_grpc_response_parameters_are_typed_as_triton_types_them() -> None:
    message = convert.infer_reply(_response({**PARAMETERS, "ratio": 0.25})).to_message()
    kinds = {key: value.WhichOneof("parameter_choice") for key, value in message.parameters.items()}
    assert kinds == {"flag": "bool_param", "count": "int64_param", "text": "string_param", "ratio": "double_param"}
    assert message.parameters["count"].int64_param == 7 and message.parameters["flag"].bool_param is True

"""Each pb_utils row holds: what works is there (and, for the rows this file proves, behaves as Triton's),
what is refused is absent so a model using it fails naming it, geserve's own hooks are not Triton's API."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest

from geserve.backends.python import pb_utils
from geserve.workers.bls import ResponseIterator
from tests.parity.names import resolve_pb_utils
from tests.parity.proof import check_test_file
from tests.parity.table import Row, rows_of
from tests.parity.triton_lists import TRITON_PB_UTILS

THIS_FILE = "tests/parity/test_pb_utils.py"
# Works under another name: `exec(decoupled=True)` returns a generator where Triton returns a ResponseIterator.
STAND_INS = {"ResponseIterator.__iter__", "ResponseIterator.__next__", "ResponseIterator.cancel"}
CONFIG = {"input": [{"name": "IN", "data_type": "TYPE_FP32"}], "model_transaction_policy": {"decoupled": True}}


def _sender_sends_until_final() -> None:
    sent: list[tuple[object, bool]] = []
    sender = pb_utils.InferenceResponseSender(lambda response, final: sent.append((response, final)), lambda: False)
    response = pb_utils.InferenceResponse([])
    sender.send(response)
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert sent == [(response, False), (None, True)]
    with pytest.raises(pb_utils.TritonModelException):
        sender.send(response)


def _release_flags() -> None:
    request = pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[])
    request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
    with pytest.raises(pb_utils.TritonModelException, match="RESCHEDULE"):
        request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)


def _dlpack() -> None:
    tensor = pb_utils.Tensor("T", np.arange(4, dtype=np.float32))
    assert tensor.is_cpu() and tensor.__dlpack_device__() == (1, 0)
    assert pb_utils.Tensor.from_dlpack("U", tensor).as_numpy().tolist() == [0, 1, 2, 3]
    assert np.from_dlpack(tensor).tolist() == [0, 1, 2, 3]
    assert np.from_dlpack(pb_utils.Tensor("V", np.ones(2, dtype=np.int8))).tolist() == [1, 1]
    assert np.from_dlpack(_Capsule(tensor.to_dlpack())).tolist() == [0, 1, 2, 3]
    assert pb_utils.Tensor.from_dlpack("X", pb_utils.Tensor("Y", np.zeros(1))).as_numpy().tolist() == [0.0]


class _Capsule:
    """A bare DLPack capsule, as `to_dlpack` returns it, behind the protocol numpy reads."""

    def __init__(self, capsule: object) -> None:
        self._capsule = capsule

    def __dlpack__(self, stream: object = None) -> object:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def _logs(method: str, level: int) -> bool:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("geserve.python_model")
    logger.addHandler(handler)
    previous, logger.level = logger.level, logging.DEBUG
    try:
        getattr(pb_utils.Logger, method)("parity")
    finally:
        logger.removeHandler(handler)
        logger.level = previous
    return [(record.levelno, record.getMessage()) for record in records] == [(level, "parity")]


def _auto_complete_config() -> None:
    config = pb_utils.ModelConfig({"name": "m"})
    config.set_model_transaction_policy({"decoupled": True})
    assert config.as_dict()["model_transaction_policy"] == {"decoupled": True}


# Triton's values (TRITONSERVER_Error_Code, tritonserver.h's flags, LogLevel in pb_stub.cc).
BEHAVIOUR: dict[str, Callable[[], object]] = {
    "ResponseIterator.__iter__": lambda: "__iter__" in vars(ResponseIterator),
    "ResponseIterator.__next__": lambda: "__next__" in vars(ResponseIterator),
    "TritonError.UNKNOWN": lambda: pb_utils.TritonError.UNKNOWN == 0,
    "TritonError.INTERNAL": lambda: pb_utils.TritonError("x").code() == pb_utils.TritonError.INTERNAL == 1,
    "TritonError.NOT_FOUND": lambda: pb_utils.TritonError.NOT_FOUND == 2,
    "TritonError.UNAVAILABLE": lambda: pb_utils.TritonError.UNAVAILABLE == 4,
    "ModelConfig": lambda: _auto_complete_config() or True,
    "Logger.log_verbose": lambda: _logs("log_verbose", logging.DEBUG),
    "Logger.log_warn": lambda: _logs("log_warn", logging.WARNING),
    "Logger.log_error": lambda: _logs("log_error", logging.ERROR),
    "serialize_byte_tensor": lambda: (
        bytes(pb_utils.serialize_byte_tensor(np.array([b"ab", b""], dtype=np.object_)))
        == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"
    ),
    "deserialize_bytes_tensor": lambda: pb_utils.deserialize_bytes_tensor(b"\x02\x00\x00\x00ab").tolist() == [b"ab"],
    "TritonError.ALREADY_EXISTS": lambda: pb_utils.TritonError("x", pb_utils.TritonError.ALREADY_EXISTS).code() == 6,
    "TritonError.CANCELLED": lambda: pb_utils.TritonError("x", pb_utils.TritonError.CANCELLED).code() == 7,
    "InferenceRequest.set_release_flags": lambda: _release_flags() or True,
    "Tensor.triton_dtype": lambda: pb_utils.Tensor("T", np.zeros(1, np.float32)).triton_dtype() == 11,
    "Tensor.to_dlpack": lambda: _dlpack() or True,
    "Tensor.is_cpu": lambda: pb_utils.Tensor("T", np.zeros(1)).is_cpu() is True,
    "Tensor.from_dlpack": lambda: _dlpack() or True,
    "Tensor.__dlpack__": lambda: _dlpack() or True,
    "Tensor.__dlpack_device__": lambda: _dlpack() or True,
    "InferenceResponseSender": lambda: _sender_sends_until_final() or True,
    "Logger.LogLevel": lambda: (
        (
            pb_utils.Logger.LogLevel.INFO,
            pb_utils.Logger.LogLevel.WARNING,
            pb_utils.Logger.LogLevel.ERROR,
            pb_utils.Logger.LogLevel.VERBOSE,
        )
        == (0, 1, 2, 3)
    ),
    "TRITON_STRING_TO_NUMPY": lambda: (
        pb_utils.TRITON_STRING_TO_NUMPY["TYPE_STRING"] is np.object_
        and pb_utils.TRITON_STRING_TO_NUMPY["TYPE_FP16"] is np.float16
    ),
    "get_input_config_by_name": lambda: (
        pb_utils.get_input_config_by_name(CONFIG, "IN") == CONFIG["input"][0]
        and pb_utils.get_input_config_by_name(CONFIG, "OUT") is None
    ),
    "triton_to_numpy_type": lambda: (
        pb_utils.triton_to_numpy_type(13) is np.object_ and pb_utils.triton_to_numpy_type(8) is np.int32
    ),
    "numpy_to_triton_type": lambda: (
        pb_utils.numpy_to_triton_type(np.int32) == 8 and pb_utils.numpy_to_triton_type(np.object_) == 13
    ),
    "using_decoupled_model_transaction_policy": lambda: (
        pb_utils.using_decoupled_model_transaction_policy(CONFIG)
        and not pb_utils.using_decoupled_model_transaction_policy({})
    ),
    "ModelConfig.as_dict": lambda: _auto_complete_config() or True,
    "ModelConfig.set_model_transaction_policy": lambda: _auto_complete_config() or True,
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START": lambda: pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START == 1,
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END": lambda: pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END == 2,
    "TRITONSERVER_REQUEST_RELEASE_ALL": lambda: pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL == 1,
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE": lambda: pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE == 2,
}


def _rows(status: str) -> list[Row]:
    return [row for row in rows_of("pb_utils") if row.status == status]


@pytest.mark.parametrize("row", _rows("works"), ids=lambda row: row.key)
def test_working_name_is_there(row: Row) -> None:
    if row.key in STAND_INS:
        assert row.key.split(".")[1] in vars(ResponseIterator)
    else:
        assert resolve_pb_utils(row.key) is not None, f"pb_utils has no {row.key}"
    if row.test_file == THIS_FILE:
        assert row.key in BEHAVIOUR, f"{row.where} names {THIS_FILE}, which has no case for {row.key}"
        assert BEHAVIOUR[row.key]()
    else:
        check_test_file(row)


@pytest.mark.parametrize("row", _rows("refused"), ids=lambda row: row.key)
def test_refused_name_fails_naming_it(row: Row) -> None:
    owner: object = pb_utils
    *path, name = row.key.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return  # the class itself is missing: its own row names it
    with pytest.raises(AttributeError, match=name):
        getattr(owner, name)


@pytest.mark.parametrize("row", _rows("not applicable"), ids=lambda row: row.key)
def test_inapplicable_name_is_geserves_own(row: Row) -> None:
    assert row.key not in TRITON_PB_UTILS
    assert resolve_pb_utils(row.key) is not None
    check_test_file(row)

"""Triton's trace file: the objects of one trace, PATH and PATH.<n>, and which traces go where and when."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from geserve.core.trace import TraceController
from geserve.core.trace_file import TraceCollection, TraceFile, trace_objects
from geserve.types import TraceRecord


def _record(trace_id: int, request_id: str = "", model: str = "simple", scope: str | None = None) -> TraceRecord:
    marks = (("HTTP_RECV_START", 10), ("REQUEST_START", 20), ("REQUEST_END", 30), ("HTTP_SEND_END", 40))
    return TraceRecord(trace_id, model, "1", request_id, marks, scope)


def _ids(path: Path) -> list[int]:
    """The trace ids of a file, once per trace (its model object)."""
    return [item["id"] for item in json.loads(path.read_text()) if "model_name" in item]


def test_one_trace_is_its_model_object_then_one_object_per_timestamp() -> None:
    written = json.loads(b"[" + trace_objects(_record(7, "req-1")) + b"]")
    assert written == [
        {"id": 7, "model_name": "simple", "model_version": 1, "request_id": "req-1"},
        {"id": 7, "timestamps": [{"name": "HTTP_RECV_START", "ns": 10}]},
        {"id": 7, "timestamps": [{"name": "REQUEST_START", "ns": 20}]},
        {"id": 7, "timestamps": [{"name": "REQUEST_END", "ns": 30}]},
        {"id": 7, "timestamps": [{"name": "HTTP_SEND_END", "ns": 40}]},
    ]
    # No request id: no key, as Triton's; a child of another trace names its parent.
    child = TraceRecord(8, "step", "2", "", (), parent_id=7)
    assert json.loads(trace_objects(child)) == {"id": 8, "model_name": "step", "model_version": 2, "parent_id": 7}


def test_the_file_is_one_array_once_closed_and_indexed_files_are_whole(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    file = TraceFile(str(path))
    file.save([trace_objects(_record(1))], indexed=False)
    file.save([trace_objects(_record(2)), trace_objects(_record(3))], indexed=True)
    file.save([trace_objects(_record(4))], indexed=False)
    file.save([trace_objects(_record(5))], indexed=True)
    file.save([], indexed=True)  # nothing to write: no file, no index used
    file.close()
    assert _ids(path) == [1, 4]
    assert _ids(tmp_path / "trace.json.0") == [2, 3]
    assert _ids(tmp_path / "trace.json.1") == [5]
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["trace.json", "trace.json.0", "trace.json.1"]
    file.save([trace_objects(_record(6))], indexed=False)  # too late: the array stays whole
    assert _ids(path) == [1, 4]


def test_no_traces_no_file(tmp_path: Path) -> None:
    file = TraceFile(str(tmp_path / "trace.json"))
    file.close()
    assert not list(tmp_path.iterdir())


def test_log_frequency_writes_every_n_traces_to_the_next_indexed_file(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    file = TraceFile(str(path))
    collection = TraceCollection(file, log_frequency=2)
    for trace_id in range(1, 6):
        collection.created += 1
        collection.add(_record(trace_id), count_exhausted=False)
    collection.flush()  # the setting is replaced or the server stops: the rest, to the next indexed file
    file.close()
    assert [_ids(tmp_path / f"trace.json.{index}") for index in range(3)] == [[1, 2], [3, 4], [5]]
    assert not path.exists()


def test_without_log_frequency_traces_wait_for_the_end_and_go_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    file = TraceFile(str(path))
    collection = TraceCollection(file, log_frequency=0)
    for trace_id in (1, 2, 3):
        collection.created += 1
        collection.add(_record(trace_id), count_exhausted=False)
    assert not path.exists()  # nothing written before the setting ends
    collection.flush()
    file.close()
    assert _ids(path) == [1, 2, 3]


def _controller(tmp_path: Path, **settings: Any) -> TraceController:
    initial = {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_file": str(tmp_path / "trace.json")}
    return TraceController({**initial, **settings})


def _run(controller: TraceController, request_id: str, model: str = "simple") -> bool:
    """One request through sampling and back from its front-end; whether it was traced."""
    trace = controller.start(model, "1", request_id)
    if trace is None:
        return False
    trace.mark("REQUEST_START", 1)
    controller.record(trace.finished().around((("HTTP_RECV_START", 0),), (("HTTP_SEND_END", 2),)))
    return True


def test_trace_count_traces_go_to_an_indexed_file_once_all_are_in(tmp_path: Path) -> None:
    controller = _controller(tmp_path, trace_count="2")
    assert controller.settings()["trace_count"] == "2"
    assert [_run(controller, f"r{index}", model) for index, model in enumerate(("simple", "other", "simple"))] == [
        True,
        True,
        False,  # the global count is shared by every model without settings of its own, as Triton's
    ]
    assert controller.settings()["trace_count"] == "0"  # what is left to sample, as Triton reports it
    controller.close()
    assert _ids(tmp_path / "trace.json.0") == [1, 2]
    assert not (tmp_path / "trace.json").exists()


def test_a_new_log_frequency_writes_out_what_the_old_setting_collected(tmp_path: Path) -> None:
    controller = _controller(tmp_path)
    assert _run(controller, "before")
    controller.update(None, {"log_frequency": "1"})
    assert _run(controller, "after")
    assert _run(controller, "later")
    controller.close()
    assert _ids(tmp_path / "trace.json") == [1]
    assert [_ids(tmp_path / f"trace.json.{index}") for index in range(2)] == [[2], [3]]
    file = json.loads((tmp_path / "trace.json").read_text())
    names = [item["timestamps"][0]["name"] for item in file if "timestamps" in item]
    assert names == ["HTTP_RECV_START", "REQUEST_START", "HTTP_SEND_END"]


def test_a_model_with_its_own_settings_samples_and_collects_under_them(tmp_path: Path) -> None:
    controller = _controller(tmp_path)
    controller.update("simple", {"log_frequency": "1", "trace_rate": "2"})
    assert [_run(controller, f"s{index}") for index in range(5)] == [False, True, False, True, False]
    assert _run(controller, "global", model="other")
    controller.close()
    assert [_ids(tmp_path / f"trace.json.{index}") for index in range(2)] == [[1], [2]]
    assert _ids(tmp_path / "trace.json") == [3]


def test_without_a_file_traces_go_to_the_log(tmp_path: Path, caplog: Any) -> None:
    controller = TraceController({"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    with caplog.at_level("INFO", logger="geserve.trace"):
        assert _run(controller, "logged")
    controller.close()
    assert not list(tmp_path.iterdir())
    (message,) = [record.getMessage() for record in caplog.records if record.name == "geserve.trace"]
    logged = json.loads(message.removeprefix("trace "))
    assert logged["request_id"] == "logged"
    assert [stamp["name"] for stamp in logged["timestamps"]] == ["HTTP_RECV_START", "REQUEST_START", "HTTP_SEND_END"]

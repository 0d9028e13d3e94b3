"""The load-time check that a batch-gear `.om` gives every output dims at every gear (`_dynamic_output_dims`)."""

from __future__ import annotations

from typing import Any

import pytest

from geserve.backends.acl.description import (
    check_output_dims,
    cur_output_dims,
    missing_output_dims,
    parse_output_dims,
)
from geserve.backends.acl.om_file import describe_bytes
from geserve.errors import ModelLoadError
from tests.fakes.om_models import affine_description
from tests.fakes.om_writer import om2_bytes, om_bytes

# The affine graph's outputs at gears 1, 2, 4: y is [gear, 4], s is [gear, 1].
FULL = ["0,0,1,4", "1,0,2,4", "2,0,4,4", "0,1,1,1", "1,1,2,1", "2,1,4,1"]


def _described(entries: list[str] | None, gears: list[int] | None = None, **options: Any) -> Any:
    description = affine_description(gears or [1, 2, 4])
    if gears is not None:
        description["dynamic"]["dynamic_batch"] = gears  # the file's order, not sorted
    return describe_bytes(om_bytes(description, dynamic_output_dims=entries, **options))


def test_entries_are_parsed_as_the_runtime_parses_them() -> None:
    assert parse_output_dims("0,1,1000") == (0, 1, 1000)
    assert parse_output_dims("-1,2,3,2") == (-1, 2, 3, 2)
    assert parse_output_dims("3, 8,1000") == (3, 0, 8, 1000)  # any other character ends a number
    assert parse_output_dims("") == (0,)


@pytest.mark.parametrize("inout_info", [True, False])
def test_every_output_at_every_gear_passes_with_or_without_shared_entries(inout_info: bool) -> None:
    for entries in (FULL, ["0,0,1,4", "1,0,2,4", "2,0,4,4", "-1,1,4,1"]):
        om = _described(entries, inout_info=inout_info)
        assert missing_output_dims(om) == {}
        check_output_dims(om, "affine", "model.om")
    shared = _described(["0,0,1,4", "1,0,2,4", "2,0,4,4", "-1,1,4,1"])
    assert cur_output_dims(shared, 1, 1) == (4, 1)  # -1: the same dims at every gear
    assert cur_output_dims(shared, 1, 0) == (2, 4)
    # What the writer gives by default is what ATC writes: it passes too.
    check_output_dims(describe_bytes(om_bytes(affine_description([1, 2, 4]))), "affine", "model.om")


@pytest.mark.parametrize("inout_info", [True, False])
def test_an_output_without_an_entry_at_one_gear_is_refused_naming_it_the_gear_and_the_fix(inout_info: bool) -> None:
    entries = [entry for entry in FULL if entry != "1,1,2,1"]  # output 1 (s) at gear index 1 (batch 2)
    om = _described(entries, inout_info=inout_info)
    assert missing_output_dims(om) == {1: (2,)}
    with pytest.raises(ModelLoadError) as error:
        check_output_dims(om, "affine", "/models/affine/1/model.om")
    message = error.value.message
    assert message.startswith("model 'affine': '/models/affine/1/model.om' has batch gears [1, 2, 4]")
    assert "give no dims for output 1 'ReduceSum_2:0:s' at batch size 2:" in message
    assert "'Add_1:0:y'" not in message  # output 0 has dims at every gear
    assert "aclmdlGetCurOutputDims cannot give those outputs' shapes once a batch size is set" in message
    assert "compile the model again with ATC" in message and "--dynamic_batch_size" in message


def test_gear_indexes_are_the_files_gear_order() -> None:
    # Gears 4, 1, 2 in the file: index 0 is batch 4. Output 0 lacks index 0, output 1 lacks index 2.
    om = _described(["1,0,1,4", "2,0,2,4", "0,1,4,1", "1,1,1,1"], gears=[4, 1, 2])
    assert om.gears == (1, 2, 4)
    assert missing_output_dims(om) == {0: (4,), 1: (2,)}


def test_no_entries_at_all_and_malformed_entries_leave_outputs_without_dims() -> None:
    assert missing_output_dims(_described(None)) == {0: (1, 2, 4), 1: (1, 2, 4)}
    # An entry of fewer than 2 values fails the runtime's lookup when it comes before the one sought.
    om = _described(["0,0,1,4", "7", *FULL])
    assert missing_output_dims(om) == {0: (2, 4), 1: (1, 2, 4)}


def test_what_the_description_cannot_say_and_static_models_are_left_alone() -> None:
    om2 = describe_bytes(om2_bytes(affine_description([1, 2, 4])))
    assert om2.gear_kind == "batch" and om2.dynamic_output_dims is None  # OM2 metadata: not known here
    assert missing_output_dims(om2) == {}
    check_output_dims(om2, "affine", "model.om")
    static = describe_bytes(om_bytes(affine_description(static_batch=2), dynamic_output_dims=None))
    assert missing_output_dims(static) == {}

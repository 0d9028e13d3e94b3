"""The offline `.om` reader: real ATC files against what their descriptions say, the test writer, and damage."""

from __future__ import annotations

import json
import random
import struct
from typing import Any

import pytest

from geserve.backends.acl.om_file import describe_bytes, read_description
from geserve.backends.acl.om_records import OmFormatError
from geserve.errors import ModelLoadError
from tests.fakes.om_writer import VERSION_1, VERSION_2, om2_bytes, om_bytes
from tests.support import ROOT

SAMPLES = ROOT / "tests" / "data" / "om-samples"
EXPECTED: dict[str, Any] = json.loads((SAMPLES / "expected.json").read_text())
READABLE = sorted(name for name, expected in EXPECTED.items() if "error" not in expected)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_sample_is_described_as_its_description_says(name: str) -> None:
    expected = EXPECTED[name]
    if "error" in expected:
        with pytest.raises(ModelLoadError) as error:
            read_description(SAMPLES / name)
        assert expected["error"] in error.value.message
        assert name in error.value.message
    else:
        assert read_description(SAMPLES / name).to_json() == expected


@pytest.mark.parametrize("name", READABLE)
@pytest.mark.parametrize("inout_info", [True, False])
def test_a_written_file_is_described_the_same_as_each_sample(name: str, inout_info: bool) -> None:
    expected = EXPECTED[name]
    version = int(expected["header_version"], 16)
    for wide in [False, True] if version == VERSION_2 else [False]:
        data = om_bytes(expected, header_version=version, wide_table=wide, inout_info=inout_info)
        assert describe_bytes(data).to_json() == expected


def test_gear_model_from_records_and_from_the_graph_agree() -> None:
    """synthetic_dynbatch.om has both MODEL_INOUT_INFO and MODEL_DEF: read with either, the same model."""
    data = (SAMPLES / "synthetic_dynbatch.om").read_bytes()
    without_records = bytearray(data)
    entry = 256 + 8  # first 64-bit entry: MODEL_INOUT_INFO; retype it so only MODEL_DEF is read
    assert struct.unpack_from("<I", without_records, entry)[0] == 8
    struct.pack_into("<I", without_records, entry, 1)
    assert describe_bytes(bytes(without_records)).to_json() == describe_bytes(data).to_json()


WRITTEN = {
    "name": "written",
    "soc_version": "Ascend910B3",
    "inputs": [
        {"name": "images", "dtype": "float16", "dims": [-1, 3, 32, 32], "format": "NCHW"},
        {"name": "mask", "dtype": "uint8", "dims": [-1, 32], "format": "ND"},
        {"name": "ascend_mbatch_shape_data", "dtype": "int32", "dims": [1], "format": "ND"},
    ],
    "outputs": [
        {"name": "PartitionedCall_/head/Conv_12:0:logits", "dtype": "float32", "dims": [16, 10], "format": "ND"},
        {"name": "Gather_3:1:index", "dtype": "int64", "dims": [16], "format": "ND"},
    ],
    "dynamic": {"dynamic_batch": [1, 4, 16], "data_name_order": ["images", "mask"]},
}


@pytest.mark.parametrize(
    "options",
    [
        {"header_version": VERSION_1, "inout_info": False},
        {"header_version": VERSION_2, "wide_table": False, "inout_info": False},
        {"header_version": VERSION_2, "wide_table": True, "inout_info": True},
        {"header_version": VERSION_2, "wide_table": True, "inout_info": False},
    ],
)
def test_the_reader_describes_exactly_what_the_writer_wrote(options: dict[str, Any]) -> None:
    om = describe_bytes(om_bytes(WRITTEN, **options))
    assert {k: v for k, v in om.to_json().items() if k != "header_version"} == WRITTEN
    assert om.header_version == options["header_version"]
    assert om.gears == (1, 4, 16) and om.dynamic_input is not None and om.dynamic_input.index == 2
    assert [t.size for t in om.inputs] == [16 * 3 * 32 * 32 * 2, 16 * 32]
    assert [t.size for t in om.outputs] == [16 * 10 * 4, 16 * 8]


@pytest.mark.parametrize("inout_info", [True, False])
def test_written_gear_files_carry_ges_dynamic_output_dims(inout_info: bool) -> None:
    """ "<gear index>,<output index>,<dims at that gear>" per gear and batched output, "-1,<output
    index>,<dims>" for an output every gear shares, on the NetOutput and in the DYNAMIC_OUTPUT_SHAPE record."""
    written = {
        **WRITTEN,
        "outputs": [*WRITTEN["outputs"], {"name": "Const_7:0:table", "dtype": "int32", "dims": [3, 2], "format": "ND"}],
    }
    om = describe_bytes(om_bytes(written, inout_info=inout_info))
    assert om.dynamic_output_dims == ("0,0,1,10", "1,0,4,10", "2,0,16,10", "0,1,1", "1,1,4", "2,1,16", "-1,2,3,2")
    assert describe_bytes(om_bytes(written, inout_info=inout_info, dynamic_output_dims=None)).dynamic_output_dims == ()


def test_the_records_and_the_graph_give_the_same_dynamic_output_dims() -> None:
    data = bytearray(om_bytes(WRITTEN, dynamic_output_dims=["0,0,1,10", "1,0,4,10", "2,0,16,10", "-1,1,16"]))
    from_records = describe_bytes(bytes(data)).dynamic_output_dims
    entry = 256 + 8 + 24  # the second 64-bit entry: MODEL_DEF; retype it so only MODEL_INOUT_INFO is read
    assert struct.unpack_from("<I", data, entry)[0] == 0
    struct.pack_into("<I", data, entry, 1)
    assert (
        describe_bytes(bytes(data)).dynamic_output_dims
        == from_records
        == ("0,0,1,10", "1,0,4,10", "2,0,16,10", "-1,1,16")
    )


def test_the_synthetic_sample_carries_dynamic_output_dims_on_its_net_output_only() -> None:
    """Its NetOutput has `_dynamic_output_dims` (what the simulator takes for the file), but not in GE's
    "<gear>,<output>,<dims>" layout, and its MODEL_INOUT_INFO has no DYNAMIC_OUTPUT_SHAPE record, which GE
    writes from that attribute."""
    from tests.fakes.acl.om import SAMPLE_DYNAMIC_OUTPUT_DIMS

    data = (SAMPLES / "synthetic_dynbatch.om").read_bytes()
    strings = SAMPLE_DYNAMIC_OUTPUT_DIMS["synthetic_dynbatch.om"]
    assert b"_dynamic_output_dims" in data and all(s.encode() in data for s in strings)
    assert describe_bytes(data).dynamic_output_dims == tuple(strings)
    records_only = bytearray(data)
    entry = 256 + 8 + 24  # MODEL_DEF, after MODEL_INOUT_INFO
    assert struct.unpack_from("<I", records_only, entry)[0] == 0
    struct.pack_into("<I", records_only, entry, 1)
    # Neither a DYNAMIC_OUTPUT_SHAPE record nor a graph to read the attribute from: the reader cannot say.
    assert describe_bytes(bytes(records_only)).dynamic_output_dims is None
    outputs = len(EXPECTED["synthetic_dynbatch.om"]["outputs"])
    assert all(int(s.split(",")[1]) >= outputs for s in strings)  # no entry names output 0


@pytest.mark.parametrize("wide", [True, False])
def test_a_root_model_with_sub_models_is_described_by_its_first_table(wide: bool) -> None:
    sub = {**WRITTEN, "name": "sub", "outputs": [{"name": "sub_out:0", "dtype": "int32", "dims": [2], "format": "ND"}]}
    om = describe_bytes(om_bytes(WRITTEN, wide_table=wide, sub_models=(sub, sub)))
    assert {k: v for k, v in om.to_json().items() if k != "header_version"} == WRITTEN


def test_graph_api_names_and_other_gear_kinds_round_trip() -> None:
    for dynamic, dims in (
        ({"dynamic_image_size": [[224, 224], [320, 320]], "data_name_order": ["x"]}, [1, 3, -1, -1]),
        ({"dynamic_dims": [[1, 8], [1, 16]], "data_name_order": ["x"]}, [1, -1]),
    ):
        description = {
            "name": "graph_api",
            "soc_version": None,
            "inputs": [
                {"name": "x", "dtype": "float32", "dims": dims, "format": "NCHW"},
                {"name": "ascend_mbatch_shape_data", "dtype": "int32", "dims": [2], "format": "ND"},
            ],
            "outputs": [{"name": "output_0_known_op_0", "dtype": "float32", "dims": [1, 10], "format": "ND"}],
            "dynamic": dynamic,
        }
        for inout_info in (True, False):
            described = describe_bytes(om_bytes(description, inout_info=inout_info)).to_json()
            assert {k: v for k, v in described.items() if k != "header_version"} == description


def test_om2_archives_are_described_from_model_meta_json() -> None:
    om = describe_bytes(om2_bytes(WRITTEN))
    assert om.header_version is None
    assert [t.to_json() for t in om.outputs] == WRITTEN["outputs"]
    assert om.gears == (1, 4, 16) and om.data_name_order == ("images", "mask")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: b"PICO" + d[4:], "HiSilicon SVP"),
        (lambda d: d[:80] + b"\x01" + d[81:], "is encrypted (is_encrypt=1)"),
        (lambda d: d[:82] + b"\x05" + d[83:], "is a bundle of models"),
        (lambda d: d[:8] + b"\x00\x00\x00\x30" + d[12:], "unknown header version 0x30000000"),
        (lambda d: d[:-10], "truncated: the header says"),
        (lambda d: d + b"\x00" * 10, "has trailing data"),
        (lambda d: d[:100], "truncated: 100 bytes, shorter than the 256-byte header"),
        (lambda d: b"\x00" * 64 + d[64:], "not an .om file: no IMOD magic (it starts with"),
        (lambda d: b"PK\x03\x04" + d[4:], "a damaged OM2 archive"),
    ],
)
def test_foreign_encrypted_and_damaged_files_are_refused_saying_what_they_are(mutate: Any, message: str) -> None:
    with pytest.raises(OmFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        describe_bytes(mutate(om_bytes(WRITTEN, header_version=VERSION_1)))


def test_a_model_def_that_is_not_a_ge_graph_is_refused() -> None:
    data = bytearray(om_bytes(WRITTEN, header_version=VERSION_1, inout_info=False))
    # MODEL_DEF is the first partition of the 32-bit table: replace it by bytes of a foreign format
    table = 256 + 4
    kind, _, size = struct.unpack_from("<III", data, table)
    start = 256 + 4 + 12 * 4
    assert kind == 0
    data[start : start + size] = b"\x0a\x03abc" + b"\xff" * (size - 5)
    with pytest.raises(OmFormatError, match="MODEL_DEF"):
        describe_bytes(bytes(data))


def test_a_hiai_model_is_named_as_such() -> None:
    """HiAI (Kirin) files share the IMOD magic and v1 header, with their own fields at 177-204."""
    data = bytearray(om_bytes(WRITTEN, header_version=VERSION_1, inout_info=False))
    data[180] = 1  # custom_data_len and friends, which ATC leaves zero
    start = 256 + 4 + 12 * 4
    size = struct.unpack_from("<III", data, 256 + 4)[2]
    data[start : start + size] = b"\xff" * size  # HiAI's partitions are not a GE ModelDef
    with pytest.raises(OmFormatError, match=r"a HiAI \(Kirin NPU\) model, not Ascend ATC output"):
        describe_bytes(bytes(data))


def _sources() -> list[tuple[str, bytes]]:
    written = [
        ("written-v1", om_bytes(WRITTEN, header_version=VERSION_1, inout_info=False)),
        ("written-v2", om_bytes(WRITTEN)),
        ("written-om2", om2_bytes(WRITTEN)),
    ]
    samples = [(name, (SAMPLES / name).read_bytes()) for name in READABLE]
    return written + samples


@pytest.mark.parametrize(("name", "data"), _sources(), ids=[name for name, _ in _sources()])
def test_truncated_and_bit_flipped_copies_give_clear_errors_only(name: str, data: bytes) -> None:
    """A property test: hundreds of mutations of each file; each is described or refused with OmFormatError."""
    rng = random.Random(name)
    # The header, the table and the description partitions are where damage matters; the
    # mutations land there most of the time, and anywhere in the file the rest.
    hot = min(len(data), 4096)
    mutants = [data[: rng.randrange(len(data))] for _ in range(100)]
    for _ in range(400):
        mutant = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 8))):
            position = rng.randrange(hot) if rng.random() < 0.8 else rng.randrange(len(data))
            mutant[position] ^= 1 << rng.randrange(8)
        mutants.append(bytes(mutant))
    described = refused = 0
    for mutant in mutants:
        try:
            describe_bytes(mutant).to_json()
            described += 1
        except OmFormatError as error:
            assert str(error)
            refused += 1
    assert described + refused == len(mutants) and refused > 0

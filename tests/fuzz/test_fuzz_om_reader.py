"""The `.om` reader under arbitrary damage: every input is described or refused with OmFormatError."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from geserve.backends.acl.om_file import describe_bytes
from geserve.backends.acl.om_records import OmFormatError
from tests.fakes.om_writer import VERSION_1, om2_bytes, om_bytes
from tests.unit.test_om_file import WRITTEN

SOURCES = [om_bytes(WRITTEN), om_bytes(WRITTEN, header_version=VERSION_1, inout_info=False), om2_bytes(WRITTEN)]


def _describe_or_refuse(data: bytes) -> None:
    try:
        describe_bytes(data).to_json()
    except OmFormatError as error:
        assert str(error)


@given(st.sampled_from(SOURCES), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=16))
def test_overwritten_bytes(source: bytes, edits: list[tuple[int, int]]) -> None:
    data = bytearray(source)
    for position, value in edits:
        data[position % len(data)] = value
    _describe_or_refuse(bytes(data))


@given(st.sampled_from(SOURCES), st.integers(0, 1 << 20), st.binary(max_size=64))
def test_spliced_bytes(source: bytes, position: int, inserted: bytes) -> None:
    at = position % len(source)
    _describe_or_refuse(source[:at] + inserted + source[at:])


@given(st.binary(max_size=2048))
def test_random_bytes(data: bytes) -> None:
    _describe_or_refuse(data)


@given(st.binary(max_size=512))
def test_random_bytes_behind_a_valid_header(tail: bytes) -> None:
    _describe_or_refuse(om_bytes(WRITTEN)[:256] + tail)

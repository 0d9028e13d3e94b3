"""Simulated `acl.util`: the pointer helpers of the binding."""

from __future__ import annotations

import ctypes

from ._state import RUNTIME, api


@api("util.bytes_to_ptr", value=0)
def bytes_to_ptr(data: bytes) -> int:
    if not isinstance(data, bytes):
        raise ValueError("bytes_to_ptr accepts only bytes objects")
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0


@api("util.ptr_to_bytes", value=b"")
def ptr_to_bytes(address: int, size: int) -> bytes:
    if RUNTIME.space_of(address) == "device" and RUNTIME.run_mode == 1:
        raise RUNTIME.fail(107000, f"{address:#x} is device memory; copy it to the host with acl.rt.memcpy first")
    return ctypes.string_at(address, size)

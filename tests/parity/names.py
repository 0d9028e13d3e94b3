"""What geserve has, read from its code: config field paths, flags, extensions and pb_utils names."""

from __future__ import annotations

import functools
import inspect

from google.protobuf import descriptor

from geserve._generated import model_config_pb2 as mc
from geserve.backends.python import pb_utils
from geserve.core.service import EXTENSIONS
from geserve.flags import build_parser
from tests.parity.triton_lists import TRITON_EXTENSIONS, TRITON_FLAGS, TRITON_PB_UTILS


@functools.cache
def config_paths() -> dict[str, descriptor.FieldDescriptor]:
    """Every field path of ModelConfig (`a.b.c`), through messages, repeated messages and map values."""
    paths: dict[str, descriptor.FieldDescriptor] = {}

    def walk(message: descriptor.Descriptor, prefix: str, seen: frozenset[str]) -> None:
        for field in message.fields:
            path = prefix + field.name
            paths[path] = field
            child = field.message_type
            if child is not None and child.GetOptions().map_entry:
                child = child.fields_by_name["value"].message_type
            if child is not None and child.full_name not in seen:
                walk(child, path + ".", seen | {child.full_name})

    walk(mc.ModelConfig.DESCRIPTOR, "", frozenset({mc.ModelConfig.DESCRIPTOR.full_name}))
    return paths


def is_map(field: descriptor.FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


@functools.cache
def geserve_flags() -> set[str]:
    return {flag for action in build_parser()._actions for flag in action.option_strings if flag.startswith("--")}


@functools.cache
def all_flags() -> set[str]:
    return geserve_flags() | set(TRITON_FLAGS)


@functools.cache
def all_extensions() -> set[str]:
    return set(EXTENSIONS) | set(TRITON_EXTENSIONS)


def _is_own(value: object) -> bool:
    return getattr(value, "__module__", "").startswith("geserve.backends.python")


@functools.cache
def geserve_pb_utils() -> set[str]:
    """pb_utils' public names: module constants, functions and classes defined for it, and each class's
    public methods and attributes (with the DLPack dunders)."""
    names = set()
    for name, value in vars(pb_utils).items():
        if name.startswith("_") or inspect.ismodule(value):
            continue
        if (inspect.isclass(value) or inspect.isfunction(value)) and not _is_own(value):
            continue
        if not (inspect.isclass(value) or inspect.isfunction(value)) and not name.isupper():
            continue  # typing aliases
        names.add(name)
        if inspect.isclass(value):
            names |= {
                f"{name}.{member}"
                for member in vars(value)
                if not member.startswith("_") or member in {"__dlpack__", "__dlpack_device__"}
            }
    return names


@functools.cache
def all_pb_utils() -> set[str]:
    return geserve_pb_utils() | set(TRITON_PB_UTILS)


def resolve_pb_utils(name: str) -> object | None:
    """The object `name` names in geserve's pb_utils, or None."""
    value: object = pb_utils
    for part in name.split("."):
        if not hasattr(value, part):
            return None
        value = getattr(value, part)
    return value

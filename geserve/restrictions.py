"""Restricted API groups: the header key and value calls of a group must carry (compared in constant time)."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence

from geserve.errors import InvalidArgumentError
from geserve.settings import Restriction

# Triton's API group names (restricted_features.h).
GROUPS = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
)


def parse_restrictions(entries: Sequence[str], flag: str) -> dict[str, Restriction]:
    """`<group>[,<group>...]:<key>=<value>` entries -> group -> restriction; a group may appear once."""
    restrictions: dict[str, Restriction] = {}
    for entry in entries:
        groups, separator, rest = entry.partition(":")
        key, equals, value = rest.partition("=")
        if not separator or not equals or not key or not groups:
            raise InvalidArgumentError(f"{flag} expects <api>[,<api>...]:<key>=<value>, got '{entry}'")
        for group in (item.strip() for item in groups.split(",")):
            if group not in GROUPS:
                raise InvalidArgumentError(f"{flag}: unknown API '{group}' (known: {', '.join(GROUPS)})")
            if group in restrictions:
                raise InvalidArgumentError(f"{flag}: API '{group}' is restricted more than once")
            restrictions[group] = Restriction(key.strip().lower(), value)
    return restrictions


def allowed(restriction: Restriction | None, header: Callable[[str], str | None]) -> bool:
    """Whether a call carrying headers (looked up by `header(name)`) may use the group."""
    if restriction is None:
        return True
    given = header(restriction.key)
    return given is not None and hmac.compare_digest(given.encode(), restriction.value.encode())

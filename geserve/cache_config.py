"""--cache-config and --response-cache-byte-size, as tritonserver reads them, into the local cache's size."""

from __future__ import annotations

from collections.abc import Sequence

from geserve.errors import InvalidArgumentError

FORMAT = "<cache name>,<setting>=<value>"


def parse_cache_flags(entries: Sequence[str], byte_sizes: Sequence[str]) -> tuple[int, list[str]]:
    """(the local cache's size in bytes, 0 for no cache; warnings). Raises InvalidArgumentError for what tritonserver
    refuses (both flags, a malformed entry) and for what geserve has not (any cache but `local`, a setting but
    `size`, a size that is not a positive number of bytes)."""
    if entries and byte_sizes:
        raise InvalidArgumentError(
            "Incompatible flags --response-cache-byte-size and --cache-config both provided. "
            "Please provide one or the other."
        )
    if byte_sizes:
        value = byte_sizes[-1]
        size = _size(value, f"--response-cache-byte-size={value}")
        warning = (
            "'--response-cache-byte-size' has been deprecated! This will default to the 'local' cache "
            "implementation with the provided byte size for its config. Please use '--cache-config' instead. "
            f"The equivalent --cache-config CLI args would be: '--cache-config=local,size={value}'"
        )
        return size, [warning]
    settings: dict[str, dict[str, str]] = {}
    for entry in entries:
        name, setting, value = _entry(entry)
        settings.setdefault(name, {})[setting] = value
    if not settings:
        return 0, []
    if len(settings) > 1:
        raise InvalidArgumentError(
            f"--cache-config names {len(settings)} caches ({', '.join(sorted(settings))}): multiple cache "
            "configurations are not supported, give settings for one cache"
        )
    ((name, values),) = settings.items()
    if name != "local":
        raise InvalidArgumentError(
            f"--cache-config={name},...: the '{name}' cache is not available: geserve has the 'local' cache only "
            "(--cache-config=local,size=BYTES)"
        )
    unknown = sorted(set(values) - {"size"})
    if unknown:
        raise InvalidArgumentError(
            f"--cache-config=local,{unknown[0]}=...: the local cache has no setting '{unknown[0]}'; its one setting "
            "is size=BYTES"
        )
    if "size" not in values:
        raise InvalidArgumentError("Failed to initialize LocalCache: config didn't contain a valid 'size' field.")
    return _size(values["size"], f"--cache-config=local,size={values['size']}"), []


def _entry(entry: str) -> tuple[str, str, str]:
    """tritonserver's ParseCacheConfigOption: the name before the first comma, then setting=value."""
    name, comma, rest = entry.partition(",")
    if not comma or not name:
        raise InvalidArgumentError(f"No cache specified. --cache-config option format is {FORMAT}. Got {entry}")
    setting, equals, value = rest.partition("=")
    if not equals or not setting or not value:
        raise InvalidArgumentError(f"--cache-config option format is '{FORMAT}'. Got {entry}")
    return name, setting, value


def _size(text: str, flag: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise InvalidArgumentError(f"{flag}: the cache size must be a whole number of bytes")
    size = int(text)
    if size == 0:
        raise InvalidArgumentError(
            f"{flag}: the local cache needs a size of at least one byte; leave the flag out to run without a cache"
        )
    return size

"""The messages of the engine channel: calls of InferenceAPI methods by name, their answers, and pushed events."""

from __future__ import annotations

import enum

from geserve.core.api import InferenceAPI


class Kind(enum.IntEnum):
    """The first element of every message tuple."""

    CALL = 0  # (CALL, id, method, args): one answer
    STREAM = 1  # (STREAM, id, method, args): ITEMs, then END or ERROR
    CANCEL = 2  # (CANCEL, id): the caller gave up; the engine cancels the call and still answers it
    RESULT = 3  # (RESULT, id, value)
    ERROR = 4  # (ERROR, id, GeserveError)
    ITEM = 5  # (ITEM, id, value)
    END = 6  # (END, id)
    EVENT = 7  # (EVENT, name, value): the engine tells every protocol process (log settings changed)


LOG_SETTINGS_EVENT = "log_settings"
STREAM_METHODS = frozenset({"infer_stream"})
# Every coroutine method of the interface: the only names a call may carry.
CALL_METHODS = frozenset(
    name
    for name, member in vars(InferenceAPI).items()
    if callable(member) and not name.startswith("_") and name not in STREAM_METHODS
)

"""The messages of the engine channel: calls of the engine's methods by name, their answers, and pushed events."""

from __future__ import annotations

from geserve.core.api import EngineAPI


class Kind:
    """The first element of every message tuple: plain numbers, which pickle as themselves (an enum member would
    be looked up by name on every unpickling)."""

    CALL = 0  # (CALL, id, method, args): one answer
    STREAM = 1  # (STREAM, id, method, args): ITEMs, then END or ERROR
    CANCEL = 2  # (CANCEL, id): the caller gave up; the engine cancels the call and still answers it
    RESULT = 3  # (RESULT, id, value[, lease id]): a submission's answer holds its outputs until the lease's release
    ERROR = 4  # (ERROR, id, GeserveError)
    ITEM = 5  # (ITEM, id, value[, lease id])
    END = 6  # (END, id)
    EVENT = 7  # (EVENT, name, value): the engine tells every protocol process (models, regions, log settings)
    RELEASE = 8  # (RELEASE, lease ids): the answers' outputs are no longer read in the protocol process


LOG_SETTINGS_EVENT = "log_settings"
MODELS_EVENT = "models"  # the served models' snapshot (snapshots.ModelView by name)
REGIONS_EVENT = "regions"  # the client regions registered (snapshots.RegionView)
# A request, scheduled from its submission: answered with the outputs' descriptors and a lease.
SUBMIT_METHOD = "infer_submission"
# The models and regions as the engine has them now: asked for by a protocol process that found a name missing
# from its snapshots, which another process may have just loaded or registered (the event is on its way).
SNAPSHOTS_METHOD = "snapshots"
STREAM_METHODS = frozenset({"stream_submission"})
# Every coroutine method of the engine's API, a submission, and a refused request (for the statistics): the only
# names a call may carry.
CALL_METHODS = frozenset(
    {name for name, member in vars(EngineAPI).items() if callable(member) and not name.startswith("_")}
    | {SUBMIT_METHOD, SNAPSHOTS_METHOD, "refused"}
)

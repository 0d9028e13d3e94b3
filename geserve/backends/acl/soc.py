"""What geserve's reader says of an `.om` before the runtime is asked to load it: its SoC, held against the host's."""

from __future__ import annotations

import logging

from geserve.backends.acl.description import OmDescription
from geserve.backends.acl.om_file import read_description
from geserve.errors import ModelLoadError

logger = logging.getLogger(__name__)


def read_before_load(model_file: str) -> OmDescription | None:
    """The file's description as geserve's reader gives it, or None where the reader cannot read it (the
    runtime then has its own say). Read once at load, for every check made before load_from_file."""
    try:
        return read_description(model_file)
    except ModelLoadError as error:
        logger.debug("%s is not described before loading: %s", model_file, error.message)
        return None


def check_soc(model: str, model_file: str, host_soc: str, om: OmDescription | None) -> None:
    """Refuse a file compiled for another chip. ATC's --soc_version must match the chip that runs the model
    (pyacl.md §8; `acl.get_soc_name()` names this host's the way --soc_version does, e.g. Ascend310P3); the
    runtime's own refusal says only that loading failed. `om` is the file's description (read_before_load):
    its `soc_version` is the MODEL_DEF attr ATC records (om-format.md §1.4)."""
    compiled_for = om.soc_version if om is not None else None
    if not compiled_for or not host_soc:
        return
    if compiled_for.strip().lower() != host_soc.strip().lower():
        raise ModelLoadError(
            f"model '{model}': '{model_file}' was compiled for {compiled_for}, this host is {host_soc}: compile it "
            f"again with ATC --soc_version={host_soc}"
        )

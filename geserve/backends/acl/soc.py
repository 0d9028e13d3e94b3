"""The SoC an `.om` was compiled for, held against the host's before the runtime is asked to load it."""

from __future__ import annotations

import logging

from geserve.backends.acl.om_file import read_description
from geserve.errors import ModelLoadError

logger = logging.getLogger(__name__)


def recorded_soc(model_file: str) -> str | None:
    """The `soc_version` the file records (ATC --soc_version, a MODEL_DEF attr: om-format.md §1.4), or None
    where it records none or cannot be read here (the runtime then has its own say)."""
    try:
        return read_description(model_file).soc_version
    except ModelLoadError as error:
        logger.debug("the SoC of %s is not known before loading: %s", model_file, error.message)
        return None


def check_soc(model: str, model_file: str, host_soc: str) -> None:
    """Refuse a file compiled for another chip. ATC's --soc_version must match the chip that runs the model
    (pyacl.md §8; `acl.get_soc_name()` names this host's the way --soc_version does, e.g. Ascend310P3); the
    runtime's own refusal says only that loading failed."""
    compiled_for = recorded_soc(model_file)
    if not compiled_for or not host_soc:
        return
    if compiled_for.strip().lower() != host_soc.strip().lower():
        raise ModelLoadError(
            f"model '{model}': '{model_file}' was compiled for {compiled_for}, this host is {host_soc}: compile it "
            f"again with ATC --soc_version={host_soc}"
        )

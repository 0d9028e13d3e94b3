"""What geserve's reader says of an `.om` before the runtime is asked to load it: its SoC, held against the host's."""

from __future__ import annotations

import logging

from geserve.atc import chips
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
    """Refuse a file compiled for a chip of another architecture. The runtime loads an `.om` on any chip of the
    architecture ATC's --soc_version named (geserve.atc.chips); across architectures its own refusal says only
    that loading failed. `acl.get_soc_name()` names this host's chip the way --soc_version does (pyacl.md §8);
    `om` is the file's description (read_before_load): its `soc_version` is the MODEL_DEF attr ATC records
    (om-format.md §1.4). A file for another chip of the same family loads, with a warning: ATC tuned it for
    the chip it names."""
    compiled_for = om.soc_version if om is not None else None
    if not compiled_for or not host_soc or chips.same_chip(compiled_for, host_soc):
        return
    fix = f"compile it again with ATC --soc_version={host_soc}"
    if chips.compatible(compiled_for, host_soc):
        logger.warning(
            "model '%s': '%s' was compiled for %s, this host is %s: both are %s chips (one architecture), so the "
            "runtime loads it; to have a file made for this chip, %s",
            model, model_file, compiled_for, host_soc, chips.family(host_soc), fix,
        )  # fmt: skip
        return
    compiled_family, host_family = chips.family(compiled_for), chips.family(host_soc)
    if compiled_family is not None and host_family is not None:
        why = (
            f"{compiled_for} is an {compiled_family} chip and {host_soc} an {host_family} one, and the runtime loads "
            "an .om only on a chip of the architecture it was compiled for"
        )
    else:
        unknown = compiled_for if compiled_family is None else host_soc
        why = (
            f"the runtime loads an .om only on a chip of the architecture it was compiled for, and geserve does "
            f"not know the architecture of {unknown}, so it takes only the same chip"
        )
    raise ModelLoadError(
        f"model '{model}': '{model_file}' was compiled for {compiled_for}, this host is {host_soc}: {why}; {fix}"
    )

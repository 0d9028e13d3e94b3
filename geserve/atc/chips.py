"""Ascend chips grouped by architecture: which chips can run an `.om` compiled for another."""

from __future__ import annotations

# The runtime loads an .om on any chip whose architecture is that of the chip it was compiled for: it looks up
# both names' NpuArch in the platform files and compares the two (hicann/runtime
# src/runtime/api/impl/api_impl.cc ApiImpl::ModelCheckArchVersion, and ApiImpl::CheckArchCompatibility behind
# aclrtCheckArchCompatibility; soc_info.cc GetNpuArchByName). The groups below are the chips' [version] NpuArch
# in hicann/runtime src/platform/platform_config/cann/<chip>.ini. Each family is named by the Short_SoC_version of
# its first chips; Ascend910_93xx (Short_SoC_version Ascend910_93) shares NpuArch 2201 with the Ascend910B1..B4,
# and the chip named Ascend910B is the original Ascend 910 (NpuArch 1001), not one of them.
_FAMILIES: dict[str, tuple[str, ...]] = {
    # NpuArch 1001 (AIC-C-100)
    "Ascend910": ("Ascend910A", "Ascend910B", "Ascend910ProA", "Ascend910ProB", "Ascend910PremiumA"),
    # NpuArch 2201 (AIC-C-220)
    "Ascend910B": (
        "Ascend910B1",
        "Ascend910B2",
        "Ascend910B2C",
        "Ascend910B3",
        "Ascend910B4",
        "Ascend910B4-1",
        "Ascend910_9362",
        "Ascend910_9363",
        "Ascend910_9372",
        "Ascend910_9381",
        "Ascend910_9382",
        "Ascend910_9391",
        "Ascend910_9392",
    ),
    # NpuArch 2002 (AIC-M-200)
    "Ascend310P": ("Ascend310P1", "Ascend310P3", "Ascend310P5", "Ascend310P7"),
    # NpuArch 3002 (AIC-M-300)
    "Ascend310B": ("Ascend310B1", "Ascend310B2", "Ascend310B3", "Ascend310B4"),
}
# ATC's --soc_version and acl.get_soc_name() spell a chip the same way; case is not what tells two chips apart.
_FAMILY_OF = {chip.casefold(): name for name, chips in _FAMILIES.items() for chip in chips}


def family(soc: str) -> str | None:
    """The family (one architecture) of a chip named as ATC's --soc_version names it, e.g. Ascend310P for
    Ascend310P3; None for a chip not listed here."""
    return _FAMILY_OF.get(soc.strip().casefold())


def same_chip(first: str, second: str) -> bool:
    return first.strip().casefold() == second.strip().casefold()


def compatible(compiled_for: str, host: str) -> bool:
    """Whether a chip named `host` runs an `.om` compiled for `compiled_for`: the same chip, or one of its family.
    A chip not listed here is taken to run only files compiled for itself."""
    if same_chip(compiled_for, host):
        return True
    compiled_family = family(compiled_for)
    return compiled_family is not None and compiled_family == family(host)


def siblings(soc: str) -> tuple[str, ...]:
    """The other chips of `soc`'s family, in the order listed: those that run an `.om` compiled for it."""
    name = family(soc)
    if name is None:
        return ()
    return tuple(chip for chip in _FAMILIES[name] if not same_chip(chip, soc))

"""What a protocol process knows of the served models and client regions: snapshots the engine pushes on change."""

# A request is checked where it is decoded, against the version it addresses, by whatever process decodes it. One
# process reads the engine's own models; a protocol process reads the snapshots the engine sent it. Either way a
# version says which load of it it is, so that the engine can tell a request checked against an earlier load (a
# reload raced it) and check it again.

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from geserve.codecs.digits import decimal_value, shortened
from geserve.errors import InvalidArgumentError, NotFoundError, UnavailableError
from geserve.types import TensorSpec


class ServedVersion(Protocol):
    """A served model version as a request is checked and answered against it."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> int: ...

    @property
    def version_str(self) -> str: ...

    @property
    def load(self) -> int: ...  # which load of the version: every load (and reload) has its own number

    @property
    def inputs(self) -> Mapping[str, TensorSpec]: ...

    @property
    def outputs(self) -> Mapping[str, TensorSpec]: ...

    @property
    def output_names(self) -> tuple[str, ...]: ...

    @property
    def max_batch_size(self) -> int: ...

    @property
    def decoupled(self) -> bool: ...

    @property
    def labels(self) -> Mapping[str, list[str]]: ...  # per output, from its label_filename (classification)

    @property
    def ready(self) -> bool: ...


class ServedModel(Protocol):
    """A model name with its loaded versions."""

    @property
    def versions(self) -> Mapping[int, ServedVersion]: ...

    def ready_versions(self) -> Sequence[ServedVersion]: ...


@dataclass(frozen=True, slots=True)
class VersionView:
    """A loaded version as the engine described it in its last snapshot. Whether it is ready now (an instance may
    be restarting) is the engine's to tell: a view counts as ready, and the engine refuses what it cannot run."""

    name: str
    version: int
    load: int
    inputs: Mapping[str, TensorSpec]
    outputs: Mapping[str, TensorSpec]
    max_batch_size: int
    decoupled: bool
    labels: Mapping[str, list[str]]

    @property
    def ready(self) -> bool:
        return True

    @property
    def version_str(self) -> str:
        return str(self.version)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(self.outputs)

    @classmethod
    def of(cls, served: ServedVersion) -> VersionView:
        return cls(
            served.name,
            served.version,
            served.load,
            dict(served.inputs),
            dict(served.outputs),
            served.max_batch_size,
            served.decoupled,
            dict(served.labels),
        )


@dataclass(frozen=True, slots=True)
class ModelView:
    """A model's versions as the engine described them in its last snapshot."""

    versions: Mapping[int, VersionView] = field(default_factory=dict)

    def ready_versions(self) -> Sequence[ServedVersion]:
        return [self.versions[number] for number in sorted(self.versions) if self.versions[number].ready]

    @classmethod
    def of(cls, model: ServedModel) -> ModelView:
        return cls({number: VersionView.of(version) for number, version in model.versions.items()})


def snapshot_of(models: Mapping[str, ServedModel]) -> dict[str, ModelView]:
    """Every model's loaded versions as they are now (what the engine pushes to the protocol processes)."""
    return {name: ModelView.of(model) for name, model in models.items()}


def find_version(models: Mapping[str, ServedModel], name: str, version: str = "") -> ServedVersion:
    """The version a request addresses (the latest ready one without a number); Triton's errors for unknown
    models and versions."""
    model = models.get(name)
    if model is None:
        raise InvalidArgumentError(f"Request for unknown model: '{name}' is not found")
    if version:
        number = decimal_value(version)
        if number is None:
            raise InvalidArgumentError(f"failed to parse model version '{shortened(version)}' of model '{name}'")
        found = model.versions.get(number)
        if found is None:
            raise NotFoundError(f"Request for unknown model: '{name}' version {number} is not found")
        if not found.ready:
            # Known but restarting or failed: clients should retry, not give up on a missing model.
            raise UnavailableError(f"'{name}' version {number} is not at ready state")
        return found
    ready = model.ready_versions()
    if not ready:
        if model.versions:
            raise UnavailableError(f"'{name}' version {max(model.versions)} is not at ready state")
        raise NotFoundError(f"Request for unknown model: '{name}' has no available versions")
    return ready[-1]


@dataclass(frozen=True, slots=True)
class RegionView:
    """A client's registered system shared-memory region: where its bytes lie, and which file it was."""

    name: str
    key: str  # without the leading slash: the file under /dev/shm
    offset: int
    byte_size: int
    inode: int

"""`geserve check` of ensembles: their steps checked against the checked models, as the server checks them at load."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from geserve._generated import model_config_pb2 as mc
from geserve.core.ensemble import Step, check_steps, is_ensemble, steps_of
from geserve.errors import GeserveError, NotFoundError
from geserve.offline import completable
from geserve.offline.problems import Checked, Problem, unchecked
from geserve.repository.scan import ModelSource


class CheckedModels:
    """The versions that checked clean, standing for the loaded ones: a step without a version number runs on the
    latest, as a request to the model would. `unloaded` are ensembles the server has not loaded yet when it loads
    the one checked: it finds no version of them."""

    def __init__(self, checked: Mapping[str, Checked], unloaded: Collection[str] = ()) -> None:
        self._checked = checked
        self._unloaded = frozenset(unloaded)

    def available(self, name: str) -> bool:
        found = self._checked.get(name)
        return name not in self._unloaded and found is not None and bool(found.configs)

    def configs(self, name: str) -> list[mc.ModelConfig]:
        found = self._checked.get(name)
        return list(found.configs.values()) if found is not None and name not in self._unloaded else []

    def config(self, step: Step) -> mc.ModelConfig:
        configs = self._checked[step.model_name].configs
        if step.model_version < 0:
            return configs[max(configs)]
        if step.model_version not in configs:
            # The server's words for a request to a version it does not serve (core.models.find_version).
            raise NotFoundError(
                f"Request for unknown model: '{step.model_name}' version {step.model_version} is not found"
            )
        return configs[step.model_version]


def check_ensembles(sources: Mapping[str, ModelSource], checked: dict[str, Checked]) -> None:
    """Each ensemble whose own config checked clean, once the models its steps use are checked, in the order the
    server loads them (core.repository.ModelRepository.load_startup); a failed one is no longer available to the
    ensembles that use it."""
    waiting = {name: _step_models(result) for name, result in checked.items() if _is_ensemble(result)}
    while waiting:
        ready = [name for name, needs in waiting.items() if not needs & waiting.keys()]
        if ready:
            for name in ready:
                del waiting[name]
                _check(sources[name], checked, ())
            continue
        # A cycle between ensembles, or one that uses itself: the server loads them one after another, and each
        # finds those after it (itself too) not loaded yet: it fails naming them "not available".
        for name in sorted(waiting):
            unloaded = set(waiting)
            del waiting[name]
            _check(sources[name], checked, unloaded)


def _check(source: ModelSource, checked: dict[str, Checked], unloaded: Collection[str]) -> None:
    result = checked[source.name]
    models = CheckedModels(checked, unloaded)
    completed = {name: found.completed_at_load for name, found in checked.items() if found.completed_at_load}
    where = source.path / "config.pbtxt"
    # Every version of an ensemble has the one config.pbtxt (check_model), so one check stands for them all.
    config = next(iter(result.configs.values()))
    try:
        check_steps(config, models)
    except GeserveError as error:
        reasons = completable.could_resolve(error, completed)
        certain = _check_without(config, models, set(completed)) if reasons else None
        if reasons and certain is None:
            result.notes.append(Problem(where, "ensemble_scheduling", unchecked(error.message, reasons)))
            return
        result.problems.append(Problem(where, "ensemble_scheduling", (certain or error).message))
        result.configs.clear()


def _check_without(config: mc.ModelConfig, models: CheckedModels, completed: set[str]) -> GeserveError | None:
    """The steps on models that are checked in full, checked again without the others: what fails among them fails
    at load whatever completion adds to the others' configs."""
    rest = mc.ModelConfig()
    rest.CopyFrom(config)
    del rest.ensemble_scheduling.step[:]
    rest.ensemble_scheduling.step.extend(
        step for step in config.ensemble_scheduling.step if step.model_name not in completed
    )
    try:
        check_steps(rest, models)
    except GeserveError as error:
        return error
    return None


def _is_ensemble(result: Checked) -> bool:
    return any(is_ensemble(config) for config in result.configs.values())


def _step_models(result: Checked) -> set[str]:
    return {step.model_name for config in result.configs.values() for step in steps_of(config)}

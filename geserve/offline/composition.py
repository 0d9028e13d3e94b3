"""`geserve check` of ensembles: their steps checked against the checked models, as the server checks them at load."""

from __future__ import annotations

from collections.abc import Mapping

from geserve._generated import model_config_pb2 as mc
from geserve.core.ensemble import Step, check_steps, is_ensemble, steps_of
from geserve.errors import GeserveError, NotFoundError
from geserve.offline.problems import Checked, Problem, unchecked
from geserve.repository.scan import ModelSource


class CheckedModels:
    """The versions that checked clean, standing for the loaded ones: a step without a version number runs on the
    latest, as a request to the model would."""

    def __init__(self, checked: Mapping[str, Checked]) -> None:
        self._checked = checked

    def available(self, name: str) -> bool:
        found = self._checked.get(name)
        return found is not None and bool(found.configs)

    def configs(self, name: str) -> list[mc.ModelConfig]:
        found = self._checked.get(name)
        return list(found.configs.values()) if found is not None else []

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
    """Each ensemble whose own config checked clean, once the models its steps use are checked (in the order the
    server loads them); a failed one is no longer available to the ensembles that use it."""
    waiting = {name: _step_models(result) for name, result in checked.items() if _is_ensemble(result)}
    while waiting:
        tried = set(checked) - set(waiting)
        ready = [name for name, needs in waiting.items() if needs <= tried or not needs & set(waiting)]
        for name in ready or sorted(waiting):  # a cycle between ensembles: each fails naming what it lacks
            del waiting[name]
            _check(sources[name], checked)


def _check(source: ModelSource, checked: dict[str, Checked]) -> None:
    result = checked[source.name]
    models = CheckedModels(checked)
    for _, config in sorted(result.configs.items()):
        try:
            check_steps(config, models)
        except GeserveError as error:
            where = source.path / "config.pbtxt"
            reasons = {
                step: checked[step].completed_at_load
                for step in _step_models(result)
                if step in checked and checked[step].completed_at_load
            }
            if reasons:
                # The server may complete those configs at load with what the steps need.
                result.notes.append(Problem(where, "ensemble_scheduling", unchecked(error.message, reasons)))
                return
            result.problems.append(Problem(where, "ensemble_scheduling", error.message))
            result.configs.clear()
            return


def _is_ensemble(result: Checked) -> bool:
    return any(is_ensemble(config) for config in result.configs.values())


def _step_models(result: Checked) -> set[str]:
    return {step.model_name for config in result.configs.values() for step in steps_of(config)}

"""pb_utils.ModelConfig: the config a python model's `auto_complete_config` reads and completes, in Triton's JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


class ModelConfig:
    """The config handed to `auto_complete_config`, in Triton's JSON form."""

    def __init__(self, model_config: Mapping[str, Any] | str) -> None:
        self._config: dict[str, Any] = json.loads(model_config) if isinstance(model_config, str) else dict(model_config)

    def as_dict(self) -> dict[str, Any]:
        return self._config

    def max_batch_size(self) -> int:
        return int(self._config.get("max_batch_size", 0))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = self.max_batch_size()
        if current not in (0, max_batch_size):
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in auto-complete-config function for model "
                f"'{self._config.get('name', '')}' specified max_batch_size {max_batch_size}"
            )
        self._config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        if "sequence_batching" in self._config:
            raise ValueError("configuration already specified sequence_batching; cannot also set dynamic_batching")
        self._config.setdefault("dynamic_batching", {})

    def add_input(self, input: Mapping[str, Any]) -> None:
        self._add("input", input)

    def add_output(self, output: Mapping[str, Any]) -> None:
        self._add("output", output)

    def set_model_transaction_policy(self, transaction_policy_dict: Mapping[str, Any]) -> None:
        current = self._config.get("model_transaction_policy", {})
        for key, value in transaction_policy_dict.items():
            if key != "decoupled":
                raise ValueError(f"unknown model transaction policy field '{key}'")
            if "decoupled" in current and bool(current["decoupled"]) != bool(value):
                raise ValueError(
                    f"trying to change decoupled property in auto-complete-config for model "
                    f"'{self._config.get('name', '')}', which is already set to {current['decoupled']}"
                )
        self._config["model_transaction_policy"] = {**current, **dict(transaction_policy_dict)}

    def _add(self, kind: str, tensor: Mapping[str, Any]) -> None:
        for field in ("name", "data_type", "dims"):
            if field not in tensor:
                raise ValueError(f"{kind} in auto-complete-config for model '{self._config.get('name', '')}' "
                                 f"is missing the '{field}' property")  # fmt: skip
        entries: list[dict[str, Any]] = self._config.setdefault(kind, [])
        for entry in entries:
            if entry.get("name") != tensor["name"]:
                continue
            for field in ("data_type", "dims", "optional"):
                if (
                    field in tensor
                    and entry.get(field) not in (None, [], "TYPE_INVALID")
                    and entry[field] != tensor[field]
                ):
                    raise ValueError(
                        f"unable to add {kind} '{tensor['name']}' for model '{self._config.get('name', '')}': its "
                        f"{field} {tensor[field]} differs from the configuration's {entry[field]}"
                    )
            entry.update({key: value for key, value in tensor.items() if entry.get(key) in (None, [], "TYPE_INVALID")})
            return
        entries.append(dict(tensor))

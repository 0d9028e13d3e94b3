"""Ragged batching and batch inputs/outputs: where geserve serves them, and the load errors elsewhere."""

from __future__ import annotations

from geserve._generated import model_config_pb2 as mc
from geserve.errors import ModelLoadError

# Backends whose execute takes a batch as its list of requests, each with tensors of its own shape: ragged
# inputs need no concatenation there (Triton's python backend works the same way).
RAGGED_BACKENDS = frozenset({"python"})


def ragged_inputs(config: mc.ModelConfig) -> frozenset[str]:
    """The inputs whose dims may differ between the requests of one batch (allow_ragged_batch)."""
    return frozenset(tensor.name for tensor in config.input if tensor.allow_ragged_batch)


def refuse_unsupported(config: mc.ModelConfig) -> None:
    """Fields geserve cannot honour on this config's backend fail the load, naming the field: better than a
    batch input the model never receives, or requests batched as they would not be under Triton."""
    name, backend = config.name, config.backend
    for batch_input in config.batch_input:
        kind = mc.BatchInput.Kind.Name(batch_input.kind)
        targets = ", ".join(f"'{target}'" for target in batch_input.target_name) or "none"
        raise ModelLoadError(
            f"model '{name}': batch_input of kind {kind} (target {targets}) is not supported by geserve's "
            f"'{backend}' backend: {_batch_input_reason(backend)}"
        )
    for batch_output in config.batch_output:
        kind = mc.BatchOutput.Kind.Name(batch_output.kind)
        targets = ", ".join(f"'{target}'" for target in batch_output.target_name) or "none"
        raise ModelLoadError(
            f"model '{name}': batch_output of kind {kind} (target {targets}) is not supported by geserve's "
            f"'{backend}' backend: geserve does not scatter batch outputs; each request gets its own rows"
        )
    for tensor in config.input:
        if not tensor.allow_ragged_batch:
            continue
        if backend not in RAGGED_BACKENDS:
            raise ModelLoadError(
                f"model '{name}': input '{tensor.name}' sets allow_ragged_batch, which geserve's '{backend}' "
                "backend does not support: it runs a batch as one tensor per input, and ragged inputs would "
                "need batch_input tensors, which geserve does not generate; remove allow_ragged_batch (requests "
                "of different shapes then run in separate batches) or pad the requests"
            )
        if config.HasField("sequence_batching"):
            raise ModelLoadError(
                f"model '{name}': input '{tensor.name}' sets allow_ragged_batch, which geserve supports with "
                "the dynamic batcher only, not with sequence_batching"
            )


def _batch_input_reason(backend: str) -> str:
    if backend in RAGGED_BACKENDS:
        # Triton's python backend hands execute each request's own inputs and never builds batch inputs.
        return (
            "as under Triton's python backend, execute receives each request with its own inputs and no batch "
            "inputs are generated; read each request's shapes from its tensors"
        )
    return "geserve does not generate batch inputs"

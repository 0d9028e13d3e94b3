"""What completion at load may still add to a config `geserve check` reads as written: which failures it notes."""

from __future__ import annotations

from collections.abc import Mapping

from geserve._generated import model_config_pb2 as mc
from geserve.core.ensemble import StepError
from geserve.errors import GeserveError

# Stand-ins for what auto_complete_config may add: valid, and named so that no config's own tensor clashes.
_ADDED_INPUT = "<input auto_complete_config may add>"
_ADDED_OUTPUT = "<output auto_complete_config may add>"


def could_resolve(error: GeserveError, completed: Mapping[str, str]) -> dict[str, str]:
    """The models completed at load (name -> why) whose completion could make a failed ensemble step check pass;
    empty when the failure is certain. Completion adds tensors and fills data types and dims a config leaves out
    (backends.completion.complete_tensors, backends.python.model_config); what else a step check refuses (a model
    not available, a version not served, a max_batch_size or decoupled policy the config sets, the response cache)
    it never changes: a max_batch_size already set is kept (backends.acl.completion._auto_complete;
    backends.python.model_config.ModelConfig.set_max_batch_size refuses to change it)."""
    if not isinstance(error, StepError):
        return {}
    return {name: completed[name] for name in error.undeclared_in if name in completed}


def as_auto_complete_could_fill(config: mc.ModelConfig) -> mc.ModelConfig:
    """A python model's config as its auto_complete_config could at best complete it, for validation: a tensor
    where the config declares none, each data type it leaves out, a max_batch_size where it sets none (0) that
    admits every preferred batch size. Its ModelConfig adds and fills, and never renames, removes or changes what the
    config sets (backends.python.model_config; Triton's, in triton-inference-server/python_backend
    src/resources/triton_python_backend_utils.py, may raise a max_batch_size the config sets, geserve's keeps it):
    what fails validation even so fails at load."""
    filled = mc.ModelConfig()
    filled.CopyFrom(config)
    if not filled.input:
        filled.input.add(name=_ADDED_INPUT, data_type=mc.TYPE_FP32, dims=[-1])
    if not filled.output:
        filled.output.add(name=_ADDED_OUTPUT, data_type=mc.TYPE_FP32, dims=[-1])
    tensors: list[mc.ModelInput | mc.ModelOutput] = [*filled.input, *filled.output]
    for tensor in tensors:
        if tensor.data_type == mc.TYPE_INVALID:
            tensor.data_type = mc.TYPE_FP32
    sizes = [*filled.dynamic_batching.preferred_batch_size, *filled.sequence_batching.oldest.preferred_batch_size]
    if filled.max_batch_size == 0 and max(sizes, default=0) > 1:
        filled.max_batch_size = max(sizes)
    return filled

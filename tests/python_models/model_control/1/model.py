"""Runs ACTION on model TARGET with ARGUMENT from execute: pb_utils.load_model (ARGUMENT the config JSON),
load_files (a python model written from ARGUMENT, its model.py, with a config), unload_model, is_model_ready
(ARGUMENT the version), log (Logger.log with the levels on the class), and BLS calls to TARGET (INPUT0 ->
OUTPUT0, FP32) with a preferred memory (ARGUMENT: cpu or gpu), the request's trace (an InferenceTrace) and flags set,
or with an unknown keyword (bogus). Errors are raised, so the client sees them."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

PASSTHROUGH_CONFIG = {
    "backend": "python",
    "max_batch_size": 0,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
}
MEMORY = {
    "cpu": pb_utils.TRITONSERVER_MEMORY_CPU,
    "gpu": pb_utils.TRITONSERVER_MEMORY_GPU,
}


class TritonPythonModel:
    def execute(self, requests):
        return [self._run(request) for request in requests]

    def _run(self, request):
        def text(name):
            return pb_utils.get_input_tensor_by_name(request, name).as_numpy()[0].decode()

        action, target, argument = text("ACTION"), text("TARGET"), text("ARGUMENT")
        ready, output = False, np.zeros(0, dtype=np.float32)
        if action == "load":
            pb_utils.load_model(target, config=argument)
        elif action == "load_files":
            pb_utils.load_model(
                model_name=target,
                config=json.dumps(PASSTHROUGH_CONFIG),
                files={"file:1/model.py": argument.encode()},
            )
        elif action == "unload":
            pb_utils.unload_model(target)
        elif action == "ready":
            ready = pb_utils.is_model_ready(target, argument)
        elif action == "log":
            pb_utils.Logger.log(f"{argument} at INFO", pb_utils.Logger.INFO)
            pb_utils.Logger.log(f"{argument} at WARNING", pb_utils.Logger.WARNING)
            pb_utils.Logger.log(f"{argument} at ERROR", pb_utils.Logger.ERROR)
            pb_utils.Logger.log(f"{argument} at VERBOSE", pb_utils.Logger.VERBOSE)
            pb_utils.Logger.log(f"{argument} at LogLevel.WARNING", pb_utils.Logger.LogLevel.WARNING)
            ready = pb_utils.Logger.INFO == pb_utils.Logger.LogLevel.INFO == 0
        elif action == "bls":
            inputs = [pb_utils.Tensor("INPUT0", np.arange(3, dtype=np.float32))]
            if argument == "bogus":
                call = pb_utils.InferenceRequest(model_name=target, inputs=inputs, bogus=1)
            else:
                call = pb_utils.InferenceRequest(
                    model_name=target,
                    inputs=inputs,
                    requested_output_names=["OUTPUT0"],
                    trace=request.trace(),
                    preferred_memory=pb_utils.PreferredMemory(MEMORY[argument], 0),
                )
            call.set_flags(
                pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START | pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
            )
            assert call.flags() == 3 and call.trace().get_context() is None
            answer = call.exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            output, ready = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy(), True
        else:
            raise pb_utils.TritonModelException(f"unknown action {action}")
        return pb_utils.InferenceResponse(
            [pb_utils.Tensor("READY", np.array([ready])), pb_utils.Tensor("OUTPUT0", output)]
        )

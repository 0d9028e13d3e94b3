"""Calls itself through BLS, without a timeout, DEPTH times: OUT is the number of calls that answered. Each
level's instance waits for the next, so a depth reaching past its instances can only fail; that error
(the call's own) is this request's. The config parameter `target` names another model to call instead (an
ensemble with this one as its step: the loop goes around it)."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.name = parameters.get("target", {}).get("string_value") or args["model_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            depth = int(pb_utils.get_input_tensor_by_name(request, "DEPTH").as_numpy()[0])
            if depth <= 0:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([0], dtype=np.int32))]))
                continue
            inner = pb_utils.Tensor("DEPTH", np.array([depth - 1], dtype=np.int32))
            answer = pb_utils.InferenceRequest(
                model_name=self.name, inputs=[inner], requested_output_names=["OUT"]
            ).exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(answer.error().message())))
                continue
            calls = pb_utils.get_output_tensor_by_name(answer, "OUT").as_numpy() + 1
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", calls.astype(np.int32))]))
        return responses

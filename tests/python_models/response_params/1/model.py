"""Answers with the response parameters its PARAMS input spells in JSON (run as Triton's python backend runs it)."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.calls = 0
        self.tail = args["model_name"].endswith("_tail")

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "PARAMS").as_numpy().reshape(-1)[0].decode()
            self.calls += 1
            parameters = json.loads(text)
            if isinstance(parameters, dict):
                if "calls" in parameters:  # tells a cached response from a fresh one
                    parameters["calls"] = self.calls
                if self.tail:
                    parameters["step"] = "tail"
                if parameters.pop("as_text", False):
                    parameters = json.dumps(parameters)  # the JSON string form
            output = pb_utils.Tensor("OUTPUT", np.array([text.encode()], dtype=np.object_))
            # A value of a type Triton does not allow (float, None, list) raises here and fails execute.
            responses.append(pb_utils.InferenceResponse(output_tensors=[output], parameters=parameters))
        return responses

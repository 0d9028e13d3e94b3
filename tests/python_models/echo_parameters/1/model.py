"""Answers with the request's custom parameters (JSON), its id, and the initialize() args it got."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = json.dumps({key: value for key, value in args.items() if key != "model_config"})

    def execute(self, requests):
        responses = []
        for request in requests:
            outputs = [
                pb_utils.Tensor("PARAMETERS", np.array([request.parameters().encode()], dtype=np.object_)),
                pb_utils.Tensor("REQUEST_ID", np.array([request.request_id().encode()], dtype=np.object_)),
                pb_utils.Tensor("ARGS", np.array([self.args.encode()], dtype=np.object_)),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses

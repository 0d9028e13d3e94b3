"""Sends one response per element of the JSON list in PARAMS, each with that element as its parameters."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "PARAMS").as_numpy().reshape(-1)[0].decode()
            sender = request.get_response_sender()
            for parameters in json.loads(text):
                output = pb_utils.Tensor("OUTPUT", np.array([json.dumps(parameters).encode()], dtype=np.object_))
                sender.send(pb_utils.InferenceResponse(output_tensors=[output], parameters=parameters))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

"""Calls itself through BLS with a 300 ms timeout: its one instance is busy running the caller, so the call
could only time out; the server refuses it at once as a cycle. Answers the call's error text."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            answer = pb_utils.InferenceRequest(
                model_name="bls_loop", inputs=[data], requested_output_names=["ERROR"], timeout=300_000
            ).exec()
            text = answer.error().message() if answer.has_error() else "answered"
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("ERROR", np.array([text.encode()], dtype=np.object_))])
            )
        return responses

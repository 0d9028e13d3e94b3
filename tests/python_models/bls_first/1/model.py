"""Takes only the first of the responses `repeat_int32` streams back through BLS and stops listening."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            inputs = [
                pb_utils.Tensor("IN", values),
                pb_utils.Tensor("DELAY", np.full(values.shape, 20, dtype=np.uint32)),
                pb_utils.Tensor("WAIT", np.zeros(1, dtype=np.uint32)),
            ]
            streamed = pb_utils.InferenceRequest(model_name="repeat_int32", inputs=inputs).exec(decoupled=True)
            first = next(iter(streamed))
            del streamed  # the rest still arrives, and nobody reads it
            responses.append(pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(first, "OUT")]))
        return responses

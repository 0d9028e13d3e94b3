"""Opens two decoupled BLS streams to `repeat_int32` (no delay, so responses pile up unread): breaks out of the
first after its first response, and drops the second without reading it. Answers that first value."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            inputs = [
                pb_utils.Tensor("IN", values),
                pb_utils.Tensor("DELAY", np.zeros(values.shape, dtype=np.uint32)),
                pb_utils.Tensor("WAIT", np.zeros(1, dtype=np.uint32)),
            ]
            first = None
            for answer in pb_utils.InferenceRequest(model_name="repeat_int32", inputs=inputs).exec(decoupled=True):
                first = pb_utils.get_output_tensor_by_name(answer, "OUT")
                break
            pb_utils.InferenceRequest(model_name="repeat_int32", inputs=inputs).exec(decoupled=True)
            responses.append(pb_utils.InferenceResponse([first]))
        return responses

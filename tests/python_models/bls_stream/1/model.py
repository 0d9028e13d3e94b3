"""Calls the decoupled `repeat_int32` with BLS `exec(decoupled=True)` and answers every value it streamed back."""

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
            streamed = pb_utils.InferenceRequest(model_name="repeat_int32", inputs=inputs).exec(decoupled=True)
            seen = []
            for answer in streamed:
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
                out = pb_utils.get_output_tensor_by_name(answer, "OUT")
                if out is not None:
                    seen.append(int(out.as_numpy().reshape(-1)[0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array(seen, dtype=np.int32))]))
        return responses

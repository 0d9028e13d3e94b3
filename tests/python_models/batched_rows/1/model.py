"""Y = 10 X per request, BATCH = how many requests execute got at once; a request with a negative
value gets its own INVALID_ARG error while the others in its batch succeed."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x < 0).any():
                error = pb_utils.TritonError("negative values are not allowed", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            batch = np.full((x.shape[0], 1), len(requests), dtype=np.int32)
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 10), pb_utils.Tensor("BATCH", batch)])
            )
        return responses

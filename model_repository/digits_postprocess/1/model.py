"""The most probable digit of each row, as a label ("0".."9"), and its probability."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            probabilities = pb_utils.get_input_tensor_by_name(request, "PROBABILITIES").as_numpy()
            best = probabilities.argmax(axis=1)
            labels = np.array([[str(int(digit)).encode()] for digit in best], dtype=np.object_)
            scores = probabilities[np.arange(len(best)), best].reshape(-1, 1).astype(np.float32)
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("LABEL", labels), pb_utils.Tensor("SCORE", scores)])
            )
        return responses

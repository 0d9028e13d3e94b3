"""Scale 8x8 grayscale images (0..255) to the 64 features of scikit-learn's digits (0..16), batch by batch."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            image = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
            pixels = (image.astype(np.float32) * (16.0 / 255.0)).reshape(image.shape[0], 64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PIXELS", pixels)]))
        return responses

"""A model whose execute returns one response instead of a list of them."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        in_0 = pb_utils.get_input_tensor_by_name(requests[0], "IN")
        return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", in_0.as_numpy())])

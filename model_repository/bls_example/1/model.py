"""Business logic scripting: this model asks `simple` and `digits` for their answers, as a Triton python
model does, and combines them. A failed call becomes this request's error."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            inputs = {name: pb_utils.get_input_tensor_by_name(request, name) for name in ("INPUT0", "INPUT1", "PIXELS")}
            simple = pb_utils.InferenceRequest(
                model_name="simple",
                inputs=[inputs["INPUT0"], inputs["INPUT1"]],
                requested_output_names=["OUTPUT0", "OUTPUT1"],
            ).exec()
            digits = pb_utils.InferenceRequest(
                model_name="digits",
                inputs=[pb_utils.Tensor("pixels", inputs["PIXELS"].as_numpy())],
                requested_output_names=["probabilities"],
            ).exec()
            failed = simple.error() or digits.error()
            if failed is not None:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(failed.message())))
                continue
            probabilities = pb_utils.get_output_tensor_by_name(digits, "probabilities").as_numpy()
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("SUM", pb_utils.get_output_tensor_by_name(simple, "OUTPUT0").as_numpy()),
                        pb_utils.Tensor("DIFFERENCE", pb_utils.get_output_tensor_by_name(simple, "OUTPUT1").as_numpy()),
                        pb_utils.Tensor("DIGIT", probabilities.argmax(axis=1).astype(np.int32)),
                    ]
                )
            )
        return responses

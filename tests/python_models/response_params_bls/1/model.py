"""Calls response_params (exec) and response_params_decoupled (exec(decoupled=True)) and answers with the
parameters() strings their responses gave, as a JSON list; its own response parameters are the first call's."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            unary = pb_utils.get_input_tensor_by_name(request, "PARAMS")
            streamed = pb_utils.get_input_tensor_by_name(request, "STREAMED")
            first = pb_utils.InferenceRequest(
                model_name="response_params",
                inputs=[pb_utils.Tensor("PARAMS", unary.as_numpy())],
                requested_output_names=["OUTPUT"],
            ).exec()
            if first.has_error():
                raise pb_utils.TritonModelException(first.error().message())
            texts = [first.parameters()]
            stream = pb_utils.InferenceRequest(
                model_name="response_params_decoupled",
                inputs=[pb_utils.Tensor("PARAMS", streamed.as_numpy())],
                requested_output_names=["OUTPUT"],
            ).exec(decoupled=True)
            texts += [response.parameters() for response in stream if response.output_tensors()]
            output = pb_utils.Tensor("OUTPUT", np.array([json.dumps(texts).encode()], dtype=np.object_))
            responses.append(pb_utils.InferenceResponse([output], parameters=json.loads(first.parameters())))
        return responses

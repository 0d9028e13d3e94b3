"""Calls model TARGET (INPUT0 -> OUTPUT0) with DATA through BLS `exec`, with TIMEOUT_US as the request's
timeout; answers its OUTPUT0, or the call's error text in ERROR."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            target = pb_utils.get_input_tensor_by_name(request, "TARGET").as_numpy()[0].decode()
            data = pb_utils.get_input_tensor_by_name(request, "DATA").as_numpy()
            timeout = int(pb_utils.get_input_tensor_by_name(request, "TIMEOUT_US").as_numpy()[0])
            answer = pb_utils.InferenceRequest(
                model_name=target,
                inputs=[pb_utils.Tensor("INPUT0", data)],
                requested_output_names=["OUTPUT0"],
                timeout=timeout,
            ).exec()
            if answer.has_error():
                output, error = np.zeros(0, dtype=np.float32), answer.error().message()
            else:
                output, error = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy(), ""
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("OUTPUT", output),
                        pb_utils.Tensor("ERROR", np.array([error.encode()], dtype=np.object_)),
                    ]
                )
            )
        return responses

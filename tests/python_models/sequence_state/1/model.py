"""A running sum kept in implicit state, as Triton's python backend passes it: the state is an input tensor of
each request, and the next state an output tensor of its response. It also reports the request's correlation id
and flags, and the START and READY controls it was given."""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        # A test can slow every batch down, to have requests in flight at a given moment.
        self.delay_s = float(parameters.get("delay_s", {}).get("string_value", "0"))

    def execute(self, requests):
        time.sleep(self.delay_s)
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            state = pb_utils.get_input_tensor_by_name(request, "INPUT_STATE").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            ready = pb_utils.get_input_tensor_by_name(request, "READY").as_numpy()
            total = (state + value).astype(np.int32)
            correlation = str(request.correlation_id()).encode()
            # FLAGS: the request's own flags (1 START, 2 END), plus 4 when the START control is set, 8 for READY.
            flags = request.flags() + 4 * int(start.reshape(-1)[0]) + 8 * int(ready.reshape(-1)[0])
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("OUTPUT", total),
                        pb_utils.Tensor("OUTPUT_STATE", total),
                        pb_utils.Tensor("CORRELATION", np.full(value.shape, correlation, dtype=np.object_)),
                        pb_utils.Tensor("FLAGS", np.full(value.shape, flags, dtype=np.int32)),
                    ]
                )
            )
        return responses

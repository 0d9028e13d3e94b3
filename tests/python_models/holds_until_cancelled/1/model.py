"""Holds a request with HOLD 1 until its client goes away (is_cancelled), one with HOLD 0 until every held
request of its batch has; logs what each request saw, and answers OUT = HOLD unless it was cancelled."""

import time

import triton_python_backend_utils as pb_utils

# Never holds a request longer than this, should a cancellation never arrive (the test then fails on its own).
LONGEST_HOLD_S = 60.0


class TritonPythonModel:
    def execute(self, requests):
        holds = [pb_utils.get_input_tensor_by_name(request, "HOLD") for request in requests]
        held = [request for request, hold in zip(requests, holds, strict=True) if hold.as_numpy().flat[0]]
        for request in requests:
            pb_utils.Logger.log_info(f"request {request.request_id()} running")
        deadline = time.monotonic() + LONGEST_HOLD_S
        while not all(request.is_cancelled() for request in held) and time.monotonic() < deadline:
            time.sleep(0.01)
        responses = []
        for request, hold in zip(requests, holds, strict=True):
            if request.is_cancelled():
                pb_utils.Logger.log_info(f"request {request.request_id()} cancelled")
                error = pb_utils.TritonError("the client went away", pb_utils.TritonError.CANCELLED)
                responses.append(pb_utils.InferenceResponse(error=error))
            else:
                pb_utils.Logger.log_info(f"request {request.request_id()} answered")
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", hold.as_numpy())]))
        return responses

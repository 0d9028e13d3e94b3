"""A decoupled model written for Triton's python backend: each element of IN comes back as its own
response (OUT, and its index IDX), DELAY[i] milliseconds after the previous one; WAIT milliseconds
after the last, the FINAL flag closes the stream. Requests are answered from threads, so `execute`
returns at once and the instance takes the next requests meanwhile."""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        json_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(json_config):
            raise pb_utils.TritonModelException("repeat_int32 must be deployed with a decoupled transaction policy")
        self.lock = threading.Lock()
        self.in_flight = 0
        self.idle = threading.Condition(self.lock)

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()
            wait = pb_utils.get_input_tensor_by_name(request, "WAIT").as_numpy()
            if delays.shape != values.shape:
                sender = request.get_response_sender()
                error = pb_utils.TritonError(
                    f"expected IN and DELAY shapes to match, got {list(values.shape)} and {list(delays.shape)}",
                    pb_utils.TritonError.INVALID_ARG,
                )
                sender.send(
                    pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
                )
                continue
            with self.lock:
                self.in_flight += 1
            thread = threading.Thread(target=self.respond, args=(request, values, delays, int(wait[0])), daemon=True)
            thread.start()

    def respond(self, request, values, delays, wait_ms):
        sender = request.get_response_sender()
        try:
            for index, (value, delay) in enumerate(zip(values, delays, strict=True)):
                if sender.is_cancelled():
                    break
                time.sleep(int(delay) / 1000)
                outputs = [
                    pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
                    pb_utils.Tensor("IDX", np.array([index], dtype=np.uint32)),
                ]
                sender.send(pb_utils.InferenceResponse(output_tensors=outputs))
            time.sleep(wait_ms / 1000)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            with self.lock:
                self.in_flight -= 1
                self.idle.notify_all()

    def finalize(self):
        # Let streams in progress end before the instance goes away.
        with self.lock:
            self.idle.wait_for(lambda: self.in_flight == 0, timeout=10)

"""A decoupled model that streams COUNT responses, 20 ms apart, and stops early when the client goes away."""

import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            threading.Thread(target=self.stream, args=(request, count), daemon=True).start()

    def stream(self, request, count):
        sender = request.get_response_sender()
        for index in range(count):
            if request.is_cancelled() or sender.is_cancelled():
                pb_utils.Logger.log_info(f"request {request.request_id()} cancelled after {index} responses")
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("INDEX", np.array([index], dtype=np.int32))]))
            time.sleep(0.02)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

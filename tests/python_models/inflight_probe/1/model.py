"""Echoes IN as OUT, and says in CONCURRENT how many of its requests it saw running at once (across instances).

Each request marks itself running in the `probe_dir` folder, then waits for a second one to show up there, up
to `WAIT_S`: two requests free to run side by side on its two instances always meet; one held back never does.
"""

import json
import os
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

WAIT_S = 3.0


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        self.folder = parameters["probe_dir"]["string_value"]

    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            mark = os.path.join(self.folder, f"{uuid.uuid4().hex}.running")
            open(mark, "w").close()
            seen = 1
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline and seen < 2:
                seen = max(seen, sum(1 for name in os.listdir(self.folder) if name.endswith(".running")))
                time.sleep(0.01)
            os.remove(mark)
            concurrent = np.array([seen], dtype=np.int32)
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value), pb_utils.Tensor("CONCURRENT", concurrent)])
            )
        return responses

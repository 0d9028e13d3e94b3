"""Triton python-backend model for `make bench-npu-peers`: sleeps t(b) = t0 + k*b for a batch of b, returns zeros."""

import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        self.t0_us = float(parameters["t0_us"]["string_value"])
        self.k_us = float(parameters["k_us"]["string_value"])
        self.log = os.open(parameters["batch_log"]["string_value"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def execute(self, requests):
        rows = [pb_utils.get_input_tensor_by_name(request, "input").shape()[0] for request in requests]
        batch = sum(rows)
        time.sleep((self.t0_us + self.k_us * batch) / 1e6)  # the device's time: the instance is held, no core is used
        os.write(self.log, f"{batch}\n".encode())
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("output", np.zeros((count, 1000), np.float32))])
            for count in rows
        ]

    def finalize(self):
        os.close(self.log)

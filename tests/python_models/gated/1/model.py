"""Ready only while the file named by its `ready_file` parameter exists (is_ready drives readiness)."""

import json
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        self.ready_file = parameters["ready_file"]["string_value"]

    def is_ready(self):
        return os.path.exists(self.ready_file)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")]) for r in requests]

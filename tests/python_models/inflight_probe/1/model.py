"""Echoes IN as OUT, and says in CONCURRENT how many of its requests it saw running at once (across instances).

Each request marks itself running in the `probe_dir` folder and waits, up to the `wait_s` parameter, to meet a
second one: two requests free to run side by side on its two instances always meet; one held back never does.
A request that starts while others run counts them and leaves each a `.met` note, under a lock file, so a
meeting is seen by both sides however briefly they overlap and however late the second one starts.
"""

import fcntl
import json
import os
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        self.folder = parameters["probe_dir"]["string_value"]
        self.wait_s = float(parameters["wait_s"]["string_value"])

    def _locked(self, action, mark):
        with open(os.path.join(self.folder, "lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                return action(mark)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _enter(self, mark):
        others = [name for name in os.listdir(self.folder) if name.endswith(".running")]
        for other in others:
            open(os.path.join(self.folder, other + ".met"), "w").close()
        open(mark, "w").close()
        return 1 + len(others)

    def _leave(self, mark):
        met = mark + ".met"
        seen_at_all = 2 if os.path.exists(met) else 1
        os.remove(mark)
        if os.path.exists(met):
            os.remove(met)
        return seen_at_all

    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            mark = os.path.join(self.folder, f"{uuid.uuid4().hex}.running")
            seen = self._locked(self._enter, mark)
            deadline = time.monotonic() + self.wait_s
            while time.monotonic() < deadline and seen < 2 and not os.path.exists(mark + ".met"):
                time.sleep(0.01)
            seen = max(seen, self._locked(self._leave, mark))
            concurrent = np.array([seen], dtype=np.int32)
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value), pb_utils.Tensor("CONCURRENT", concurrent)])
            )
        return responses

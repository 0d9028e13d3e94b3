"""A coroutine execute (and initialize), as Triton's python backend allows."""

import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def initialize(self, args):
        await asyncio.sleep(0)
        self.offset = 100

    async def execute(self, requests):
        await asyncio.sleep(0.001)
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + self.offset)]
            )
            for r in requests
        ]

"""An async model that asks `echo` twice at once with BLS `async_exec` and answers the sum (2 x INPUT0)."""

import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            calls = [
                pb_utils.InferenceRequest(
                    model_name="echo", inputs=[data], requested_output_names=["OUTPUT0"]
                ).async_exec()
                for _ in range(2)
            ]
            answers = await asyncio.gather(*calls)
            failed = next((answer.error() for answer in answers if answer.has_error()), None)
            if failed is not None:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(failed.message())))
                continue
            total = sum(pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy() for answer in answers)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", total)]))
        return responses

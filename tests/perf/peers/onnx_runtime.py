"""An MLServer runtime that runs an ONNX file with onnxruntime (MLServer ships none); runs in MLServer's venv."""

from __future__ import annotations

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class OnnxModel(MLModel):
    async def load(self) -> bool:
        options = ort.SessionOptions()
        for key in ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning"):
            options.add_session_config_entry(key, "0")  # the same session settings geserve uses
        path = await get_model_uri(self._settings)
        self._session = ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
        self._outputs = [output.name for output in self._session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {tensor.name: NumpyCodec.decode_input(tensor) for tensor in payload.inputs}
        results = self._session.run(self._outputs, feeds)
        outputs = [NumpyCodec.encode_output(name, array) for name, array in zip(self._outputs, results, strict=True)]
        for output in outputs:
            # perf_analyzer's HTTP client expects `binary_data_size` in any output `parameters` object.
            output.parameters = None
        return InferenceResponse(model_name=self.name, outputs=outputs)

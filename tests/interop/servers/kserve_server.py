"""KServe ModelServer of the interop suite: echo (inputs back as outputs) and strict (INT32 [1, 16] only), on the
REST and gRPC ports given as arguments."""

import sys

import numpy as np
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer
from kserve.errors import InvalidInput


class Echo(Model):
    def __init__(self, name: str):
        super().__init__(name)
        self.ready = True

    async def predict(self, payload: InferRequest, headers=None, response_headers=None) -> InferResponse:
        outputs = []
        for tensor in payload.inputs:
            output = InferOutput(name=tensor.name, shape=list(tensor.shape), datatype=tensor.datatype,
                                 parameters=tensor.parameters)
            # Raw here; KServe re-encodes each output for the REST answer as the request asked (JSON or binary).
            output.set_data_from_numpy(tensor.as_numpy(), binary_data=True)
            outputs.append(output)
        return InferResponse(response_id=payload.id, model_name=self.name, infer_outputs=outputs,
                             parameters=payload.parameters, use_binary_outputs=payload.use_binary_outputs)


class Strict(Model):
    def __init__(self, name: str):
        super().__init__(name)
        self.ready = True

    async def predict(self, payload: InferRequest, headers=None, response_headers=None) -> InferResponse:
        for tensor in payload.inputs:
            if tensor.datatype != "INT32":
                raise InvalidInput(f"input {tensor.name} must be INT32, got {tensor.datatype}")
            if list(tensor.shape) != [1, 16]:
                raise InvalidInput(f"input {tensor.name} must have shape [1, 16], got {list(tensor.shape)}")
        summed = sum(tensor.as_numpy() for tensor in payload.inputs).astype(np.int32)
        output = InferOutput(name="OUTPUT0", shape=list(summed.shape), datatype="INT32")
        output.set_data_from_numpy(summed, binary_data=payload.use_binary_outputs)
        return InferResponse(response_id=payload.id, model_name=self.name, infer_outputs=[output],
                             use_binary_outputs=payload.use_binary_outputs)


if __name__ == "__main__":
    http_port, grpc_port = int(sys.argv[1]), int(sys.argv[2])
    ModelServer(http_port=http_port, grpc_port=grpc_port, workers=1, enable_latency_logging=False).start(
        [Echo("echo"), Strict("strict")]
    )

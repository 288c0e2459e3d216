"""MLServer runtimes of the interop suite: echo (inputs back as outputs), strict (INT32 [1, 16] only), decode
(describes how MLServer decoded each input by its content type) and count (streams)."""

import json

import numpy as np

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.errors import MLServerError
from mlserver.types import InferenceRequest, InferenceResponse, ResponseOutput


def datatype(tensor) -> str:
    return getattr(tensor.datatype, "value", tensor.datatype)


def without_headers(parameters):
    """Request parameters minus the HTTP headers MLServer files there (it would send them back as its own)."""
    if parameters is None:
        return None
    return parameters.model_copy(update={"headers": None})


class Echo(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        outputs = [
            ResponseOutput(
                name=tensor.name,
                shape=tensor.shape,
                datatype=tensor.datatype,
                data=tensor.data,
                parameters=tensor.parameters,
            )
            for tensor in payload.inputs
        ]
        return InferenceResponse(
            model_name=self.name, id=payload.id, parameters=without_headers(payload.parameters), outputs=outputs
        )


class Strict(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        for tensor in payload.inputs:
            if datatype(tensor) != "INT32":
                raise MLServerError(f"input {tensor.name} must be INT32, got {datatype(tensor)}", 400)
            if list(tensor.shape) != [1, 16]:
                raise MLServerError(f"input {tensor.name} must have shape [1, 16], got {tensor.shape}", 400)
        summed = sum(NumpyCodec.decode_input(tensor) for tensor in payload.inputs)
        return InferenceResponse(
            model_name=self.name, id=payload.id, outputs=[NumpyCodec.encode_output("OUTPUT0", summed)]
        )


def describe(value) -> object:
    """A JSON-able account of a decoded value: its Python type and contents."""
    kind = type(value).__name__
    if hasattr(value, "to_dict"):  # a pandas DataFrame
        return {"type": kind, "columns": list(map(str, value.columns)), "dtypes": [str(d) for d in value.dtypes],
                "rows": json.loads(value.to_json(orient="values", default_handler=repr))}
    if hasattr(value, "tolist"):  # a numpy array
        return {"type": kind, "dtype": str(value.dtype), "shape": list(value.shape), "values": repr(value.tolist())}
    if isinstance(value, list):
        return {"type": kind, "values": [repr(v) for v in value]}
    return {"type": kind, "value": repr(value)}


class Decode(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        if payload.parameters is not None and payload.parameters.content_type:
            described = {"request": describe(self.decode_request(payload))}
        else:
            described = {tensor.name: describe(self.decode(tensor)) for tensor in payload.inputs}
        text = json.dumps(described, sort_keys=True)
        return InferenceResponse(
            model_name=self.name,
            id=payload.id,
            outputs=[ResponseOutput(name="decoded", shape=[1], datatype="BYTES", data=[text])],
        )


class Count(MLModel):
    """A streaming model, MLServer's way: each request of a stream with INPUT0 = N is answered with N responses,
    OUTPUT0 = 0, 1, ..., N-1. A negative N is refused, which ends MLServer's stream with an error status."""

    async def load(self) -> bool:
        return True

    async def predict_stream(self, payloads):
        async for payload in payloads:
            count = int(NumpyCodec.decode_input(payload.inputs[0]).reshape(-1)[0])
            if count < 0:
                raise MLServerError(f"INPUT0 must not be negative, got {count}", 400)
            for step in range(count):
                output = NumpyCodec.encode_output("OUTPUT0", np.array([step], dtype=np.int32))
                yield InferenceResponse(model_name=self.name, id=payload.id, outputs=[output])

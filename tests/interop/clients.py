"""The third-party clients of the suite behind one call each, and their answers in one comparable form: outputs as
datatype, shape and raw little-endian bytes (BYTES as length-prefixed elements), or the failure's status and
message as the client reports them."""

import asyncio
import os
from dataclasses import dataclass

import grpc
import httpx
import ml_dtypes
import numpy as np

# tritonclient and the kserve SDK each register the protocol's messages (`inference.*`) in protobuf's one default
# pool, so one process can load only one of them: each pytest run drives one family (scripts/interop runs both).
FAMILY = os.environ.get("INTEROP_CLIENTS", "")
FAMILIES = {
    "triton": ("triton-http-json", "triton-http-binary", "triton-grpc"),
    "kserve": ("kserve-rest", "kserve-grpc"),
}
if FAMILY not in FAMILIES:
    raise SystemExit(f"interop: INTEROP_CLIENTS must be one of {sorted(FAMILIES)}, got {FAMILY!r}")
CLIENTS = FAMILIES[FAMILY]

if FAMILY == "triton":
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton_http
    from tritonclient.utils import InferenceServerException
else:
    from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig

    class InferenceServerException(Exception):
        """Not raised in a kserve run."""


def client_protocol(client: str) -> str:
    return "grpc" if client.endswith("grpc") else "rest"


@dataclass(frozen=True)
class Tensor:
    datatype: str
    shape: tuple
    data: bytes

    @staticmethod
    def of(datatype: str, array: np.ndarray) -> "Tensor":
        array = np.asarray(array)
        if datatype == "BYTES":
            elements = [e if isinstance(e, bytes) else str(e).encode() for e in array.reshape(-1)]
            data = b"".join(len(e).to_bytes(4, "little") + e for e in elements)
        else:
            if array.dtype.kind == "f" or array.dtype == ml_dtypes.bfloat16:
                # NaN bits aside: every NaN compares as the canonical one.
                array = np.where(np.isnan(array.astype(np.float64)), np.nan, array).astype(array.dtype)
            data = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
        return Tensor(datatype, tuple(int(d) for d in array.shape), data)


@dataclass(frozen=True)
class Answer:
    id: str
    parameters: dict
    outputs: dict


@dataclass(frozen=True)
class Failure:
    status: str
    message: str


def infer(client: str, address: str, model: str, tensors, request_id: str = "", parameters=None):
    """Runs one inference with `client` against `address`: `tensors` are (name, datatype, array)."""
    try:
        if client.startswith("triton-http"):
            return triton_http_infer(address, model, tensors, client.endswith("binary"), request_id, parameters)
        if client == "triton-grpc":
            return triton_grpc_infer(address, model, tensors, request_id, parameters)
        return asyncio.run(kserve_infer(client, address, model, tensors, request_id, parameters))
    except InferenceServerException as error:
        return Failure(str(error.status()).removeprefix("StatusCode."), error.message() or "")
    except httpx.HTTPStatusError as error:
        return Failure(str(error.response.status_code), error.response.text)
    except grpc.RpcError as error:
        return Failure(error.code().name, error.details() or "")


def triton_http_infer(address, model, tensors, binary, request_id, parameters):
    client = triton_http.InferenceServerClient(address, connection_timeout=30, network_timeout=30)
    try:
        inputs = []
        for name, datatype, array in tensors:
            tensor = triton_http.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array, binary_data=binary)
            inputs.append(tensor)
        outputs = [triton_http.InferRequestedOutput(name, binary_data=binary) for name, _, _ in tensors]
        result = client.infer(model, inputs, outputs=outputs, request_id=request_id, parameters=parameters)
        response = result.get_response()
        return Answer(
            response.get("id", ""),
            response.get("parameters") or {},
            {o["name"]: Tensor.of(o["datatype"], result.as_numpy(o["name"])) for o in response["outputs"]},
        )
    finally:
        client.close()


def triton_grpc_infer(address, model, tensors, request_id, parameters):
    client = triton_grpc.InferenceServerClient(address)
    try:
        inputs = []
        for name, datatype, array in tensors:
            tensor = triton_grpc.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        outputs = [triton_grpc.InferRequestedOutput(name) for name, _, _ in tensors]
        result = client.infer(
            model, inputs, outputs=outputs, request_id=request_id, parameters=parameters, client_timeout=30
        )
        response = result.get_response(as_json=True)
        return Answer(
            response.get("id", ""),
            {k: next(iter(v.values())) for k, v in (response.get("parameters") or {}).items()},
            {o["name"]: Tensor.of(o["datatype"], result.as_numpy(o["name"])) for o in response["outputs"]},
        )
    finally:
        client.close()


async def kserve_infer(client, address, model, tensors, request_id, parameters):
    try:
        inputs = []
        for name, datatype, array in tensors:
            tensor = InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array, binary_data=client == "kserve-grpc")
            inputs.append(tensor)
        request = InferRequest(model_name=model, infer_inputs=inputs, request_id=request_id or None,
                               parameters=parameters)
        if client == "kserve-rest":
            request.to_rest()
        else:
            request.to_grpc()
    except Exception as error:  # the SDK refused to build the request
        return Failure("None", f"{type(error).__name__}: {error}")
    if client == "kserve-rest":
        async with InferenceRESTClient(RESTConfig(protocol="v2", retries=0, timeout=30)) as rest:
            response = await rest.infer(f"http://{address}", request, model_name=model)
    else:
        async with InferenceGRPCClient(address, timeout=30) as channel:
            response = await channel.infer(request)
    return Answer(
        response.id or "",
        dict(response.parameters or {}),
        {o.name: Tensor.of(o.datatype, o.as_numpy()) for o in response.outputs},
    )

"""MLServer's content types through oipgate: requests carrying `content_type` (str, base64, np, pd) reach MLServer
unchanged and are decoded there exactly as when sent directly, on every client and backend protocol."""

import asyncio
import base64

import numpy as np
import pytest

from conftest import PROTOCOLS, public_name

CASES = {
    "str": ([("text", "BYTES", ["héllo", "wörld"], {"content_type": "str"})], None),
    "base64": ([("blob", "BYTES", [base64.b64encode(b"\x00\xffraw").decode()], {"content_type": "base64"})], None),
    "np": ([("array", "FP32", [[1.5, 2.5], [3.5, 4.5]], {"content_type": "np"})], None),
    "pd": (
        [("a", "INT32", [1, 2, 3], None), ("b", "BYTES", ["x", "y", "z"], {"content_type": "str"})],
        {"content_type": "pd"},
    ),
}


def request(model: str, case: str, binary: bool):
    from kserve import InferInput, InferRequest

    inputs = []
    tensors, parameters = CASES[case]
    for name, datatype, data, tensor_parameters in tensors:
        array = np.array(data, dtype=np.object_ if datatype == "BYTES" else np.float32 if datatype == "FP32" else np.int32)
        if datatype == "BYTES":
            array = np.array([v.encode() for v in array.reshape(-1)], dtype=np.object_).reshape(array.shape)
        tensor = InferInput(name, list(array.shape), datatype, parameters=tensor_parameters)
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    return InferRequest(model_name=model, infer_inputs=inputs, request_id="ct", parameters=parameters)


async def decoded(client: str, address: str, model: str, case: str) -> str:
    from kserve import InferenceGRPCClient, InferenceRESTClient, RESTConfig

    if client == "rest":
        async with InferenceRESTClient(RESTConfig(protocol="v2", retries=0)) as rest:
            answer = await rest.infer(f"http://{address}", request(model, case, False), model_name=model)
    else:
        async with InferenceGRPCClient(address) as channel:
            answer = await channel.infer(request(model, case, True))
    value = answer.outputs[0].as_numpy().reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else str(value)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("client", PROTOCOLS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_content_types_are_decoded_by_mlserver_as_directly(fleet, protocol, client, case):
    backend = fleet.backends["mlserver"]
    direct_address = backend.grpc if client == "grpc" else backend.rest
    gateway_address = fleet.gateway.grpc if client == "grpc" else fleet.gateway.rest
    direct = asyncio.run(decoded(client, direct_address, "decode", case))
    through = asyncio.run(decoded(client, gateway_address, public_name("mlserver", protocol, "decode"), case))
    assert through == direct
    assert '"type"' in through and ("DataFrame" in through) == (case == "pd")

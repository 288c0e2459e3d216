"""Inference through oipgate against the same client talking to the server directly: every client protocol and
encoding, every backend kind and protocol, every datatype, multi-dimensional and empty shapes."""

import ml_dtypes
import numpy as np
import pytest

from clients import CLIENTS, Answer, Failure, Tensor, client_protocol, infer
from conftest import KINDS, PROTOCOLS, UPSTREAM, public_name

NUMPY = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BF16": ml_dtypes.bfloat16,
}
DATATYPES = (*NUMPY, "BYTES")
SHAPES = ((2, 3), (0, 4))


def values(datatype: str, shape: tuple, json: bool, seed: int, infinities: bool = True) -> np.ndarray:
    """Deterministic values with the datatype's extremes; NaN and infinities and non-UTF-8 bytes only where the
    encoding can carry them (not in JSON)."""
    rng = np.random.default_rng(seed)
    count = int(np.prod(shape))
    if datatype == "BYTES":
        pool = [b"", b"a", "\u00e9t\u00e9".encode(), b"x" * 40]
        if not json:
            pool += [b"\xff\xfe\x00", b"\x00"]
        return np.array([pool[i % len(pool)] for i in range(count)], dtype=np.object_).reshape(shape)
    dtype = NUMPY[datatype]
    if datatype == "BOOL":
        return (rng.integers(0, 2, count) == 1).reshape(shape)
    if datatype in ("FP16", "FP32", "FP64", "BF16"):
        array = rng.normal(0, 1000, count).astype(np.float64)
        special = [0.0, -0.0, 1.5, -2.25] if json else [np.nan, np.inf, -np.inf, -0.0]
        if not infinities:
            special = [s if np.isfinite(s) or np.isnan(s) else 7.5 for s in special]
        array[: min(count, len(special))] = special[: min(count, len(special))]
        return array.astype(dtype).reshape(shape)
    info = np.iinfo(dtype)
    array = rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    extremes = [info.min, info.max, 0]
    array[: min(count, 3)] = extremes[: min(count, 3)]
    return array.reshape(shape)


def client_supports(client: str, datatype: str, shape: tuple) -> bool:
    """What the client library can send at all: tritonclient sends BF16 only as binary; the kserve SDK has no BF16
    and sends FP16 only in binary form, which its REST client does not use."""
    if client == "triton-http-json" and datatype == "BF16":
        return False
    if client.startswith("kserve") and datatype == "BF16":
        return False
    return not (client == "kserve-rest" and datatype == "FP16" and int(np.prod(shape)) > 0)


def backend_cannot(kind: str, protocol: str, client: str, datatype: str, shape: tuple) -> str | None:
    """Requests the backend cannot take in any form the gateway could send, with the reason: these must fail
    through the gateway too, with the backend's error or the gateway's naming the problem."""
    if kind == "mlserver" and datatype == "BF16":
        return "MLServer has no BF16 datatype"
    empty = int(np.prod(shape)) == 0
    if kind == "kserve" and protocol == "rest" and client == "triton-http-json" and empty:
        return "KServe's REST server cannot write an empty tensor as JSON (its answer fails its own validation)"
    if empty:
        return None
    json_only = kind == "mlserver" and protocol == "rest"
    carries_specials = client not in ("triton-http-json", "kserve-rest")
    if json_only and carries_specials and datatype in ("FP16", "FP32", "FP64"):
        return "MLServer's REST API reads strict JSON, which has no NaN or infinities"
    if json_only and carries_specials and datatype == "BYTES":
        return "JSON cannot carry BYTES that are not UTF-8, and MLServer's REST API has no binary extension"
    if kind == "kserve" and protocol == "rest" and carries_specials and datatype == "BYTES":
        return "KServe's REST server turns binary BYTES inputs into text, so it cannot take non-UTF-8 ones"
    return None


def expected(tensors) -> dict:
    return {name: Tensor.of(datatype, array) for name, datatype, array in tensors}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("kind", KINDS)
def test_echo_through_the_gateway_equals_direct(fleet, kind, protocol, client, datatype, shape):
    json = client in ("triton-http-json", "kserve-rest")
    # KServe writes infinities in JSON answers as null (orjson), which reads back as NaN: none are sent to it.
    infinities = kind != "kserve"
    tensors = [
        ("INPUT0", datatype, values(datatype, shape, json, 7, infinities)),
        ("INPUT1", "INT32", values("INT32", (3,), json, 8)),
    ]
    if not client_supports(client, datatype, shape):
        refused = infer(client, fleet.gateway.rest, public_name(kind, protocol, "echo"), tensors)
        assert isinstance(refused, Failure) and refused.status == "None", f"the client sent it: {refused}"
        return
    upstream, _ = UPSTREAM[kind]["echo"]
    backend = fleet.backends[kind]
    direct_address = backend.grpc if client_protocol(client) == "grpc" else backend.rest
    gateway_address = fleet.gateway.grpc if client_protocol(client) == "grpc" else fleet.gateway.rest
    request_id = f"{kind}-{protocol}-{client}-{datatype}"

    direct = infer(client, direct_address, upstream, tensors, request_id)
    through = infer(client, gateway_address, public_name(kind, protocol, "echo"), tensors, request_id)

    impossible = backend_cannot(kind, protocol, client, datatype, shape)
    if impossible:
        assert isinstance(through, Failure), f"{impossible}, yet it was answered: {through}"
        assert through.status not in ("None", "502", "UNAVAILABLE"), f"{impossible}: {through}"
        return
    assert not isinstance(through, Failure) or isinstance(direct, Failure), (
        f"the server answers directly but not through the gateway: {through}"
    )
    if isinstance(direct, Answer):
        assert through.outputs == direct.outputs
        assert through.outputs == expected(tensors)
        assert through.id == direct.id == request_id
    elif isinstance(through, Answer):
        # The server cannot take this request directly (e.g. MLServer has no binary extension, KServe takes no FP16
        # in JSON); through the gateway, translated to what the backend speaks, it is answered correctly.
        assert through.outputs == expected(tensors), f"direct failure was {direct}"
    else:
        assert through.status == direct.status or (
            through.status[0] == direct.status[0] == "4"
        ), f"direct {direct} through {through}"

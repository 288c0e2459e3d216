"""The gateway's reading of protobuf field keys, held against the two readers a backend has: C++ protobuf (two real
Triton replicas) and upb (the decoder of the `protobuf` package). A key in any shape (padded past its natural length,
past five bytes, with bits above 32 that C++ drops) either reads alike to all of them, or the gateway refuses the
message before any backend sees it: a caller never names one model to the gateway and another to Triton, nor hides
a shared-memory parameter from the gateway's refusal."""

import grpc
import numpy as np
import pytest
from google.protobuf.internal import api_implementation
from tritonclient.grpc import service_pb2

from triton_server import triton  # noqa: F401  (the fixture)

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
# Key shapes: every padded length a varint can take, and a five-byte key with each pattern of bits above 32.
SHAPES = [(size, 0) for size in range(1, 11)] + [(5, extra) for extra in range(1, 8)]


def varint(value: int, size: int = 0, extra: int = 0) -> bytes:
    """`value` as a varint of at least `size` bytes (padded with continuation bytes), `extra` bits above 32."""
    natural = max(1, (value.bit_length() + 6) // 7)
    size = max(size, natural)
    out = bytearray()
    for index in range(size):
        byte = (value >> (7 * index)) & 0x7F
        if index == 4:
            byte |= extra << 4
        if index + 1 < size:
            byte |= 0x80
        out.append(byte)
    return bytes(out)


def field(number: int, payload: bytes, shape=(1, 0)) -> bytes:
    size, extra = shape
    return varint(number << 3 | 2, size, extra) + varint(len(payload)) + payload


def add_sub(name: str) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=name)
    values = np.arange(16, dtype=np.int32)
    for tensor in ("INPUT0", "INPUT1"):
        entry = request.inputs.add(name=tensor, datatype="INT32")
        entry.shape.extend([1, 16])
        request.raw_input_contents.append(values.tobytes())
    return request


def with_shared_memory(name: str, parameters_shape, entry_shape) -> bytes:
    """`add_sub` whose first input sets shared_memory_region, its parameters' key and its entry's name key shaped."""
    request = add_sub(name)
    first = request.inputs[0].SerializeToString()
    entry = field(1, b"shared_memory_region", entry_shape) + field(2, field(3, b"region"))
    tensor = first + field(4, entry, parameters_shape)
    rest = service_pb2.ModelInferRequest()
    rest.CopyFrom(request)
    del rest.inputs[0]
    rest.model_name = ""
    return field(1, name.encode()) + field(5, tensor) + rest.SerializeToString()


def call(address: str, message: bytes):
    """The raw message sent as ModelInfer: ("OK", the answer's model name) or (code, details)."""
    with grpc.insecure_channel(address) as channel:
        infer = channel.unary_unary(MODEL_INFER, request_serializer=None, response_deserializer=None)
        try:
            answer = infer(message, timeout=30)
        except grpc.RpcError as error:
            return error.code().name, error.details() or ""
    return "OK", service_pb2.ModelInferResponse.FromString(answer).model_name


def upb(message: bytes):
    try:
        return service_pb2.ModelInferRequest.FromString(message)
    except Exception:  # noqa: BLE001  (upb's DecodeError)
        return None


def test_the_decoder_compared_is_upb():
    assert api_implementation.Type() == "upb"


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s}-bytes-extra-{e}" for s, e in SHAPES])
def test_a_model_name_in_any_key_shape_names_one_model_to_everyone(triton, shape):  # noqa: F811
    gateway, replica = triton.gateways[0], triton.replicas[0]
    other = field(1, b"no_such_model", shape)
    direct = call(replica.grpc, add_sub("add_sub").SerializeToString() + other)
    message = add_sub("add_sub_grpc").SerializeToString() + other
    through = call(gateway.grpc, message)
    parsed = upb(message)
    # What Triton reads as the model's name (C++ drops a key's bits above 32), the gateway never serves as another.
    if direct[0] == "NOT_FOUND" or "no_such_model" in direct[1]:
        assert through[0] != "OK", (shape, direct, through)
    if through == ("OK", "add_sub_grpc"):
        assert direct[0] == "OK", (shape, direct, through)
        assert parsed is None or parsed.model_name == "add_sub_grpc", (shape, parsed.model_name)
    # C++ reads a key of at most five bytes, dropping bits above 32: the shapes the gateway once read as an unknown
    # field name the other model to Triton.
    if shape[0] <= 5:
        assert direct[0] == "NOT_FOUND" or "no_such_model" in direct[1], (shape, direct)
    # Where the gateway reads it as the name too, it says so as Triton does; where the readers differ, it refuses.
    if parsed is not None and parsed.model_name == "no_such_model":
        assert through[0] == "NOT_FOUND", (shape, through)
    if shape[0] > 5 or shape[1]:
        assert through[0] == "INVALID_ARGUMENT" and "protobuf" in through[1], (shape, through)


@pytest.mark.parametrize("where", ["parameters", "entry"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s}-bytes-extra-{e}" for s, e in SHAPES])
def test_a_shared_memory_parameter_in_any_key_shape_never_passes(triton, where, shape):  # noqa: F811
    gateway = triton.gateways[0]
    parameters_shape, entry_shape = (shape, (1, 0)) if where == "parameters" else ((1, 0), shape)
    message = with_shared_memory("add_sub_grpc", parameters_shape, entry_shape)
    through = call(gateway.grpc, message)
    assert through[0] == "INVALID_ARGUMENT", (where, shape, through)
    # Refused by the gateway itself: for shared memory, or for a key no backend reads as the gateway would.
    assert "cannot cross a gateway" in through[1] or "protobuf" in through[1], (where, shape, through)
    parsed = upb(message)
    if parsed is not None and "shared_memory_region" in parsed.inputs[0].parameters:
        assert "cannot cross a gateway" in through[1], (where, shape, through)

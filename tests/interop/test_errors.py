"""Errors through oipgate keep their class: the same HTTP status or gRPC code the client gets from the server
directly, with the server's message carried."""

import numpy as np
import pytest

from clients import Failure, infer
from conftest import KINDS, PROTOCOLS, UPSTREAM, public_name

# JSON over HTTP: MLServer has no binary extension, and the same request must go to every server directly.
CLIENTS = ("triton-http-json", "triton-grpc")


def address(server, client: str) -> str:
    return server.grpc if client.endswith("grpc") else server.rest


def add_sub(datatype: str = "INT32", shape: tuple = (1, 16)):
    array = np.arange(int(np.prod(shape))).reshape(shape).astype(np.float64 if datatype == "FP64" else np.int32)
    return [("INPUT0", datatype, array), ("INPUT1", datatype, array)]


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", ["wrong datatype", "wrong shape"])
def test_invalid_requests_keep_their_class(fleet, kind, protocol, client, case):
    tensors = add_sub("FP64") if case == "wrong datatype" else add_sub("INT32", (2, 3))
    upstream, version = UPSTREAM[kind]["strict"]
    direct = infer(client, address(fleet.backends[kind], client), upstream, tensors, "e1")
    through = infer(client, address(fleet.gateway, client), public_name(kind, protocol, "strict"), tensors, "e1")
    assert isinstance(through, Failure), through
    if kind == "kserve" and client == "triton-http-json":
        # KServe reads a body without Content-Type (tritonclient sends none) as binary and refuses it before the
        # model sees it; the gateway names the JSON it passes on, so the model's own error comes back instead.
        assert through.status == "400" and "must" in through.message, through
        return
    assert isinstance(direct, Failure), direct
    # Across protocols the backend's own error is mapped (HTTP 400 <-> INVALID_ARGUMENT); a 422 from a REST server
    # is a client error too.
    assert through.status == direct.status or {through.status, direct.status} <= {"400", "422"}, (direct, through)
    words = [w for w in direct.message.split() if w.isalpha() and len(w) > 4][:3]
    assert all(w in through.message for w in words), (direct.message, through.message)


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("kind", KINDS)
def test_unknown_model_is_not_found(fleet, kind, client):
    tensors = add_sub()
    direct = infer(client, address(fleet.backends[kind], client), "no_such_model", tensors)
    through = infer(client, address(fleet.gateway, client), "no_such_model", tensors)
    assert isinstance(direct, Failure) and isinstance(through, Failure)
    assert through.status == ("NOT_FOUND" if client.endswith("grpc") else "404")
    assert direct.status == through.status or kind == "mlserver" and direct.status == "INTERNAL", (direct, through)
    # Triton's wording, which its clients and tools match on (simple_http_infer_client checks the start).
    assert through.message.startswith("Request for unknown model: 'no_such_model' is not found"), through


@pytest.mark.parametrize("client", CLIENTS)
def test_backend_down_is_unavailable(fleet, client):
    through = infer(client, address(fleet.gateway, client), "down", add_sub())
    assert isinstance(through, Failure)
    if client.endswith("grpc"):
        # What a gRPC client gets from a server that is down: UNAVAILABLE.
        direct = infer(client, f"127.0.0.1:{fleet.dead_port}", "down", add_sub())
        assert through.status == direct.status == "UNAVAILABLE"
    else:
        # Directly, an HTTP client gets no answer at all; the gateway answers 502 naming the unreachable backend.
        assert through.status == "502"
    assert "unreachable" in through.message

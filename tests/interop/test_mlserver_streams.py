"""MLServer's streams behind oipgate (backends with `stream = "mlserver"`): its `count` model reached by
tritonclient's streaming API and by a server-sent-events client, on every pairing (gRPC to gRPC, gRPC to REST, REST
to REST, REST to gRPC), gives the responses, ids and errors MLServer gives alone. MLServer's gRPC stream answers bare
`ModelInferResponse`s (tritonclient cannot read them), so MLServer alone is called with a raw gRPC stream."""

import json
import queue
import urllib.error
import urllib.request

import grpc
import numpy as np
import tritonclient.grpc as triton_grpc
from tritonclient.grpc import service_pb2

from conftest import public_name


def count_request(request_id: str, value: int) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="count", id=request_id)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "INPUT0", "INT32"
    tensor.shape.append(1)
    request.raw_input_contents.append(np.array([value], dtype=np.int32).tobytes())
    return request


def outputs(response: service_pb2.ModelInferResponse) -> tuple:
    """OUTPUT0 as its shape and values."""
    values = np.frombuffer(response.raw_output_contents[0], dtype=np.int32).tolist() if response.raw_output_contents \
        else list(response.outputs[0].contents.int_contents)
    return list(response.outputs[0].shape), values


def mlserver_grpc(address: str, value: int) -> tuple:
    """MLServer alone: one request on a raw gRPC stream, its bare responses as (id, OUTPUT0), and the status that
    ended the stream (None when it ended well)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        answers = []
        try:
            for response in call(iter([count_request("r1", value)])):
                answers.append((response.id, outputs(response)))
        except grpc.RpcError as error:
            return answers, error.details()
        return answers, None


def gateway_grpc(address: str, model: str, requests: list) -> tuple:
    """Through the gateway with tritonclient: `requests` ((id, INPUT0)) on one stream, the responses as
    (model, id, OUTPUT0) and the error messages, once the stream has ended."""
    received = queue.Queue()
    client = triton_grpc.InferenceServerClient(url=address)
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    for request_id, value in requests:
        tensor = triton_grpc.InferInput("INPUT0", [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
        client.async_stream_infer(model, [tensor], request_id=request_id)
    client.stop_stream()
    answers, errors = [], []
    while not received.empty():
        result, error = received.get()
        if error is not None:
            errors.append(error.message())
            continue
        response = result.get_response()
        output = (list(response.outputs[0].shape), result.as_numpy("OUTPUT0").reshape(-1).tolist())
        answers.append((response.model_name, response.id, output))
    return answers, errors


def post_events(address: str, path: str, body: dict) -> tuple:
    """A REST stream call: the status, the content type and the events' JSON (or the error body)."""
    request = urllib.request.Request(
        f"http://{address}{path}", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            text = answer.read().decode()
            assert text.endswith("\n\n") or text == "", text
            events = [json.loads(event.removeprefix("data: ")) for event in text.split("\n\n") if event]
            return answer.status, answer.headers["Content-Type"], events
    except urllib.error.HTTPError as error:
        body = error.read()
        try:
            return error.code, error.headers["Content-Type"], json.loads(body)
        except ValueError:
            return error.code, error.headers["Content-Type"], body.decode()


def inference_body(value: int) -> dict:
    return {"id": "r1", "inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": [value]}]}


def test_grpc_streams_equal_mlserver_alone(fleet):
    direct, status = mlserver_grpc(fleet.backends["mlserver"].grpc, 3)
    assert status is None and [values for _, (_, values) in direct] == [[0], [1], [2]], (direct, status)
    for protocol in ("grpc", "rest"):
        # gRPC to gRPC: the bare responses wrapped as Triton's stream answers; gRPC to REST: MLServer's infer_stream.
        model = public_name("mlserver", protocol, "count")
        answers, errors = gateway_grpc(fleet.gateway.grpc, model, [("r1", 3)])
        assert errors == [], (protocol, errors)
        assert answers == [(model, request_id, output) for request_id, output in direct], protocol


def mlserver_rest_error(fleet) -> str:
    """What MLServer's REST stream alone answers a negative count: it fails before its first event, with a bare 500."""
    request = urllib.request.Request(
        f"http://{fleet.backends['mlserver'].rest}/v2/models/count/infer_stream",
        data=json.dumps(inference_body(-1)).encode(), method="POST", headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=30)
    except urllib.error.HTTPError as error:
        assert error.code == 500, error.code
        return error.read().decode()
    raise AssertionError("MLServer took a negative count")


def test_a_failed_request_is_an_error_response_and_the_stream_goes_on(fleet):
    direct, status = mlserver_grpc(fleet.backends["mlserver"].grpc, -1)
    assert direct == [] and "must not be negative" in status, status
    expected = {"grpc": status, "rest": mlserver_rest_error(fleet)}
    for protocol in ("grpc", "rest"):
        model = public_name("mlserver", protocol, "count")
        # MLServer ends its stream at the failed request; the gateway answers that request with MLServer's error and
        # opens another stream for the next.
        answers, errors = gateway_grpc(fleet.gateway.grpc, model, [("bad", -1)])
        assert answers == [] and len(errors) == 1 and expected[protocol] in errors[0], (protocol, errors)
        # (MLServer's REST server closes its connection after that 500 without saying so: the next request, sent on
        # it at once, is sent again on a new connection.)
        answers, errors = gateway_grpc(fleet.gateway.grpc, model, [("bad", -1), ("good", 2)])
        assert len(errors) == 1 and expected[protocol] in errors[0], (protocol, errors)
        assert [(name, request_id, values) for name, request_id, (_, values) in answers] == [
            (model, "good", [0]), (model, "good", [1])], (protocol, answers)


def test_rest_streams_equal_mlserver_alone(fleet):
    status, kind, direct = post_events(fleet.backends["mlserver"].rest, "/v2/models/count/infer_stream", inference_body(3))
    assert status == 200 and kind.startswith("text/event-stream"), (status, kind)
    assert [event["outputs"][0]["data"] for event in direct] == [[0], [1], [2]]
    for protocol in ("rest", "grpc"):
        model = public_name("mlserver", protocol, "count")
        # REST to REST: relayed event by event (infer_stream and generate_stream, which MLServer serves alike);
        # REST to gRPC: translated onto MLServer's gRPC stream.
        calls = ("infer_stream", "generate_stream") if protocol == "rest" else ("infer_stream",)
        for call in calls:
            status, kind, through = post_events(fleet.gateway.rest, f"/v2/models/{model}/{call}", inference_body(3))
            assert status == 200 and kind.startswith("text/event-stream"), (protocol, call, status, kind, through)
            assert [event["model_name"] for event in through] == [model] * 3, (protocol, call)
            assert [event["id"] for event in through] == [event["id"] for event in direct], (protocol, call)
            assert [event["outputs"] for event in through] == [event["outputs"] for event in direct], (protocol, call)


def test_rest_stream_errors_name_the_problem(fleet):
    direct = mlserver_rest_error(fleet)
    # Relayed from MLServer's REST stream: its own failure, status and words.
    status, _, through = post_events(
        fleet.gateway.rest, f"/v2/models/{public_name('mlserver', 'rest', 'count')}/infer_stream", inference_body(-1))
    assert (status, through) == (500, direct), (status, through)
    # Translated to MLServer's gRPC stream: the status it ended with, before any event, is the answer's.
    status, _, through = post_events(
        fleet.gateway.rest, f"/v2/models/{public_name('mlserver', 'grpc', 'count')}/infer_stream", inference_body(-1))
    assert status >= 400 and "must not be negative" in through["error"], (status, through)
    # A Triton-dialect backend has no infer_stream: refused with a clear error, not sent.
    status, _, body = post_events(
        fleet.gateway.rest, f"/v2/models/{public_name('oipgate', 'rest', 'echo')}/infer_stream", inference_body(1))
    assert status == 400 and "generate_stream, not infer_stream" in body["error"], (status, body)

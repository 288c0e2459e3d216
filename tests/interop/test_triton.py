"""Real Triton Inference Server replicas behind oipgate, driven by tritonclient: a stateful sequence model keeps
every request of a sequence on the replica holding its state (over REST and gRPC, as they are and translated, and
through either of two gateway processes), and each answer equals Triton's own."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http

from triton_server import triton  # noqa: F401  (the fixture)

SEQUENCES = 8
STEPS = 6


def client(protocol: str, address: str):
    module = triton_grpc if protocol == "grpc" else triton_http
    return module.InferenceServerClient(url=address)


def step(client, protocol: str, model: str, sequence_id, value: int, start: bool, end: bool) -> int:
    module = triton_grpc if protocol == "grpc" else triton_http
    tensor = module.InferInput("INPUT0", [1], "INT32")
    tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
    result = client.infer(model, [tensor], sequence_id=sequence_id, sequence_start=start, sequence_end=end)
    return int(result.as_numpy("OUTPUT0")[0])


def run_sequence(addresses: list, protocol: str, model: str, sequence_id) -> list:
    """One sequence's answers, its steps sent to `addresses` in turn (one client per address)."""
    clients = [client(protocol, address) for address in addresses]
    answers = []
    for index in range(STEPS):
        answers.append(
            step(clients[index % len(clients)], protocol, model, sequence_id, 10 * index + 1, index == 0,
                 index == STEPS - 1)
        )
    return answers


def sequence_ids(first: int, text: bool) -> list:
    return [f"s{first + n}" if text else first + n for n in range(SEQUENCES)]


# (client protocol, public model): the REST and gRPC doors, each to a backend of its own protocol and of the other.
PATHS = [
    ("http", "accumulate"),
    ("http", "accumulate_grpc"),
    ("grpc", "accumulate_grpc"),
    ("grpc", "accumulate"),
]


@pytest.mark.parametrize("gateways", [1, 2], ids=["one-gateway", "two-gateways"])
@pytest.mark.parametrize("text", [False, True], ids=["numeric-ids", "string-ids"])
@pytest.mark.parametrize("protocol,model", PATHS, ids=[f"{p}-to-{m}" for p, m in PATHS])
def test_sequences_through_two_replicas_equal_triton_alone(triton, protocol, model, text, gateways):  # noqa: F811
    case = PATHS.index((protocol, model)) * 4 + int(text) * 2 + gateways
    through = sequence_ids(1000 * case, text)
    direct = sequence_ids(1000 * case + 500, text)
    door = "grpc" if protocol == "grpc" else "rest"
    addresses = [getattr(g, door) for g in triton.gateways[:gateways]]
    replica = getattr(triton.replicas[0], door)
    with ThreadPoolExecutor(max_workers=SEQUENCES) as pool:
        answers = list(pool.map(lambda s: run_sequence(addresses, protocol, model, s), through))
        expected = list(pool.map(lambda s: run_sequence([replica], protocol, "accumulate", s), direct))
    # Round robin over two replicas would send every other step to the one without the sequence's state.
    assert answers == expected
    assert expected[0] == [sum(10 * i + 1 for i in range(n + 1)) for n in range(STEPS)]


def test_a_stateless_model_answers_as_triton_alone(triton):  # noqa: F811
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    for protocol, door in (("http", "rest"), ("grpc", "grpc")):
        module = triton_grpc if protocol == "grpc" else triton_http
        inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        direct = client(protocol, getattr(triton.replicas[1], door)).infer("add_sub", inputs)
        for model in ("add_sub", "add_sub_grpc"):
            through = client(protocol, getattr(triton.gateways[0], door)).infer(model, inputs)
            for output in ("OUTPUT0", "OUTPUT1"):
                assert np.array_equal(through.as_numpy(output), direct.as_numpy(output)), (protocol, model, output)


def test_least_load_reads_the_queue_tritons_own_metrics_report(triton):  # noqa: F811
    """Each replica's Prometheus text, as Triton writes it (histograms, summaries, every family), is read strictly
    and its pending-request gauge balances the gateway's calls."""
    import time
    import urllib.request

    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [triton_http.InferInput("INPUT0", [1, 16], "INT32"), triton_http.InferInput("INPUT1", [1, 16], "INT32")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    gateway = triton.gateways[0]
    through = client("http", gateway.rest)
    for _ in range(10):
        assert np.array_equal(through.infer("add_sub_load", inputs).as_numpy("OUTPUT0"), a + a)

    def metric(line_start):
        text = urllib.request.urlopen(f"http://{gateway.metrics}/metrics", timeout=10).read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start))

    deadline = time.time() + 10
    while metric('oipgate_load_scrapes_total{backend="triton-load",result="ok"}') < 4 and time.time() < deadline:
        time.sleep(0.1)
    assert metric('oipgate_load_scrapes_total{backend="triton-load",result="ok"}') >= 4
    assert metric('oipgate_load_scrapes_total{backend="triton-load",result="error"}') == 0
    for replica in triton.replicas:
        queue = f'oipgate_endpoint_queue{{backend="triton-load",endpoint="{replica.rest}"}}'
        text = urllib.request.urlopen(f"http://{gateway.metrics}/metrics", timeout=10).read().decode()
        assert any(line.startswith(queue) for line in text.splitlines()), queue


def slow_call(address: str, model: str, delay_ms: int) -> int:
    tensor = triton_http.InferInput("INPUT0", [1], "INT32")
    tensor.set_data_from_numpy(np.array([delay_ms], dtype=np.int32))
    return int(client("http", address).infer(model, [tensor]).as_numpy("OUTPUT0")[0])


def inference_count(replica, model: str) -> int:
    statistics = client("http", replica.rest).get_inference_statistics(model)
    return int(statistics["model_stats"][0]["inference_count"])


def test_least_load_sends_the_gateways_calls_away_from_a_triton_replica_with_a_queue(triton):  # noqa: F811
    """Both replicas idle, the gateway's calls split evenly; with a queue at one replica from a client that bypasses
    the gateway (Triton's `slow` model has one instance, so calls wait), at least 90% go to the other."""
    import time
    import urllib.request

    gateway = triton.gateways[0]
    a, b = triton.replicas
    before = (inference_count(a, "slow"), inference_count(b, "slow"))
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda _: slow_call(gateway.rest, "slow_load", 5), range(100))) == [5] * 100
    to_a = inference_count(a, "slow") - before[0]
    to_b = inference_count(b, "slow") - before[1]
    assert to_a + to_b == 100 and 40 <= to_a <= 60, (to_a, to_b)

    # Twelve calls of 3 s each at replica a: one runs, eleven wait in its queue.
    bypass = ThreadPoolExecutor(12)
    for _ in range(12):
        bypass.submit(slow_call, a.rest, "slow", 3000)
    queue = f'oipgate_endpoint_queue{{backend="triton-load",endpoint="{a.rest}"}}'
    deadline, seen = time.time() + 20, 0.0
    while seen < 5 and time.time() < deadline:
        text = urllib.request.urlopen(f"http://{gateway.metrics}/metrics", timeout=10).read().decode()
        seen = next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(queue)), 0.0)
        time.sleep(0.05)
    assert seen >= 5, f"replica a's queue as scraped: {seen}"
    before_b = inference_count(b, "slow")
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda _: slow_call(gateway.rest, "slow_load", 5), range(20))) == [5] * 20
    to_b = inference_count(b, "slow") - before_b
    assert to_b >= 18, f"{to_b} of 20 calls went to the replica without a queue"
    # The bypassing calls drain on their own; the replicas stop with the session.
    bypass.shutdown(wait=False, cancel_futures=True)


def test_repository_unload_and_load_reach_both_replicas(triton):  # noqa: F811
    for protocol, door in (("http", "rest"), ("grpc", "grpc")):
        through = client(protocol, getattr(triton.gateways[0], door))
        replicas = [client(protocol, getattr(replica, door)) for replica in triton.replicas]
        through.unload_model("add_sub")
        assert not any(replica.is_model_ready("add_sub") for replica in replicas), protocol
        through.load_model("add_sub")
        assert all(replica.is_model_ready("add_sub") for replica in replicas), protocol


STAGES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")


def statistics(protocol: str, address: str, model: str) -> dict:
    """A model's statistics as plain numbers (tritonclient's gRPC JSON writes 64-bit numbers as strings and leaves
    zeros out)."""
    answer = client(protocol, address)
    entry = (
        answer.get_inference_statistics(model, as_json=True)
        if protocol == "grpc"
        else answer.get_inference_statistics(model)
    )["model_stats"][0]
    numbers = {key: int(entry.get(key, 0)) for key in ("last_inference", "inference_count", "execution_count")}
    stages = entry.get("inference_stats", {})
    for stage in STAGES:
        numbers[stage] = (int(stages.get(stage, {}).get("count", 0)), int(stages.get(stage, {}).get("ns", 0)))
    numbers["name"] = entry["name"]
    return numbers


def test_statistics_through_the_gateway_are_the_sum_over_both_replicas(triton):  # noqa: F811
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [triton_http.InferInput("INPUT0", [1, 16], "INT32"), triton_http.InferInput("INPUT1", [1, 16], "INT32")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    through = client("http", triton.gateways[0].rest)
    for _ in range(6):
        through.infer("add_sub", inputs)
    for protocol, door in (("http", "rest"), ("grpc", "grpc")):
        replicas = [statistics(protocol, getattr(r, door), "add_sub") for r in triton.replicas]
        assert all(replica["success"][0] > 0 for replica in replicas), replicas
        # Both doors, from the backend of their own protocol and of the other.
        for model in ("add_sub", "add_sub_grpc"):
            summed = statistics(protocol, getattr(triton.gateways[0], door), model)
            assert summed["name"] == model
            assert summed["last_inference"] == max(r["last_inference"] for r in replicas)
            for key in ("inference_count", "execution_count"):
                assert summed[key] == sum(r[key] for r in replicas), (protocol, model, key)
            for stage in STAGES:
                expected = tuple(sum(r[stage][i] for r in replicas) for i in (0, 1))
                assert summed[stage] == expected, (protocol, model, stage)


def test_model_configuration_through_the_gateway_is_triton_own_under_the_public_name(triton):  # noqa: F811
    for protocol, door in (("http", "rest"), ("grpc", "grpc")):
        def config(address, name):
            answer = client(protocol, address)
            if protocol == "grpc":
                return answer.get_model_config(name, as_json=True)["config"]
            return answer.get_model_config(name)

        # A sequence-batched model and a decoupled one (a streaming client reads that from the configuration).
        for upstream, shows in (("accumulate", "sequence_batching"), ("count", "model_transaction_policy")):
            direct = config(getattr(triton.replicas[0], door), upstream)
            direct.pop("name")
            # From the backend of the door's own protocol (as it is) and of the other (translated between Triton's
            # JSON and protobuf forms).
            for model in (upstream, f"{upstream}_grpc"):
                through = config(getattr(triton.gateways[0], door), model)
                # Every field as Triton wrote it (sequence batching, its control inputs, instance groups...), named
                # publicly.
                assert through.pop("name") == model
                assert through == direct, (protocol, model)
                assert shows in through, (protocol, model)
            if upstream == "count":
                assert through["model_transaction_policy"]["decoupled"] is True


def test_unary_inference_of_a_decoupled_model_is_refused_as_triton_refuses_it(triton):  # noqa: F811
    from tritonclient.utils import InferenceServerException

    def refusal(protocol, address, model):
        module = triton_grpc if protocol == "grpc" else triton_http
        inputs = [module.InferInput("INPUT0", [1], "INT32")]
        inputs[0].set_data_from_numpy(np.array([3], dtype=np.int32))
        with pytest.raises(InferenceServerException) as refused:
            client(protocol, address).infer(model, inputs)
        return str(refused.value.status()), refused.value.message()

    for protocol, door in (("http", "rest"), ("grpc", "grpc")):
        direct = refusal(protocol, getattr(triton.replicas[0], door), "count")
        for model in ("count", "count_grpc"):
            status, message = refusal(protocol, getattr(triton.gateways[0], door), model)
            assert status == direct[0], (protocol, model, message)
            assert "decoupled" in message, (protocol, model, message)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_and_answers_equal_triton_alone(triton, algorithm):  # noqa: F811
    a = np.arange(8 * 16, dtype=np.int32).reshape(8, 16) % 97
    b = np.full((8, 16), 5, dtype=np.int32)

    def infer(protocol, address, model):
        module = triton_grpc if protocol == "grpc" else triton_http
        inputs = [module.InferInput("INPUT0", [8, 16], "INT32"), module.InferInput("INPUT1", [8, 16], "INT32")]
        # JSON bodies (binary_data=False) compress; they also reach both backend protocols.
        if protocol == "grpc":
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            return client(protocol, address).infer(model, inputs, compression_algorithm=algorithm)
        inputs[0].set_data_from_numpy(a, binary_data=False)
        inputs[1].set_data_from_numpy(b, binary_data=False)
        return client(protocol, address).infer(
            model,
            inputs,
            request_compression_algorithm=algorithm,
            response_compression_algorithm=algorithm,
        )

    for protocol, door in (("http", "rest"), ("grpc", "grpc")):
        direct = infer(protocol, getattr(triton.replicas[0], door), "add_sub")
        for model in ("add_sub", "add_sub_grpc"):
            through = infer(protocol, getattr(triton.gateways[0], door), model)
            for output in ("OUTPUT0", "OUTPUT1"):
                assert np.array_equal(through.as_numpy(output), direct.as_numpy(output)), (protocol, model, output)


def stream(address: str, requests: list) -> tuple:
    """Sends `requests` ((model, id, INPUT0, enable_empty_final_response)) on one tritonclient stream and gives its
    responses by request id ([(model, final flag, OUTPUT0)]) and its error messages, once the stream has ended."""
    import queue

    received = queue.Queue()
    client = triton_grpc.InferenceServerClient(url=address)
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    for model, request_id, value, empty_final in requests:
        tensor = triton_grpc.InferInput("INPUT0", [1] if "count" in model else [1, 16], "INT32")
        shape = (1,) if "count" in model else (1, 16)
        tensor.set_data_from_numpy(np.full(shape, value, dtype=np.int32))
        inputs = [tensor]
        if "add_sub" in model:
            second = triton_grpc.InferInput("INPUT1", [1, 16], "INT32")
            second.set_data_from_numpy(np.full(shape, 1, dtype=np.int32))
            inputs.append(second)
        client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=empty_final)
    client.stop_stream()
    answers, errors = {}, []
    while not received.empty():
        result, error = received.get()
        if error is not None:
            errors.append(error.message())
            continue
        response = result.get_response()
        output = result.as_numpy("OUTPUT0")
        final = response.parameters["triton_final_response"].bool_param
        answers.setdefault(response.id, []).append(
            (response.model_name, final, None if output is None else output.tolist()))
    return answers, errors


def test_streams_through_the_gateway_equal_triton_alone(triton):  # noqa: F811
    def requests(count_model, add_sub_model):
        return [
            (count_model, "three", 3, False),
            (count_model, "none", 0, True),
            (add_sub_model, "sum", 5, False),
            ("nope", "unknown", 1, False),
        ]

    def streams(address: str, requests: list) -> tuple:
        # One request per stream: Triton 2.51 can abort (a gRPC writer assertion, in Triton alone) when a decoupled
        # model's responses to several requests of one stream are written at once. Several requests on one stream
        # through the gateway are tested against the built-in model server (tests/streams.rs).
        answers, errors = {}, []
        for request in requests:
            more, failed = stream(address, [request])
            answers.update(more)
            errors += failed
        return answers, errors

    direct, direct_errors = streams(triton.replicas[0].grpc, requests("count", "add_sub"))
    # The decoupled model passed through to a gRPC backend, and through a REST backend's generate_stream; the other
    # model to both backend protocols as unary inferences.
    for count_model, add_sub_model in (("count_grpc", "add_sub_grpc"), ("count", "add_sub")):
        through, errors = streams(triton.gateways[0].grpc, requests(count_model, add_sub_model))
        assert through.keys() == direct.keys()
        for request_id, answers in direct.items():
            public = [
                (count_model if model == "count" else add_sub_model if model else model, final, output)
                for model, final, output in answers
            ]
            assert through[request_id] == public, (request_id, count_model, add_sub_model)
        assert len(errors) == len(direct_errors) == 1
        assert "'nope'" in errors[0] and "'nope'" in direct_errors[0]


def test_generate_through_the_gateway_equals_triton_alone(triton):  # noqa: F811
    import json
    import urllib.request

    def post(address: str, path: str, body: dict) -> tuple:
        request = urllib.request.Request(f"http://{address}{path}", data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(request) as answer:
            return answer.headers["Content-Type"], answer.read().decode()

    def events(text: str) -> list:
        assert text.endswith("\n\n") or text == "", text
        return [json.loads(event.removeprefix("data: ")) for event in text.split("\n\n") if event]

    # A decoupled model's events, and a stateless model's one answer: Triton's own, under the public names.
    for path, body in (("generate_stream", {"INPUT0": 3}), ("generate", {"INPUT0": list(range(16)), "INPUT1": [1] * 16})):
        upstream = "count" if "INPUT1" not in body else "add_sub"
        kind, direct = post(triton.replicas[0].rest, f"/v2/models/{upstream}/{path}", body)
        direct = [json.loads(direct)] if path == "generate" else events(direct)
        # Relayed from the REST backend; translated to the gRPC one's inference stream.
        for public in (upstream, f"{upstream}_grpc"):
            through_kind, through = post(triton.gateways[0].rest, f"/v2/models/{public}/{path}", body)
            assert through_kind == kind, (path, public, through_kind, kind)
            through = [json.loads(through)] if path == "generate" else events(through)
            expected = [dict(answer, model_name=public) for answer in direct]
            assert through == expected, (path, public)


def stream_sequences(address: str, model: str, first_id: int, sequences: int, steps: int) -> dict:
    """`sequences` sequences of `steps` steps on one ModelStreamInfer stream, their steps interleaved and sent back to
    back (as simple_grpc_sequence_stream_infer_client sends them); the running sum answered for each step."""
    import queue

    answers = queue.Queue()
    client = triton_grpc.InferenceServerClient(url=address)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    for step in range(steps):
        for sequence in range(sequences):
            tensor = triton_grpc.InferInput("INPUT0", [1], "INT32")
            tensor.set_data_from_numpy(np.array([step + 1], dtype=np.int32))
            client.async_stream_infer(
                model,
                [tensor],
                request_id=f"{sequence}-{step}",
                sequence_id=first_id + sequence,
                sequence_start=step == 0,
                sequence_end=step == steps - 1,
            )
    sums = {}
    for _ in range(sequences * steps):
        result, error = answers.get(timeout=60)
        assert error is None, error
        response = result.get_response()
        sums[response.id] = int(result.as_numpy("OUTPUT0")[0])
    client.stop_stream()
    return sums


@pytest.mark.parametrize("round_", range(5))
def test_a_streams_sequences_reach_rest_replicas_in_order(triton, round_):  # noqa: F811
    """Through the gRPC door to Triton's REST listeners (two replicas): every step of every sequence reaches the
    replica holding the sequence, in the order it was sent; repeated, since the race it guards against is one."""
    sequences, steps = 8, 6
    sums = stream_sequences(triton.gateways[0].grpc, "accumulate", 9000 + 100 * round_, sequences, steps)
    for sequence in range(sequences):
        for step in range(steps):
            assert sums[f"{sequence}-{step}"] == (step + 1) * (step + 2) // 2, (sequence, step, sums)

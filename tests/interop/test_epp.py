"""oipgate as the endpoint picker of an inference pool, behind a real Envoy (1.40, its ext_proc filter in
FULL_DUPLEX_STREAMED mode and ORIGINAL_DST clusters on x-gateway-destination-endpoint): tritonclient's calls over
both protocols land where the picker picked, a sequence stays on one replica, a loaded replica is avoided, a model
over its max_queue sheds low priority calls, the subset hint is honoured, the picker's failure fails open or closed
as configured, large and streamed bodies pass with the picker's memory flat, and its health services answer."""

import base64
import json
import os
import re
import struct
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http

from conftest import HERE, Process, free_port, required, start, wait_until_ready

ENVOY_TEMPLATE = HERE.parents[1] / "config" / "envoy-epp.yaml"


@dataclass
class Replica:
    name: str
    rest: str
    grpc: str


@dataclass
class Pool:
    replicas: list
    envoy: str
    envoy_admin: str
    epp: str
    epp_metrics: str
    epp_process: Process
    epp_args: list
    logs: Path


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None, timeout: float = 30):
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def metric(address: str, name: str, labels: dict) -> float:
    """The sum of the series of `name` whose labels include `labels`, from the picker's metrics at `address`."""
    _, _, text = http("GET", f"http://{address}/metrics")
    total = 0.0
    for line in text.decode().splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.index("}") + 1]))
        if all(found.get(key) == value for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def served(replica: Replica, model: str) -> int:
    """Inferences a replica answered for `model`, from its own statistics."""
    _, _, body = http("GET", f"http://{replica.rest}/v2/models/{model}/stats")
    return sum(stats["inference_count"] for stats in json.loads(body)["model_stats"])


def counts(pool: Pool, model: str) -> list:
    return [served(replica, model) for replica in pool.replicas]


def epp_config(replicas: list, epp: str, metrics: str) -> str:
    rest = ", ".join(f'"{r.rest}"' for r in replicas)
    grpc_endpoints = ", ".join(f'"{r.grpc}"' for r in replicas)
    return f"""
[listen]
epp = "{epp}"
metrics = "{metrics}"
[limits]
max_request_bytes = 268435456
[[backends]]
name = "pool-rest"
protocol = "rest"
endpoints = [{rest}]
binary_data = true
lb = "least_load"
load = {{ preset = "triton", interval_ms = 50 }}
[[backends]]
name = "pool-grpc"
protocol = "grpc"
endpoints = [{grpc_endpoints}]
[[models]]
name = "add_sub"
versions = [ {{ version = "1", backend = "pool-rest" }} ]
[[models]]
name = "add_sub_grpc"
versions = [ {{ version = "1", backend = "pool-grpc", upstream_name = "add_sub", upstream_version = "1" }} ]
[[models]]
name = "accumulate"
versions = [ {{ version = "1", backend = "pool-rest" }} ]
[[models]]
name = "accumulate_grpc"
versions = [ {{ version = "1", backend = "pool-grpc", upstream_name = "accumulate", upstream_version = "1" }} ]
[[models]]
name = "identity"
versions = [ {{ version = "1", backend = "pool-rest" }} ]
[[models]]
name = "count"
versions = [ {{ version = "1", backend = "pool-rest" }} ]
decoupled = true
[[models]]
name = "budgeted"
versions = [ {{ version = "1", backend = "pool-rest", upstream_name = "count" }} ]
decoupled = true
rate = {{ tokens_per_minute = 10 }}
[[models]]
name = "slow"
versions = [ {{ version = "1", backend = "pool-rest" }} ]
max_queue = 4
shed_priority_below = 2
"""


def envoy_config(pool_replicas: list, listen: int, epp: int, admin: int, fail_open: bool) -> str:
    def endpoints(kind: str) -> str:
        items = []
        for replica in pool_replicas:
            host, port = getattr(replica, kind).rsplit(":", 1)
            items.append(
                "{ endpoint: { address: { socket_address: { address: %s, port_value: %s } } } }" % (host, port)
            )
        return "[" + ", ".join(items) + "]"

    text = ENVOY_TEMPLATE.read_text()
    for key, value in {
        "LISTEN_PORT": str(listen),
        "EPP_PORT": str(epp),
        "ADMIN_PORT": str(admin),
        "FAILURE_MODE_ALLOW": "true" if fail_open else "false",
        "POOL_REST": endpoints("rest"),
        "POOL_GRPC": endpoints("grpc"),
    }.items():
        text = text.replace("{{" + key + "}}", value)
    return text


def start_envoy(name: str, logs: Path, replicas: list, epp_port: int, fail_open: bool) -> tuple:
    envoy = required("INTEROP_ENVOY")
    listen, admin = free_port(), free_port()
    config = logs / f"{name}.yaml"
    config.write_text(envoy_config(replicas, listen, epp_port, admin, fail_open))
    process = start(name, [envoy, "-c", str(config), "--base-id", str(free_port()), "-l", "warning"], logs)
    return process, f"127.0.0.1:{listen}", f"127.0.0.1:{admin}"


def wait_for(what: str, condition, seconds: float = 30, process: Process | None = None):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process is not None and process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited:\n{process.tail()}")
        try:
            if condition():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}" + (f":\n{process.tail()}" if process else ""))


def picker_healthy(admin: str) -> bool:
    _, _, text = http("GET", f"http://{admin}/clusters", timeout=2)
    return any(
        line.startswith("epp::") and line.endswith("health_flags::healthy") for line in text.decode().splitlines()
    )


def start_epp(oipgate: str, logs: Path, args: list) -> Process:
    return start("oipgate-epp", [oipgate, *args], logs)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    oipgate = required("OIPGATE_BIN")
    logs = tmp_path_factory.mktemp("epp")
    processes = []
    try:
        replicas = []
        for name in ("replica-a", "replica-b"):
            rest, grpc_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
            process = start(name, [oipgate, "model-server", "--rest", rest, "--grpc", grpc_address, "--name", name], logs)
            processes.append(process)
            wait_until_ready(process, rest, grpc_address)
            replicas.append(Replica(name, rest, grpc_address))
        epp_port = free_port()
        epp, metrics = f"127.0.0.1:{epp_port}", f"127.0.0.1:{free_port()}"
        config = logs / "epp.toml"
        config.write_text(epp_config(replicas, epp, metrics))
        check = subprocess.run([oipgate, "check-config", str(config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        args = ["epp", "--config", str(config)]
        epp_process = start_epp(oipgate, logs, args)
        processes.append(epp_process)
        envoy, listen, admin = start_envoy("envoy", logs, replicas, epp_port, fail_open=False)
        processes.append(envoy)
        wait_for("Envoy to find the picker healthy", lambda: picker_healthy(admin), 60, envoy)
        pool = Pool(replicas, listen, admin, epp, metrics, epp_process, args, logs)
        yield pool
        processes.append(pool.epp_process)
    finally:
        for process in reversed(processes):
            process.stop()


def add_sub_inputs(module, shape=(1, 16)):
    a = np.arange(16, dtype=np.int32).reshape(shape)
    b = np.ones(shape, dtype=np.int32)
    inputs = [module.InferInput("INPUT0", list(shape), "INT32"), module.InferInput("INPUT1", list(shape), "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, a, b


def picks(pool: Pool, model: str) -> list:
    return [
        metric(pool.epp_metrics, "oipgate_epp_picks_total", {"model": model, "endpoint": endpoint, "result": "picked"})
        for endpoint in endpoints_of(pool, model)
    ]


def endpoints_of(pool: Pool, model: str) -> list:
    kind = "grpc" if model.endswith("_grpc") else "rest"
    return [getattr(replica, kind) for replica in pool.replicas]


@pytest.mark.parametrize("protocol", ["rest", "grpc"])
def test_tritonclient_calls_land_on_the_endpoint_the_picker_picked(pool, protocol):
    model = "add_sub" if protocol == "rest" else "add_sub_grpc"
    if protocol == "rest":
        client = triton_http.InferenceServerClient(pool.envoy)
        module = triton_http
    else:
        client = triton_grpc.InferenceServerClient(pool.envoy)
        module = triton_grpc
    for _ in range(8):
        before_served, before_picked = counts(pool, "add_sub"), picks(pool, model)
        inputs, a, b = add_sub_inputs(module)
        result = client.infer(model, inputs, model_version="1")
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        after_served, after_picked = counts(pool, "add_sub"), picks(pool, model)
        landed = [after - before for after, before in zip(after_served, before_served)]
        picked = [after - before for after, before in zip(after_picked, before_picked)]
        assert sum(landed) == 1 and landed == picked, (landed, picked)
    # Envoy reported each call served where it was picked.
    for endpoint in endpoints_of(pool, model):
        assert metric(pool.epp_metrics, "oipgate_epp_served_total", {"endpoint": endpoint, "result": "fallback"}) == 0
    assert sum(
        metric(pool.epp_metrics, "oipgate_epp_served_total", {"endpoint": endpoint, "result": "picked"})
        for endpoint in endpoints_of(pool, model)
    ) >= 8


@pytest.mark.parametrize("protocol", ["rest", "grpc"])
def test_a_sequence_stays_on_one_replica(pool, protocol):
    model = "accumulate" if protocol == "rest" else "accumulate_grpc"
    module = triton_http if protocol == "rest" else triton_grpc
    client = module.InferenceServerClient(pool.envoy)
    for sequence in (101, 202, 303, 404):
        before = counts(pool, "accumulate")
        total = 0
        for step in range(5):
            value = np.array([step + 1], dtype=np.int32)
            total += step + 1
            tensor = module.InferInput("INPUT0", [1], "INT32")
            tensor.set_data_from_numpy(value)
            result = client.infer(
                model,
                [tensor],
                model_version="1",
                sequence_id=sequence,
                sequence_start=step == 0,
                sequence_end=step == 4,
            )
            assert int(result.as_numpy("OUTPUT0").reshape(-1)[0]) == total
        landed = [after - b for after, b in zip(counts(pool, "accumulate"), before)]
        assert sorted(landed) == [0, 5], landed


def slow_body(parameters: dict) -> bytes:
    return json.dumps(
        {"parameters": parameters, "inputs": [{"name": "x", "datatype": "INT32", "shape": [2], "data": [7, 8]}]}
    ).encode()


def hold(replica: Replica, count: int, executor: ThreadPoolExecutor) -> list:
    """Calls sent to a replica behind the gateway's back, each waiting there for 10 s."""
    url = f"http://{replica.rest}/v2/models/slow/infer"
    return [executor.submit(http, "POST", url, slow_body({"delay_ms": 10000}), {}, 60) for _ in range(count)]


def queue_seen(pool: Pool, replica: Replica) -> float:
    return metric(pool.epp_metrics, "oipgate_endpoint_queue", {"endpoint": replica.rest})


def test_a_replica_loaded_behind_the_pickers_back_is_avoided_and_max_queue_sheds_by_priority(pool):
    a, b = pool.replicas
    url = f"http://{pool.envoy}/v2/models/slow/infer"
    with ThreadPoolExecutor(16) as executor:
        held = hold(a, 6, executor)
        wait_for("replica a's queue to be scraped", lambda: queue_seen(pool, a) >= 6)
        before = counts(pool, "slow")
        for _ in range(10):
            status, _, body = http("POST", url, slow_body({}))
            assert status == 200, body
        landed = [after - b_ for after, b_ in zip(counts(pool, "slow"), before)]
        assert landed == [0, 10], landed

        held += hold(b, 6, executor)
        wait_for("replica b's queue to be scraped", lambda: queue_seen(pool, b) >= 6)
        before = counts(pool, "slow")
        for _ in range(5):
            status, headers, body = http("POST", url, slow_body({}))
            assert status == 429, body
            assert "shedding load" in body.decode()
            assert int(headers.get("retry-after", headers.get("Retry-After", "0"))) >= 1
        status, _, body = http("POST", url, slow_body({"priority": 1}))
        assert status == 200, body
        landed = [after - b_ for after, b_ in zip(counts(pool, "slow"), before)]
        assert sum(landed) == 1, landed
        assert metric(pool.epp_metrics, "oipgate_epp_picks_total", {"model": "slow", "result": "shed"}) >= 5
        for future in held:
            future.result()


def test_the_subset_hint_is_honoured_and_an_empty_one_is_503(pool):
    a, b = pool.replicas
    url = f"http://{pool.envoy}/v2/models/add_sub/infer"
    body = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
                {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
            ]
        }
    ).encode()
    for replica, index in ((a, 0), (b, 1)):
        before = counts(pool, "add_sub")
        for _ in range(4):
            status, _, answer = http("POST", url, body, {"x-test-subset": replica.rest})
            assert status == 200, answer
        landed = [after - b_ for after, b_ in zip(counts(pool, "add_sub"), before)]
        assert landed[index] == 4 and sum(landed) == 4, landed
    # An empty list (a serialized google.protobuf.Value), and a list naming no endpoint of the pool.
    empty = base64.b64encode(b"\x32\x00").decode()
    before = counts(pool, "add_sub")
    status, _, answer = http("POST", url, body, {"x-test-subset-pb": empty})
    assert status == 503, answer
    assert "subset hint" in answer.decode()
    status, _, answer = http("POST", url, body, {"x-test-subset": "10.9.9.9:80"})
    assert status == 503, answer
    assert counts(pool, "add_sub") == before


def memory_kib(process: Process, field: str) -> int:
    """VmRSS (resident now) or VmHWM (the most resident since start) of a process, in KiB."""
    status = Path(f"/proc/{process.popen.pid}/status").read_text()
    return int(re.search(field + r":\s+(\d+)", status).group(1))


def binary_identity(pool: Pool, size: int) -> None:
    header = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "datatype": "UINT8", "shape": [size], "parameters": {"binary_data_size": size}}
            ],
            "outputs": [{"name": "INPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    payload = bytes(range(256)) * (size // 256)
    status, _, answer = http(
        "POST",
        f"http://{pool.envoy}/v2/models/identity/infer",
        header + payload,
        {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
        timeout=180,
    )
    assert status == 200, answer[:300]
    assert len(answer) >= size and answer.endswith(payload[-4096:])


def test_a_64_mib_binary_request_and_a_stream_pass_with_the_pickers_memory_flat(pool):
    resident = memory_kib(pool.epp_process, "VmRSS")
    binary_identity(pool, 64 << 20)
    after_first = memory_kib(pool.epp_process, "VmHWM")
    binary_identity(pool, 192 << 20)
    after_second = memory_kib(pool.epp_process, "VmHWM")
    # The bodies went through the picker in chunks: what it held at most is bounded by the relay's windows and
    # queues, less than one body, and three times the data took next to nothing more of it: under a twelfth of the
    # second body (the allocator's own growth varies from run to run, and once reached 9 MiB; a picker that held a
    # tenth of the body would grow by 19 MiB).
    assert after_first - resident < 48 * 1024, (resident, after_first)
    assert after_second - after_first < 16 * 1024, (after_first, after_second)

    status, _, answer = http(
        "POST", f"http://{pool.envoy}/v2/models/count/generate_stream", json.dumps({"INPUT0": 3}).encode()
    )
    assert status == 200, answer
    events = [line for line in answer.decode().splitlines() if line.startswith("data:")]
    assert len(events) >= 3, answer


def test_a_token_budget_is_charged_what_the_answers_envoy_relays_carry(pool):
    # Envoy sends the picker a generate call's answer body (the template's route for generate paths) and the picker
    # counts its events: twelve tokens against a budget of ten a minute, so the next call is refused before any
    # replica is picked. (The picker also takes the call's Accept-Encoding off, so the answer can be read: the
    # header mutation is tests/epp.rs's to check.)
    url = f"http://{pool.envoy}/v2/models/budgeted/generate_stream"
    status, headers, answer = http("POST", url, json.dumps({"INPUT0": 12}).encode(), {"Accept-Encoding": "gzip"})
    assert status == 200, answer
    events = [line for line in answer.decode().splitlines() if line.startswith("data:")]
    assert len(events) == 12, answer
    status, headers, answer = http("POST", url, json.dumps({"INPUT0": 1}).encode())
    assert status == 429, (status, answer)
    assert b"spent its token budget" in answer, answer
    assert int(headers.get("retry-after", headers.get("Retry-After", "0"))) > 0, headers


def grpc_health(address: str, service: str) -> int:
    """grpc.health.v1.Health/Check with a real gRPC client; the status enum (1 SERVING, 2 NOT_SERVING)."""
    channel = grpc.insecure_channel(address)
    check = channel.unary_unary("/grpc.health.v1.Health/Check")
    encoded = service.encode()
    request = b"\x0a" + bytes([len(encoded)]) + encoded
    answer = check(request, timeout=5)
    channel.close()
    return answer[1] if len(answer) >= 2 else 0


def test_health_services_answer_as_the_protocol_names_them(pool):
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert grpc_health(pool.epp, service) == 1, service
    with pytest.raises(grpc.RpcError) as unknown:
        grpc_health(pool.epp, "no.such.Service")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_picker_down_fails_closed_or_open_as_envoy_is_configured(pool):
    oipgate = required("OIPGATE_BIN")
    url_path = "/v2/models/add_sub/infer"
    body = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
                {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [2] * 16},
            ]
        }
    ).encode()
    epp_port = int(pool.epp.rsplit(":", 1)[1])
    fail_open, open_listen, open_admin = start_envoy("envoy-fail-open", pool.logs, pool.replicas, epp_port, True)
    try:
        wait_for("the fail-open Envoy to find the picker healthy", lambda: picker_healthy(open_admin), 60, fail_open)
        for listen in (pool.envoy, open_listen):
            status, _, answer = http("POST", f"http://{listen}{url_path}", body)
            assert status == 200, answer
        pool.epp_process.stop()
        wait_for("both Envoys to find the picker down", lambda: not picker_healthy(pool.envoy_admin))
        wait_for("the fail-open Envoy to find the picker down", lambda: not picker_healthy(open_admin))
        status, _, answer = http("POST", f"http://{pool.envoy}{url_path}", body)
        assert status >= 500, (status, answer)
        status, _, answer = http("POST", f"http://{open_listen}{url_path}", body)
        assert status == 200, answer
    finally:
        fail_open.stop()
        pool.epp_process = start_epp(oipgate, pool.logs, pool.epp_args)
        wait_for("the picker back", lambda: picker_healthy(pool.envoy_admin), 60, pool.epp_process)

"""oipgate epp as the endpoint picker of two real Triton replicas, behind a real Envoy: tritonclient's calls over both
protocols land on the replica the picker picked, and every request of a sequence of Triton's stateful `accumulate`
model (the suite's simple_sequence) reaches the replica holding its state, so the answers equal Triton's alone."""

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http

from conftest import free_port, required, start
from test_epp import http, metric, picker_healthy, start_envoy, wait_for
from test_triton import STEPS, run_sequence
from triton_server import triton  # noqa: F401  (the fixture)


def picker_config(replicas: list, epp: str, metrics: str) -> str:
    rest = ", ".join(f'"{r.rest}"' for r in replicas)
    grpc = ", ".join(f'"{r.grpc}"' for r in replicas)
    return f"""
[listen]
epp = "{epp}"
metrics = "{metrics}"
[[backends]]
name = "triton-rest"
protocol = "rest"
endpoints = [{rest}]
[[backends]]
name = "triton-grpc"
protocol = "grpc"
endpoints = [{grpc}]
[[models]]
name = "accumulate"
versions = [ {{ version = "1", backend = "triton-rest" }} ]
[[models]]
name = "add_sub"
versions = [ {{ version = "1", backend = "triton-rest" }} ]
[[models]]
name = "accumulate_grpc"
versions = [ {{ version = "1", backend = "triton-grpc", upstream_name = "accumulate" }} ]
[[models]]
name = "add_sub_grpc"
versions = [ {{ version = "1", backend = "triton-grpc", upstream_name = "add_sub" }} ]
"""


@pytest.fixture(scope="module")
def picked(triton, tmp_path_factory):  # noqa: F811
    oipgate = required("OIPGATE_BIN")
    logs = tmp_path_factory.mktemp("epp-triton")
    epp_port = free_port()
    epp, metrics = f"127.0.0.1:{epp_port}", f"127.0.0.1:{free_port()}"
    config = logs / "epp.toml"
    config.write_text(picker_config(triton.replicas, epp, metrics))
    check = subprocess.run([oipgate, "check-config", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    processes = [start("oipgate-epp", [oipgate, "epp", "--config", str(config)], logs)]
    try:
        envoy, listen, admin = start_envoy("envoy", logs, triton.replicas, epp_port, fail_open=False)
        processes.append(envoy)
        wait_for("Envoy to find the picker healthy", lambda: picker_healthy(admin), 60, envoy)
        yield listen, metrics
    finally:
        for process in reversed(processes):
            process.stop()


def inference_count(address: str, model: str) -> int:
    _, _, body = http("GET", f"http://{address}/v2/models/{model}/stats")
    return sum(stats["inference_stats"]["success"]["count"] for stats in json.loads(body)["model_stats"])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_calls_land_on_the_triton_replica_the_picker_picked(triton, picked, protocol):  # noqa: F811
    listen, metrics = picked
    module = triton_grpc if protocol == "grpc" else triton_http
    model = "add_sub_grpc" if protocol == "grpc" else "add_sub"
    door = "grpc" if protocol == "grpc" else "rest"
    client = module.InferenceServerClient(url=listen)
    endpoints = [getattr(replica, door) for replica in triton.replicas]

    def picks():
        return [
            metric(metrics, "oipgate_epp_picks_total", {"model": model, "endpoint": endpoint, "result": "picked"})
            for endpoint in endpoints
        ]

    for _ in range(6):
        before = [inference_count(r.rest, "add_sub") for r in triton.replicas]
        picked_before = picks()
        inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
        result = client.infer(model, inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + 1)
        landed = [after - b for after, b in zip((inference_count(r.rest, "add_sub") for r in triton.replicas), before)]
        chosen = [after - b for after, b in zip(picks(), picked_before)]
        assert sum(landed) == 1 and landed == chosen, (landed, chosen)


@pytest.mark.parametrize("protocol,model", [("http", "accumulate"), ("grpc", "accumulate_grpc")])
def test_a_sequence_reaches_the_replica_holding_its_state(triton, picked, protocol, model):  # noqa: F811
    listen, _ = picked
    door = "grpc" if protocol == "grpc" else "rest"
    through = list(range(7000 + 100 * len(model), 7008 + 100 * len(model)))
    direct = [s + 50 for s in through]
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda s: run_sequence([listen], protocol, model, s), through))
        expected = list(
            pool.map(lambda s: run_sequence([getattr(triton.replicas[0], door)], protocol, "accumulate", s), direct)
        )
    # Sent to the replica without the sequence's state, a step would fail or start a new sum.
    assert answers == expected
    assert expected[0] == [sum(10 * i + 1 for i in range(n + 1)) for n in range(STEPS)]

"""Two real Triton Inference Server replicas (CPU, Python backend, the models under servers/triton/) and two oipgate
processes with one configuration in front of both, balanced round robin: `accumulate`, `add_sub` and the decoupled
`count` over the replicas' REST listeners, `accumulate_grpc`, `add_sub_grpc` and `count_grpc` over their gRPC ones.
Started once per run, always stopped."""

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import SERVERS, Process, free_port, required, start, wait_until_ready

MODELS = SERVERS / "triton"
# Triton takes its ports as numbers; one that another process took meanwhile makes it exit, and it is started again.
ATTEMPTS = 3


@dataclass
class Replica:
    rest: str
    grpc: str
    # Triton's metrics port; the gateway's metrics listener.
    metrics: str = ""


@dataclass
class TritonFleet:
    replicas: list
    gateways: list


def start_triton(name: str, logs: Path) -> tuple:
    server = required("INTEROP_TRITON")
    environment = required("INTEROP_TRITON_ENV")
    libraries = next(Path(environment).glob("lib/python3.11/site-packages/nvidia_pytriton.libs"))
    for attempt in range(ATTEMPTS):
        http, grpc, metrics = free_port(), free_port(), free_port()
        process = start(
            f"{name}-{attempt}",
            [
                server,
                "--model-repository", str(MODELS),
                "--backend-directory", str(Path(server).parents[1] / "backends"),
                "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                "--model-control-mode", "explicit", "--load-model", "*",
                "--log-verbose", "0",
            ],
            logs,
            env={
                # The Python backend's stub runs the models with the environment's interpreter and packages.
                "PATH": f"{environment}/bin:{os.environ['PATH']}",
                "LD_LIBRARY_PATH": str(libraries),
            },
        )
        replica = Replica(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"127.0.0.1:{metrics}")
        try:
            wait_until_ready(process, replica.rest, replica.grpc, seconds=60)
            return process, replica
        except RuntimeError:
            process.stop()
            if attempt + 1 == ATTEMPTS:
                raise


def gateway_config(replicas: list) -> str:
    def endpoints(protocol):
        return ", ".join(f'"{getattr(r, protocol)}"' for r in replicas)

    # The same replicas balanced on the queue Triton's own metrics report.
    read_at = ", ".join(f'{{ address = "{r.rest}", metrics = "{r.metrics}" }}' for r in replicas)
    lines = [
        "[listen]",
        'rest = "127.0.0.1:0"',
        'grpc = "127.0.0.1:0"',
        'metrics = "127.0.0.1:0"',
        "[[backends]]",
        'name = "triton-load"',
        'protocol = "rest"',
        f"endpoints = [{read_at}]",
        'lb = "least_load"',
        'load = { preset = "triton", interval_ms = 100 }',
        "[[models]]",
        'name = "add_sub_load"',
        'versions = [ { version = "1", backend = "triton-load", upstream_name = "add_sub" } ]',
        "[[models]]",
        'name = "slow_load"',
        'versions = [ { version = "1", backend = "triton-load", upstream_name = "slow" } ]',
        "[[backends]]",
        'name = "triton-rest"',
        'protocol = "rest"',
        "binary_data = true",
        # Triton reads compressed bodies: they are proxied to it as they came.
        "compression = true",
        f"endpoints = [{endpoints('rest')}]",
        "[[backends]]",
        'name = "triton-grpc"',
        'protocol = "grpc"',
        # And compressed messages: an inference that came compressed goes to it compressed.
        "compression = true",
        f"endpoints = [{endpoints('grpc')}]",
    ]
    for model in ("accumulate", "add_sub", "count"):
        # A decoupled model's stream requests reach a REST backend's generate_stream.
        decoupled = ["decoupled = true"] if model == "count" else []
        lines += [
            "[[models]]",
            f'name = "{model}"',
            *decoupled,
            f'versions = [ {{ version = "1", backend = "triton-rest", upstream_name = "{model}" }} ]',
            "[[models]]",
            f'name = "{model}_grpc"',
            f'versions = [ {{ version = "1", backend = "triton-grpc", upstream_name = "{model}" }} ]',
        ]
    return "\n".join(lines) + "\n"


def start_gateway(name: str, config: Path, logs: Path) -> tuple:
    """Starts `oipgate serve` on port 0 everywhere and reads the addresses it bound from its first line."""
    oipgate = required("OIPGATE_BIN")
    log = logs / f"{name}.log"
    popen = subprocess.Popen(
        [oipgate, "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=open(log, "wb"),
        start_new_session=True,
        text=True,
    )
    line = popen.stdout.readline()
    process = Process(name, popen, log)
    words = dict(word.split("=", 1) for word in line.split() if "=" in word)
    if not line.startswith("oipgate serving") or "rest" not in words:
        process.stop()
        raise RuntimeError(f"{name} did not start: {line!r}\n{process.tail()}")
    replica = Replica(words["rest"], words["grpc"], words.get("metrics", ""))
    wait_until_ready(process, replica.rest, replica.grpc)
    return process, replica


@pytest.fixture(scope="session")
def triton(tmp_path_factory):
    logs = tmp_path_factory.mktemp("triton-logs")
    processes = []
    try:
        replicas = []
        for name in ("triton-a", "triton-b"):
            process, replica = start_triton(name, logs)
            processes.append(process)
            replicas.append(replica)
        config = logs / "gateway.toml"
        config.write_text(gateway_config(replicas))
        gateways = []
        for name in ("oipgate-1", "oipgate-2"):
            process, gateway = start_gateway(name, config, logs)
            processes.append(process)
            gateways.append(gateway)
        yield TritonFleet(replicas=replicas, gateways=gateways)
    finally:
        for process in reversed(processes):
            process.stop()

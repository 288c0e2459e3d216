"""The interop suite's fleet: oipgate's model server, MLServer and KServe's ModelServer (each on REST and gRPC), and
oipgate itself (the built binary) in front of all six, with a configuration written here. Started once per run,
always stopped."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# Each run drives one client family (see clients.py): the other family's files are not collected.
# The Triton server run (scripts/interop's third) collects only its own file.
collect_ignore = {
    "triton": [
        "test_epp_triton.py",
        "test_kserve_endpoints.py",
        "test_content_types.py",
        "test_triton.py",
        "test_protobuf_keys.py",
    ],
    "kserve": [
        "test_epp.py",
        "test_epp_triton.py",
        "test_endpoints.py",
        "test_errors.py",
        "test_triton.py",
        "test_mlserver_streams.py",
        "test_protobuf_keys.py",
    ],
    "triton-server": [
        "test_epp.py",
        "test_kserve_endpoints.py",
        "test_content_types.py",
        "test_endpoints.py",
        "test_errors.py",
        "test_infer.py",
        "test_mlserver_streams.py",
    ],
}.get(os.environ.get("INTEROP_CLIENTS", ""), [])

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SERVERS = HERE / "servers"

# Backend kinds and, for each, the upstream names of the suite's three model roles.
KINDS = ("oipgate", "mlserver", "kserve")
PROTOCOLS = ("rest", "grpc")
UPSTREAM = {
    "oipgate": {"echo": ("identity", "1"), "strict": ("add_sub", "1")},
    "mlserver": {"echo": ("echo", ""), "strict": ("strict", ""), "decode": ("decode", ""), "count": ("count", "")},
    "kserve": {"echo": ("echo", ""), "strict": ("strict", "")},
}
# Which backends speak the binary tensor data extension over REST (MLServer does not).
BINARY_DATA = {"oipgate": True, "mlserver": False, "kserve": True}


def required(variable: str) -> str:
    """A component the suite cannot run without: missing means failure, never a silent skip."""
    value = os.environ.get(variable)
    if not value or not Path(value).exists():
        pytest.exit(f"interop: {variable} must name an existing file (got {value!r}); run scripts/interop", 2)
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def public_name(kind: str, protocol: str, role: str) -> str:
    return f"{kind}_{protocol}_{role}"


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.popen.wait(timeout=10)

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""


@dataclass
class Server:
    rest: str
    grpc: str
    processes: list = field(default_factory=list)


@dataclass
class Fleet:
    backends: dict
    gateway: Server
    dead_port: int


def start(name: str, args: list, logs: Path, env: dict | None = None, cwd: Path | None = None) -> Process:
    log = logs / f"{name}.log"
    handle = open(log, "wb")
    popen = subprocess.Popen(
        args,
        stdout=handle,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        start_new_session=True,
    )
    return Process(name, popen, log)


def wait_until_ready(process: Process, rest: str, grpc: str, seconds: float = 120) -> None:
    """Waits for REST /v2/health/ready to answer 200 and the gRPC port to accept."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.tail()}")
        try:
            with urllib.request.urlopen(f"http://{rest}/v2/health/ready", timeout=2) as answer:
                if answer.status == 200:
                    host, port = grpc.rsplit(":", 1)
                    with socket.create_connection((host, int(port)), timeout=2):
                        return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{process.name} was not ready in {seconds}s:\n{process.tail()}")


def gateway_config(backends: dict, rest: str, grpc: str, metrics: str, dead_port: int) -> str:
    lines = [
        "[listen]",
        f'rest = "{rest}"',
        f'grpc = "{grpc}"',
        f'metrics = "{metrics}"',
        "[limits]",
        "max_request_bytes = 268435456",
    ]
    for kind in KINDS:
        for protocol in PROTOCOLS:
            address = getattr(backends[kind], protocol)
            lines += [
                "[[backends]]",
                f'name = "{kind}-{protocol}"',
                f'protocol = "{protocol}"',
                f'endpoints = ["{address}"]',
            ]
            if protocol == "rest":
                lines.append(f"binary_data = {str(BINARY_DATA[kind]).lower()}")
            if kind == "mlserver":
                lines.append('stream = "mlserver"')
            for role, (upstream, version) in UPSTREAM[kind].items():
                lines += [
                    "[[models]]",
                    f'name = "{public_name(kind, protocol, role)}"',
                    # A streaming model behind REST is reached through the backend's REST stream.
                    *(["decoupled = true"] if role == "count" and protocol == "rest" else []),
                    f'versions = [ {{ version = "1", backend = "{kind}-{protocol}", '
                    f'upstream_name = "{upstream}", upstream_version = "{version}" }} ]',
                ]
    lines += [
        "[[backends]]",
        'name = "down"',
        'protocol = "grpc"',
        f'endpoints = ["127.0.0.1:{dead_port}"]',
        "[[models]]",
        'name = "down"',
        'versions = [ { version = "1", backend = "down" } ]',
    ]
    # The gateway is ready when any model is: the "down" model never is.
    return 'ready_policy = "any_model"\n' + "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def fleet(tmp_path_factory):
    oipgate = required("OIPGATE_BIN")
    mlserver = required("INTEROP_MLSERVER")
    logs = tmp_path_factory.mktemp("logs")
    processes = []
    try:
        backends = {}
        ports = {kind: (free_port(), free_port()) for kind in KINDS}

        rest, grpc = (f"127.0.0.1:{p}" for p in ports["oipgate"])
        processes.append(start("oipgate-model-server", [oipgate, "model-server", "--rest", rest, "--grpc", grpc], logs))
        backends["oipgate"] = Server(rest, grpc)

        rest, grpc = (f"127.0.0.1:{p}" for p in ports["mlserver"])
        processes.append(
            start(
                "mlserver",
                [mlserver, "start", str(SERVERS / "mlserver")],
                logs,
                env={
                    "MLSERVER_HOST": "127.0.0.1",
                    "MLSERVER_HTTP_PORT": str(ports["mlserver"][0]),
                    "MLSERVER_GRPC_PORT": str(ports["mlserver"][1]),
                    "MLSERVER_METRICS_PORT": str(free_port()),
                },
                cwd=SERVERS / "mlserver",
            )
        )
        backends["mlserver"] = Server(rest, grpc)

        rest, grpc = (f"127.0.0.1:{p}" for p in ports["kserve"])
        processes.append(
            start(
                "kserve",
                [sys.executable, str(SERVERS / "kserve_server.py"), *map(str, ports["kserve"])],
                logs,
            )
        )
        backends["kserve"] = Server(rest, grpc)

        for process, kind in zip(processes, KINDS):
            wait_until_ready(process, backends[kind].rest, backends[kind].grpc)

        rest, grpc, metrics = (f"127.0.0.1:{free_port()}" for _ in range(3))
        dead_port = free_port()
        config = logs / "gateway.toml"
        config.write_text(gateway_config(backends, rest, grpc, metrics, dead_port))
        check = subprocess.run([oipgate, "check-config", str(config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        gateway = start("oipgate", [oipgate, "serve", "--config", str(config)], logs)
        processes.append(gateway)
        wait_until_ready(gateway, rest, grpc)
        yield Fleet(backends=backends, gateway=Server(rest, grpc), dead_port=dead_port)
    finally:
        for process in reversed(processes):
            process.stop()

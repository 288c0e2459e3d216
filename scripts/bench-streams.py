"""Inference-stream figures (docs/BENCHMARKS.md, "Streams"): time to the first response through the gateway against
the backend reached directly, alone and under load, and CPU per message of the gateway and the backend, for a gRPC
stream passed through, generate_stream and infer_stream translated to a gRPC stream, and generate_stream relayed from
a REST backend; and, as the reference for the passthrough, the same gRPC stream through HAProxy (`proto h2` on both
sides) when `haproxy` is installed (scripts/bench installs it). Every path is measured in each of ROUNDS alternated
rounds (A B C ... A B C ...); the tables give the medians of the rounds.

    scripts/setup && cargo build --release --bin oipgate
    target/interop/clients/bin/python scripts/bench-streams.py target/release/oipgate
    BENCH_ONLY="gRPC stream" target/interop/clients/bin/python scripts/bench-streams.py target/release/oipgate

The client is Python (grpcio, http.client): its own cost is in every latency, alike with and without the gateway, so
the difference between a row and its backend-direct row is what the gateway adds. Ports 19100-19202 on loopback."""
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

BIN = sys.argv[1]
ROUNDS = 3
STREAMS = 500  # first-response samples per path and round, one stream at a time
LOADED = (8, 100)  # under load: 8 client threads, 100 streams each, per path and round
MESSAGES = 100_000  # responses of the one stream CPU per message is measured on

CONFIG = """[listen]
rest = "127.0.0.1:19200"
grpc = "127.0.0.1:19201"
[[backends]]
name = "g"
protocol = "grpc"
endpoints = ["127.0.0.1:19101"]
[[backends]]
name = "r"
protocol = "rest"
endpoints = ["127.0.0.1:19100"]
[[models]]
name = "count"
versions = [ { version = "1", backend = "g" } ]
[[models]]
name = "count_rest"
versions = [ { version = "1", backend = "r", upstream_name = "count" } ]
"""


def cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def request(n: int) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name="count", id="b")
    tensor = message.inputs.add()
    tensor.name, tensor.datatype = "INPUT0", "INT32"
    tensor.shape.extend([1])
    message.raw_input_contents.append(np.array([n], dtype=np.int32).tobytes())
    return message


def body(call: str, n: int) -> bytes:
    if call == "infer_stream":
        return json.dumps({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": [n]}]}).encode()
    return json.dumps({"INPUT0": n}).encode()


class GrpcPath:
    def __init__(self, address: str, model: str):
        self.address, self.model = address, model

    def client(self):
        return service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(self.address))

    def first_response(self, stub) -> float:
        started = time.perf_counter()
        message = request(1)
        message.model_name = self.model
        answers = stub.ModelStreamInfer(iter([message]))
        next(answers)
        took = time.perf_counter() - started
        for _ in answers:
            pass
        return took

    def responses(self, stub, n: int) -> int:
        message = request(n)
        message.model_name = self.model
        return sum(1 for _ in stub.ModelStreamInfer(iter([message])))


class SsePath:
    def __init__(self, port: int, model: str, call: str):
        self.port, self.model, self.call = port, model, call

    def client(self):
        return http.client.HTTPConnection("127.0.0.1", self.port)

    def first_response(self, connection) -> float:
        started = time.perf_counter()
        connection.request("POST", f"/v2/models/{self.model}/{self.call}", body=body(self.call, 1))
        answer = connection.getresponse()
        answer.readline()
        took = time.perf_counter() - started
        answer.read()
        return took

    def responses(self, connection, n: int) -> int:
        connection.request("POST", f"/v2/models/{self.model}/{self.call}", body=body(self.call, n))
        return connection.getresponse().read().count(b"data: ")


HAPROXY = """global
    nbthread 2
defaults
    mode http
    timeout connect 5s
    timeout client 120s
    timeout server 120s
frontend grpc
    bind 127.0.0.1:19202 proto h2
    default_backend grpc
backend grpc
    server backend 127.0.0.1:19101 proto h2
"""
HAPROXY_ROW = "gRPC stream through HAProxy (passthrough)"
HAPROXY_BINARY = next((b for b in ("/usr/sbin/haproxy", "/usr/bin/haproxy") if os.path.exists(b)), None)

PATHS = {
    "gRPC stream, backend direct": GrpcPath("127.0.0.1:19101", "count"),
    "gRPC stream through the gateway (passthrough)": GrpcPath("127.0.0.1:19201", "count"),
    HAPROXY_ROW: GrpcPath("127.0.0.1:19202", "count"),
    "generate_stream, backend direct (REST)": SsePath(19100, "count", "generate_stream"),
    "generate_stream through the gateway, relayed from REST": SsePath(19200, "count_rest", "generate_stream"),
    "generate_stream through the gateway, translated to gRPC": SsePath(19200, "count", "generate_stream"),
    "infer_stream through the gateway, translated to gRPC": SsePath(19200, "count", "infer_stream"),
}


# BENCH_ONLY=text measures only the paths whose names contain it (to compare two builds on a few paths).
PATHS = {name: path for name, path in PATHS.items() if os.environ.get("BENCH_ONLY", "") in name}
if HAPROXY_BINARY is None:
    PATHS.pop(HAPROXY_ROW, None)


def alone(path) -> list:
    client = path.client()
    return [path.first_response(client) for _ in range(STREAMS)]


def loaded(path) -> list:
    threads, each = LOADED

    def worker(_):
        client = path.client()
        return [path.first_response(client) for _ in range(each)]

    with ThreadPoolExecutor(threads) as pool:
        return [t for times in pool.map(worker, range(threads)) for t in times]


def per_message(path, proxy: int, server: int) -> tuple:
    client = path.client()
    g0, s0 = cpu(proxy), cpu(server)
    started = time.perf_counter()
    got = path.responses(client, MESSAGES)
    wall = time.perf_counter() - started
    assert got == MESSAGES, (got, MESSAGES)
    return (cpu(proxy) - g0) / MESSAGES * 1e6, (cpu(server) - s0) / MESSAGES * 1e6, MESSAGES / wall


def percentile(values: list, p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))] * 1e6


def main():
    server = subprocess.Popen([BIN, "model-server", "--rest", "127.0.0.1:19100", "--grpc", "127.0.0.1:19101"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    server.stdout.readline()
    with open("/tmp/bench-streams.toml", "w") as f:
        f.write(CONFIG)
    gateway = subprocess.Popen([BIN, "serve", "--config", "/tmp/bench-streams.toml"], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
    gateway.stdout.readline()
    haproxy = None
    if HAPROXY_ROW in PATHS:
        with open("/tmp/bench-streams-haproxy.cfg", "w") as f:
            f.write(HAPROXY)
        haproxy = subprocess.Popen([HAPROXY_BINARY, "-db", "-f", "/tmp/bench-streams-haproxy.cfg"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)
    try:
        assert gateway.poll() is None and server.poll() is None
        assert haproxy is None or haproxy.poll() is None
        for path in PATHS.values():  # warm-up
            client = path.client()
            for _ in range(50):
                path.first_response(client)
        latency = {name: {"alone": [], "loaded": []} for name in PATHS}
        costs = {name: [] for name in PATHS}
        for round_ in range(ROUNDS):
            for name, path in PATHS.items():
                times = alone(path)
                latency[name]["alone"].append((percentile(times, 0.5), percentile(times, 0.99)))
                times = loaded(path)
                latency[name]["loaded"].append((percentile(times, 0.5), percentile(times, 0.99)))
                proxy = haproxy.pid if name == HAPROXY_ROW else gateway.pid
                costs[name].append(per_message(path, proxy, server.pid))
            print(f"round {round_ + 1} of {ROUNDS} done", file=sys.stderr)
        median = statistics.median
        print(f"Time to the first response (microseconds; medians of {ROUNDS} rounds):\n")
        print("| path | alone p50 | alone p99 | 8 streams at once p50 | 8 streams at once p99 |")
        print("|---|---|---|---|---|")
        for name, rows in latency.items():
            a, b = rows["alone"], rows["loaded"]
            print(f"| {name} | {median(r[0] for r in a):.0f} | {median(r[1] for r in a):.0f} "
                  f"| {median(r[0] for r in b):.0f} | {median(r[1] for r in b):.0f} |")
        print(f"\nCPU per message over a stream of {MESSAGES:,} responses (microseconds; medians of {ROUNDS} rounds):\n")
        print("| path | proxy CPU | backend CPU | messages/s |")
        print("|---|---|---|---|")
        for name, rows in costs.items():
            gateway_cpu = median(r[0] for r in rows) if "direct" not in name else None
            print(f"| {name} | {'-' if gateway_cpu is None else f'{gateway_cpu:.2f}'} "
                  f"| {median(r[1] for r in rows):.2f} | {median(r[2] for r in rows):,.0f} |")
    finally:
        gateway.kill()
        server.kill()
        if haproxy is not None:
            haproxy.kill()


if __name__ == "__main__":
    main()

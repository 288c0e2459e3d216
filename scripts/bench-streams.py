"""Inference-stream figures (docs/BENCHMARKS.md, "Streams"): time to the first response through the gateway against
the backend reached directly, and CPU per message of the gateway and the backend, for a gRPC stream passed through,
generate_stream translated to a gRPC stream, and generate_stream relayed from a REST backend.

    scripts/setup && cargo build --release --bin oipgate
    target/interop/clients/bin/python scripts/bench-streams.py target/release/oipgate

The client is Python (grpcio, http.client): its own cost is in every latency, alike with and without the gateway, so
the difference between the two is what the gateway adds. Ports 19100-19201 on loopback."""
import os, sys, time, json, statistics, subprocess, urllib.request, http.client
import numpy as np
import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

BIN = sys.argv[1]
def cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

server = subprocess.Popen([BIN, "model-server", "--rest", "127.0.0.1:19100", "--grpc", "127.0.0.1:19101"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
server.stdout.readline()
cfg = """[listen]
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
open("/tmp/sbench.toml", "w").write(cfg)
gateway = subprocess.Popen([BIN, "serve", "--config", "/tmp/sbench.toml"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
gateway.stdout.readline()
time.sleep(1)
assert gateway.poll() is None and server.poll() is None

def request(model, n):
    r = service_pb2.ModelInferRequest(model_name=model, id="b")
    t = r.inputs.add(); t.name = "INPUT0"; t.datatype = "INT32"; t.shape.extend([1])
    r.raw_input_contents.append(np.array([n], dtype=np.int32).tobytes())
    return r

def first_response_times(address, model, rounds):
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(address))
    times = []
    for i in range(rounds + 50):
        started = time.perf_counter()
        answers = stub.ModelStreamInfer(iter([request(model, 1)]))
        next(answers)
        took = time.perf_counter() - started
        for _ in answers:
            pass
        if i >= 50:
            times.append(took)
    return times

def sse_first_event_times(port, model, rounds):
    times = []
    conn = http.client.HTTPConnection("127.0.0.1", port)
    for i in range(rounds + 50):
        started = time.perf_counter()
        conn.request("POST", f"/v2/models/{model}/generate_stream", body=b'{"INPUT0": 1}')
        answer = conn.getresponse()
        answer.readline()
        took = time.perf_counter() - started
        answer.read()
        if i >= 50:
            times.append(took)
    return times

def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))] * 1e6

out = {}
for name, fn in [
    ("grpc direct", lambda: first_response_times("127.0.0.1:19101", "count", 1000)),
    ("grpc through gateway (passthrough)", lambda: first_response_times("127.0.0.1:19201", "count", 1000)),
    ("generate_stream direct (model server REST)", lambda: sse_first_event_times(19100, "count", 1000)),
    ("generate_stream through gateway, translated to gRPC", lambda: sse_first_event_times(19200, "count", 1000)),
    ("generate_stream through gateway, relayed from REST", lambda: sse_first_event_times(19200, "count_rest", 1000)),
]:
    t = fn()
    out[name] = (pct(t, 0.5), pct(t, 0.99))

def per_message(address_or_port, model, n, sse=False):
    g0, s0 = cpu(gateway.pid), cpu(server.pid)
    started = time.perf_counter()
    if sse:
        conn = http.client.HTTPConnection("127.0.0.1", address_or_port)
        conn.request("POST", f"/v2/models/{model}/generate_stream", body=json.dumps({"INPUT0": n}).encode())
        body = conn.getresponse().read()
        if body.count(b"data: ") != n:
            print("SHORT STREAM", body.count(b"data: "), "of", n, body[-200:])
    else:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(address_or_port))
        got = sum(1 for _ in stub.ModelStreamInfer(iter([request(model, n)])))
        assert got == n, got
    wall = time.perf_counter() - started
    return (cpu(gateway.pid) - g0) / n * 1e6, (cpu(server.pid) - s0) / n * 1e6, wall

N = 200000
cpu_rows = {
    "grpc passthrough": per_message("127.0.0.1:19201", "count", N),
    "generate_stream translated to gRPC": per_message(19200, "count", N, sse=True),
    "generate_stream relayed from REST": per_message(19200, "count_rest", N, sse=True),
    "grpc direct (no gateway)": per_message("127.0.0.1:19101", "count", N),
}
for k, (p50, p99) in out.items():
    print(f"| {k} | {p50:.0f} | {p99:.0f} |")
for k, (g, s, wall) in cpu_rows.items():
    print(f"| {k} | {g:.2f} | {s:.2f} | {N / wall:.0f} |")
gateway.kill(); server.kill()

#!/usr/bin/env python3
"""What every load scenario shares: the built binaries, free ports, servers started and measured (CPU, RSS), the
backend and gateway configurations, request bodies, and wrk and h2load driven and read. scripts/bench.py (the main
scenarios and the report) and each scenario script import it; it imports none of them.
"""

import argparse
import json
import os
import platform
import random
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The production build (scripts/build-dist: the `dist` profile, profile-guided), which scripts/bench makes.
BINARY = ROOT / "target" / "dist" / "oipgate"
OUT = ROOT / "target" / "bench"
TICKS = os.sysconf("SC_CLK_TCK")


_HANDED_OUT = set()


def free_port():
    """A port no server listens on and not handed out before in this process, taken below the kernel's range for
    outgoing connections (32768 up by default): a port the kernel picks for a listener is one its next outgoing
    connection may take as its own before the server binds it, which happened between two runs here ("Address
    already in use"); and the ports of a run are all picked before its servers bind them, so two picks must differ."""
    for _ in range(1000):
        port = random.randrange(20000, 32768)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise SystemExit("bench: no free port in 20000-32767")


def wait_port(port, timeout=10.0):
    until = time.time() + timeout
    while time.time() < until:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def descendants(pid):
    """`pid` and every process below it (nginx's workers)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(entry.name))
            except (OSError, IndexError):
                pass
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def cpu_seconds(pid, kernel_only=False):
    """CPU seconds `pid` and its descendants have used: user and kernel time, or the kernel's alone."""
    total = 0
    for p in descendants(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[12]) if kernel_only else int(fields[11]) + int(fields[12])
        except (OSError, IndexError):
            pass
    return total / TICKS


def status_kib(pid, key):
    total = 0
    for p in descendants(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def reset_peak(pid):
    for p in descendants(pid):
        try:
            Path(f"/proc/{p}/clear_refs").write_text("5")
        except OSError:
            pass


class Server:
    def __init__(self, name, command, ports, env=None):
        self.name = name
        self.log = OUT / f"{name}.log"
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=self.log.open("wb"), env=env, start_new_session=True
        )
        for port in ports:
            if not wait_port(port):
                raise SystemExit(f"bench: {name} does not listen on {port}: {self.log.read_text()[-2000:]}")

    @property
    def pid(self):
        return self.process.pid

    def stop(self):
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)


def model_server(name, ports):
    """oipgate's model server, the backend of every scenario, on ports["backend_rest"] and ports["backend_grpc"]."""
    return Server(
        name,
        [str(BINARY), "model-server", "--rest", f"127.0.0.1:{ports['backend_rest']}", "--grpc",
         f"127.0.0.1:{ports['backend_grpc']}"],
        [ports["backend_rest"], ports["backend_grpc"]],
    )


def gateway_config(path, rest, grpc, ports, extra=""):
    """Writes a gateway configuration before the model server at `ports` (GATEWAY_CONF, then `extra`) to `path`,
    its doors on the ports `rest` and `grpc`; returns `path`."""
    path.write_text(GATEWAY_CONF.format(rest=rest, grpc=grpc, backend_rest=ports["backend_rest"],
                                        backend_grpc=ports["backend_grpc"]) + extra)
    return path


def gateway_env(workers, access_log=False):
    """The environment a measured gateway runs in: `workers` door threads; warnings only in its log, or with
    `access_log` the default (`info`: a line a request), as users run it."""
    env = dict(os.environ, RUST_LOG="warn", OIPGATE__RUNTIME__THREADS=str(workers))
    if access_log:
        env.pop("RUST_LOG")
    return env


def convert(body, source, target, header_length=None):
    command = [str(BINARY), "convert", "--from", source, "--to", target]
    if header_length is not None:
        command += ["--header-length", str(header_length)]
    done = subprocess.run(command, input=body, capture_output=True, check=True)
    length = None
    match = re.search(rb"Inference-Header-Content-Length: (\d+)", done.stderr)
    if match:
        length = int(match.group(1))
    return done.stdout, length


def grpc_frame(message):
    return b"\0" + struct.pack(">I", len(message)) + message


def write(path, data):
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------------------------------------- requests


def add_sub_json(version):
    values = list(range(16))
    tensor = lambda name: {"name": name, "datatype": "INT32", "shape": [1, 16], "data": values}
    body = {"inputs": [tensor("INPUT0"), tensor("INPUT1")]}
    return json.dumps(body).encode(), version


def fp32_json(elements, binary_answer=False):
    # Values as a client's JSON writer prints them: 9-10 significant characters each.
    import random

    rng = random.Random(7)
    values = ",".join(repr(round(rng.uniform(-100, 100), 5)) for _ in range(elements))
    parameters = ',"parameters":{"binary_data_output":true}' if binary_answer else ""
    return (
        '{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,%d],"data":[%s]}]%s}'
        % (elements, values, parameters)
    ).encode()


def fp32_binary(elements):
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "datatype": "FP32",
                    "shape": [1, elements],
                    "parameters": {"binary_data_size": elements * 4},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    return header + os.urandom(elements * 4), len(header)


# ---------------------------------------------------------------------------------------------- primitives

RECEIVER = """
import socket, sys
size, repeats = int(sys.argv[1]), int(sys.argv[2])
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
connection, _ = server.accept()
buffer = memoryview(bytearray(size))
for _ in range(repeats):
    got = 0
    while got < size:
        got += connection.recv_into(buffer[got:], size - got)
    connection.sendall(b"k")
"""


def primitives(size, repeats=7):
    """What the targets of scenarios 4 and 5 are measured against, on this machine in this run: the median time of
    one memcpy of `size` bytes into an existing buffer, and of sending `size` bytes to another process over a
    loopback TCP connection until it has read them all (the kernel's copies in and out, and the wake-ups)."""
    source = os.urandom(size)
    target = memoryview(bytearray(size))
    copies = []
    for _ in range(repeats):
        started = time.perf_counter()
        target[:] = source
        copies.append(time.perf_counter() - started)
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(size), str(repeats)], stdout=subprocess.PIPE,
                                text=True)
    port = int(receiver.stdout.readline())
    transfers = []
    with socket.create_connection(("127.0.0.1", port)) as sender:
        for _ in range(repeats):
            started = time.perf_counter()
            sender.sendall(source)
            sender.recv(1)
            transfers.append(time.perf_counter() - started)
    receiver.wait(timeout=30)
    return {
        "bytes": size,
        "memcpy_ms": statistics.median(copies) * 1e3,
        "loopback_ms": statistics.median(transfers) * 1e3,
    }


PARSE_BENCH = "json_fp32_1M_parse/oipgate whole request, 1 thread"


def codec_parse_ms():
    """The codec bench's time to parse the 1M-value FP32 JSON request on one thread (criterion's mean)."""
    group, name = PARSE_BENCH.split("/")
    estimate = ROOT / "target" / "criterion" / group / name / "new" / "estimates.json"
    try:
        return json.loads(estimate.read_text())["mean"]["point_estimate"] / 1e6
    except (OSError, KeyError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------- load


def wrk(url, body_file, headers, seconds, connections, threads):
    script = OUT / "post.lua"
    header_lines = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items())
    script.write_text(
        f"""wrk.method = "POST"
local f = io.open("{body_file}", "rb")
wrk.body = f:read("*all")
f:close()
{header_lines}
"""
    )
    done = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--timeout", "60s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
    )
    text = done.stdout
    requests = int(re.search(r"(\d+) requests in", text).group(1))
    errors = 0
    for pattern in (r"Non-2xx or 3xx responses: (\d+)", r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)"):
        match = re.search(pattern, text)
        if match:
            errors += sum(int(g) for g in match.groups())
    percentiles = {}
    for label, key in (("50%", "p50"), ("90%", "p90"), ("99%", "p99")):
        match = re.search(rf"^\s+{re.escape(label)}\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
        if match:
            scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[match.group(2)]
            percentiles[key] = float(match.group(1)) * scale
    return {"requests": requests, "errors": errors, **percentiles}


GRPC_HEADERS = ("content-type: application/grpc", "te: trailers")


def h2load(url, body_file, seconds, connections, streams, rate=None, headers=GRPC_HEADERS, http1=False):
    """h2load's load: as fast as it goes, or `rate` requests a second in all (spread over the connections); gRPC
    calls by default, HTTP/1.1 requests with `http1`."""
    log = OUT / "h2load.log"
    # h2load appends to its log.
    log.unlink(missing_ok=True)
    command = ["h2load", "-D", str(seconds), "-c", str(connections), "-m", str(streams), "-t", "1", "-d",
               str(body_file), "--log-file", str(log)]
    for header in headers:
        command += ["-H", header]
    if rate:
        command += ["--rps", str(rate // connections)]
    if http1:
        command.append("--h1")
    done = subprocess.run(command + [url], capture_output=True, text=True)
    text = done.stdout
    match = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored", text)
    if not match:
        raise SystemExit(f"bench: h2load said:\n{text}\n{done.stderr}")
    requests, succeeded = int(match.group(1)), int(match.group(2))
    durations = []
    for line in log.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and parts[1] == "200":
            durations.append(int(parts[2]) / 1000.0)
    durations.sort()
    pick = lambda q: durations[min(len(durations) - 1, int(q * len(durations)))] if durations else float("nan")
    return {"requests": requests, "errors": requests - succeeded, "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


# ---------------------------------------------------------------------------------------------- setups


NGINX_CONF = """
{user}
worker_processes {workers};
error_log stderr warn;
pid {prefix}/nginx.pid;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_max_body_size 0;
    client_body_buffer_size 128m;
    proxy_buffering off;
    proxy_request_buffering off;
    grpc_buffer_size 1m;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    upstream rest_backend {{ server 127.0.0.1:{rest}; keepalive 256; }}
    upstream grpc_backend {{ server 127.0.0.1:{grpc}; keepalive 256; }}
    server {{
        listen 127.0.0.1:{nginx_rest};
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://rest_backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
    server {{
        listen 127.0.0.1:{nginx_grpc} http2;
        keepalive_requests 1000000;
        location / {{ grpc_pass grpc://grpc_backend; }}
    }}
    # The same two as users run them: each request logged, through nginx's buffer.
    server {{
        listen 127.0.0.1:{nginx_rest_logged};
        keepalive_requests 1000000;
        access_log {prefix}/access.log combined buffer=64k flush=1s;
        location / {{
            proxy_pass http://rest_backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
    server {{
        listen 127.0.0.1:{nginx_grpc_logged} http2;
        keepalive_requests 1000000;
        access_log {prefix}/access.log combined buffer=64k flush=1s;
        location / {{ grpc_pass grpc://grpc_backend; }}
    }}
}}
"""


HAPROXY_CONF = """
global
    nbthread {workers}
    maxconn 8000
defaults
    mode http
    timeout connect 5s
    timeout client 120s
    timeout server 120s
    http-reuse always
    option http-keep-alive
frontend rest
    bind 127.0.0.1:{haproxy_rest}
    default_backend rest
backend rest
    server backend 127.0.0.1:{rest}
frontend grpc
    bind 127.0.0.1:{haproxy_grpc} proto h2
    default_backend grpc
backend grpc
    server backend 127.0.0.1:{grpc} proto h2
# The same two as users run them: each request logged (`option httplog`) into a ring in memory, HAProxy's cheapest
# log target (no system call a line; a reader would drain it with `show events`).
ring requests
    format rfc5424
    maxlen 1024
    size 4194304
frontend rest_logged
    bind 127.0.0.1:{haproxy_rest_logged}
    log ring@requests local0
    option httplog
    default_backend rest
frontend grpc_logged
    bind 127.0.0.1:{haproxy_grpc_logged} proto h2
    log ring@requests local0
    option httplog
    default_backend grpc
"""


def floor_binaries():
    """The smallest hyper and pingora proxies (benches/floor_*.rs), built with the bench profile; their paths."""
    return bench_binaries(("floor_hyper", "floor_pingora"))


# The rates the access log's cost is measured at (scenarios 1r and 2r): about a fifth of what the gateway serves at
# full load on 2 cores, so neither gateway is short of CPU.
FIXED_RATE = {"1": 10000, "2": 8000}


def scenario_main(doc, run, name, report, targets=None, rounds=2, extra=()):
    """The command line of a scenario's own script (scripts/bench_*.py): parses --seconds, --rounds, --connections,
    --workers and the `extra` arguments ((flag, help) pairs, given to `run` as keywords), runs the scenario, writes
    target/bench/NAME.json, and prints its report and, when it has them, its targets judged."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    for flag, help_text in extra:
        parser.add_argument(flag, help=help_text)
    args = vars(parser.parse_args())
    OUT.mkdir(parents=True, exist_ok=True)
    common = [args.pop(key) for key in ("seconds", "rounds", "connections", "workers")]
    results = run(*common, **args)
    (OUT / f"{name}.json").write_text(json.dumps(results, indent=2))
    lines = report(results)
    if targets:
        lines += ["", "| scenario | round | measured | target | verdict |", "|---|---|---|---|---|"] + targets(results)
    print("\n".join(lines))


def bench_binaries(names):
    """The programs of benches/ named `names`, built with the bench profile; their paths by name."""
    command = ["cargo", "bench", "--locked", "--no-run", "--message-format=json"]
    for name in names:
        command += ["--bench", name]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"bench: {', '.join(names)} did not build")
    found = {}
    for line in done.stdout.splitlines():
        try:
            message = json.loads(line)
        except ValueError:
            continue
        name = message.get("target", {}).get("name")
        if message.get("executable") and name in names:
            found[name] = message["executable"]
    return found


GATEWAY_CONF = """
[listen]
rest = "127.0.0.1:{rest}"
grpc = "127.0.0.1:{grpc}"
[limits]
max_request_bytes = 268435456
request_timeout_ms = 120000
[reload]
watch = false
[[backends]]
name = "rest"
protocol = "rest"
binary_data = true
endpoints = ["127.0.0.1:{backend_rest}"]
[[backends]]
name = "grpc"
protocol = "grpc"
endpoints = ["127.0.0.1:{backend_grpc}"]
[[models]]
name = "add_sub"
versions = [ {{ version = "1", backend = "rest" }}, {{ version = "2", backend = "grpc" }} ]
default_version = "1"
[[models]]
name = "identity"
versions = [ {{ version = "1", backend = "grpc" }}, {{ version = "2", backend = "rest", upstream_version = "1" }} ]
default_version = "1"
"""


# Scenario 1's second oipgate: the same configuration with [auth] on, one API key (sha256 of "bench-key") with a
# rate limit that is never reached, so the figure is what checking a key and taking a token costs.
AUTH_CONF = """
[auth]
[[auth.api_keys]]
name = "bench"
sha256 = "b0962662e937d44c699c8305d90cbf190b3150c59b13863d1380b5cc3c711bb7"
models = ["*"]
rate = { per_second = 1000000.0, burst = 1000000 }
"""


def start_all(work, workers, binary=BINARY):
    ports = {k: free_port() for k in ("backend_rest", "backend_grpc", "rest", "grpc", "rest_auth", "grpc_auth",
                                      "rest_logged", "grpc_logged",
                                      "nginx_rest", "nginx_grpc", "nginx_rest_logged", "nginx_grpc_logged",
                                      "haproxy_rest", "haproxy_grpc", "haproxy_rest_logged", "haproxy_grpc_logged",
                                      "floor_hyper", "floor_pingora", "floor_hyper_h2")}
    backend = model_server("model-server", ports)
    config = gateway_config(work / "gateway.toml", ports["rest"], ports["grpc"], ports)
    env = gateway_env(workers)
    gateway = Server("oipgate", [str(binary), "serve", "--config", str(config)], [ports["rest"], ports["grpc"]], env)
    auth_config = gateway_config(work / "gateway-auth.toml", ports["rest_auth"], ports["grpc_auth"], ports, AUTH_CONF)
    gateway_auth = Server("oipgate_auth", [str(binary), "serve", "--config", str(auth_config)],
                          [ports["rest_auth"], ports["grpc_auth"]], env)
    # Its defaults, access log on; the lines go to stderr, a file here (Server's log), as a container runtime's.
    logged_config = gateway_config(work / "gateway-logged.toml", ports["rest_logged"], ports["grpc_logged"], ports)
    gateway_logged = Server("oipgate_logged", [str(binary), "serve", "--config", str(logged_config)],
                            [ports["rest_logged"], ports["grpc_logged"]], gateway_env(workers, access_log=True))
    prefix = work / "nginx"
    (prefix / "logs").mkdir(parents=True, exist_ok=True)
    nginx_conf = prefix / "nginx.conf"
    nginx_conf.write_text(
        NGINX_CONF.format(
            user="user root;" if os.geteuid() == 0 else "",
            workers=workers,
            prefix=prefix,
            rest=ports["backend_rest"],
            grpc=ports["backend_grpc"],
            nginx_rest=ports["nginx_rest"],
            nginx_grpc=ports["nginx_grpc"],
            nginx_rest_logged=ports["nginx_rest_logged"],
            nginx_grpc_logged=ports["nginx_grpc_logged"],
        )
    )
    nginx_binary = "nginx" if subprocess.run(["which", "nginx"], capture_output=True).returncode == 0 else "/usr/sbin/nginx"
    nginx = Server(
        "nginx",
        [nginx_binary, "-p", str(prefix), "-c", str(nginx_conf), "-g", "daemon off;"],
        [ports["nginx_rest"], ports["nginx_grpc"]],
    )
    haproxy_conf = work / "haproxy.cfg"
    haproxy_conf.write_text(
        HAPROXY_CONF.format(
            workers=workers, rest=ports["backend_rest"], grpc=ports["backend_grpc"],
            haproxy_rest=ports["haproxy_rest"], haproxy_grpc=ports["haproxy_grpc"],
            haproxy_rest_logged=ports["haproxy_rest_logged"], haproxy_grpc_logged=ports["haproxy_grpc_logged"],
        )
    )
    haproxy_binary = "haproxy" if subprocess.run(["which", "haproxy"], capture_output=True).returncode == 0 else "/usr/sbin/haproxy"
    haproxy = Server("haproxy", [haproxy_binary, "-db", "-f", str(haproxy_conf)],
                     [ports["haproxy_rest"], ports["haproxy_grpc"]])
    floors = {}
    binaries = floor_binaries()
    for name, binary in binaries.items():
        floors[name] = Server(
            name,
            [binary, "--listen", f"127.0.0.1:{ports[name]}", "--upstream", f"127.0.0.1:{ports['backend_rest']}",
             "--threads", str(workers)],
            [ports[name]],
        )
    # The same smallest hyper proxy on HTTP/2, in front of the gRPC backend: the gRPC door's floor.
    floors["floor_hyper_h2"] = Server(
        "floor_hyper_h2",
        [binaries["floor_hyper"], "--listen", f"127.0.0.1:{ports['floor_hyper_h2']}", "--upstream",
         f"127.0.0.1:{ports['backend_grpc']}", "--threads", str(workers), "--http2"],
        [ports["floor_hyper_h2"]],
    )
    return ports, backend, gateway, gateway_auth, gateway_logged, nginx, haproxy, floors


def run_one(label, load, processes):
    before = {name: (cpu_seconds(p.pid), cpu_seconds(p.pid, True)) for name, p in processes.items()}
    started = time.time()
    result = load()
    elapsed = time.time() - started
    after = {name: (cpu_seconds(p.pid), cpu_seconds(p.pid, True)) for name, p in processes.items()}
    result["seconds"] = elapsed
    result["rps"] = result["requests"] / elapsed if elapsed else 0.0
    result["cpu_per_1k"] = {
        name: (after[name][0] - before[name][0]) * 1000.0 / max(result["requests"], 1) for name in processes
    }
    # The kernel's share of it (system calls, the loopback's TCP), apart from the process's own work.
    result["kernel_per_1k"] = {
        name: (after[name][1] - before[name][1]) * 1000.0 / max(result["requests"], 1) for name in processes
    }
    result["setup"] = label
    return result


def scenario_runs(scenario, setups, rounds, processes, gateway):
    runs = []
    for _ in range(rounds):
        for label, load, involved in setups:
            reset_peak(gateway.pid)
            result = run_one(label, load, {name: processes[name] for name in involved})
            result["gateway_peak_rss_mib"] = status_kib(gateway.pid, "VmHWM") / 1024 if "oipgate" in involved else None
            print(
                f"  {scenario}: {label:<32} {result['rps']:>9.1f} req/s  p50 {result.get('p50', float('nan')):8.3f} ms"
                f"  p99 {result.get('p99', float('nan')):8.3f} ms  errors {result['errors']}",
                flush=True,
            )
            runs.append(result)
    return runs


def idle_connections(port, count):
    sockets = []
    request = f"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(request)
        s.recv(4096)
        sockets.append(s)
    return sockets


def encode_name(message, name, version):
    """Replaces fields 1 and 2 (model_name, model_version) of an encoded ModelInferRequest."""
    out, i = bytearray(), 0

    def varint(n):
        b = bytearray()
        while True:
            byte = n & 0x7F
            n >>= 7
            b.append(byte | (0x80 if n else 0))
            if not n:
                return bytes(b)

    def read_varint(pos):
        shift = value = 0
        while True:
            byte = message[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value, pos

    for field, text in ((1, name), (2, version)):
        data = text.encode()
        out += varint(field << 3 | 2) + varint(len(data)) + data
    while i < len(message):
        key, j = read_varint(i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, end = read_varint(j)
        elif wire == 2:
            length, k = read_varint(j)
            end = k + length
        elif wire == 1:
            end = j + 8
        elif wire == 5:
            end = j + 4
        else:
            raise SystemExit("bench: unexpected wire type")
        if field not in (1, 2):
            out += message[i:end]
        i = end
    return bytes(out)


def idle_rss(ports, gateway, nginx):
    time.sleep(0.5)
    idle = {"oipgate": status_kib(gateway.pid, "VmRSS"), "nginx": status_kib(nginx.pid, "VmRSS")}
    count = 1000
    held = {}
    for name, port in (("oipgate", ports["rest"]), ("nginx", ports["nginx_rest"])):
        held[name] = idle_connections(port, count)
    # The steady state of an idle connection: oipgate hands one out of hyper after 200 ms idle and returns the memory
    # freed to the kernel within a second; nginx's is steady at once.
    time.sleep(3)
    loaded = {"oipgate": status_kib(gateway.pid, "VmRSS"), "nginx": status_kib(nginx.pid, "VmRSS")}
    for sockets in held.values():
        for s in sockets:
            s.close()
    result = {
        name: {
            "idle_rss_mib": idle[name] / 1024,
            "rss_with_1000_idle_mib": loaded[name] / 1024,
            "per_connection_kib": (loaded[name] - idle[name]) / count,
        }
        for name in idle
    }
    for name, r in result.items():
        print(f"  6: {name:<8} idle {r['idle_rss_mib']:.1f} MiB, with 1,000 idle connections "
              f"{r['rss_with_1000_idle_mib']:.1f} MiB ({r['per_connection_kib']:.1f} KiB each)", flush=True)
    return result


def machine():
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    version = lambda cmd: subprocess.run(cmd, capture_output=True, text=True).stdout.strip() or subprocess.run(
        cmd, capture_output=True, text=True).stderr.strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "oipgate": version([str(BINARY), "--version"]),
        "nginx": version(["nginx", "-v"]).splitlines()[0] if version(["nginx", "-v"]) else "",
        "wrk": version(["wrk", "-v"]).splitlines()[0],
        "h2load": version(["h2load", "--version"]).splitlines()[0],
        "date": time.strftime("%Y-%m-%d"),
    }

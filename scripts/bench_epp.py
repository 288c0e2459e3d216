#!/usr/bin/env python3
"""Scenario 10 of the load harness: the endpoint picker (`oipgate epp`) behind Envoy (docs/BENCHMARKS.md,
"Endpoint picker (oipgate epp) behind Envoy").

Two model servers (`oipgate model-server`, replicas a and b) and four setups in front of them, all started at once
and alternated run by run (each round starting from the next setup, so drift hits all alike):

- direct: the client to replica a, no proxy; the baseline "added" latency is measured against;
- envoy: Envoy alone, a STATIC round-robin cluster over both replicas (REST over HTTP/1.1, gRPC over h2c), no
  ext_proc; the listener, HTTP/2 windows, buffer limits and circuit breakers as the picker's configuration has them;
- envoy + epp: config/envoy-epp.yaml (its ext_proc processing mode as is: the request body in
  FULL_DUPLEX_STREAMED, the answer's headers and trailers, not its body; ORIGINAL_DST clusters, failure_mode_allow
  false) less its two test-only filters (the Lua subset hint and `x-test-subset-pb`), which a gateway does not run,
  in front of `oipgate epp` balancing round robin (its default) over both replicas;
- oipgate serve: the gateway alone over both replicas (REST backend and gRPC backend).

Workloads: the small add_sub request (INT32 [1,16] x 2) over REST (wrk, 1 thread x 1 connection, then 2 threads x
CONNECTIONS) and over gRPC (h2load, 1 x 1, then 4 connections x CONNECTIONS/4 streams; add_sub version 2, which the
gateways serve from the gRPC backend), and a 220 KB JSON body (identity, FP32 [1, 24000]; its answer is as large)
over REST at 150 connections (wrk, 2 threads). Per run: requests/s, p50/p99, the p50 added over direct, and CPU
microseconds a request of every process (/proc/PID/stat, the process and its children) and of the load generator
(this script's children). Each run is checked against the replicas' own statistics: every answer counted as a
success must be an inference the replicas served (a gRPC error comes back as HTTP 200 with grpc-status, which h2load
cannot tell).

The machine has 2 cores shared by the load generator, Envoy, the picker and the model servers: throughput at
CONNECTIONS is bounded by total CPU, so the 1-connection rows are the added latency of an unloaded request, and CPU
a request the fair comparison. Nothing is pinned.

Run by scripts/bench (`--only 10`), or alone with the binary already built (target/dist/oipgate, else
target/release/oipgate; `--binary` another) and Envoy installed (scripts/interop's first run; `--envoy` another):
    python3 scripts/bench_epp.py --seconds 5 --rounds 2
Writes target/bench/epp.json and target/bench/epp.md.
"""

import glob
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import bench_harness as harness

TEMPLATE = harness.ROOT / "config" / "envoy-epp.yaml"
GRPC_PATH = "/inference.GRPCInferenceService/ModelInfer"
LARGE_ELEMENTS = 24_000  # FP32 values as a JSON writer prints them: about 220 KB
LARGE_CONNECTIONS = 150

SETUPS = ("direct", "envoy", "envoy + epp", "oipgate serve")

# Envoy alone: the picker's listener (config/envoy-epp.yaml) without its filters but the router, and
# its ORIGINAL_DST clusters' settings on STATIC round-robin clusters over the same replicas.
ENVOY_ALONE = """
admin:
  address:
    socket_address: { address: 127.0.0.1, port_value: {admin} }
static_resources:
  listeners:
  - name: gateway
    address:
      socket_address: { address: 127.0.0.1, port_value: {listen} }
    per_connection_buffer_limit_bytes: 1048576
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          codec_type: AUTO
          stream_idle_timeout: 3600s
          request_timeout: 0s
          http_protocol_options: { enable_trailers: true }
          http2_protocol_options:
            max_concurrent_streams: 1000
            initial_stream_window_size: 1048576
            initial_connection_window_size: 16777216
          route_config:
            name: local
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match:
                  prefix: "/"
                  headers:
                  - { name: content-type, string_match: { prefix: application/grpc } }
                route: { cluster: pool_grpc, timeout: 0s, idle_timeout: 3600s }
              - match: { prefix: "/" }
                route: { cluster: pool_rest, timeout: 0s, idle_timeout: 3600s }
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
              suppress_envoy_headers: true
  clusters:
  - name: pool_rest
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 5s
    per_connection_buffer_limit_bytes: 1048576
    circuit_breakers:
      thresholds:
      - { max_connections: 100000, max_pending_requests: 100000, max_requests: 100000, max_retries: 1024 }
    load_assignment:
      cluster_name: pool_rest
      endpoints:
      - lb_endpoints: {pool_rest}
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http_protocol_options: { enable_trailers: true }
  - name: pool_grpc
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 5s
    per_connection_buffer_limit_bytes: 1048576
    circuit_breakers:
      thresholds:
      - { max_connections: 100000, max_pending_requests: 100000, max_requests: 100000, max_retries: 1024 }
    load_assignment:
      cluster_name: pool_grpc
      endpoints:
      - lb_endpoints: {pool_grpc}
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options:
            initial_stream_window_size: 1048576
            initial_connection_window_size: 16777216
"""

# The pool as both oipgates see it: add_sub version 1 over REST, version 2 over gRPC (the model server serves both
# versions, so neither is renamed), identity over REST. Round robin, the default.
POOL_CONF = """
[limits]
max_request_bytes = 268435456
request_timeout_ms = 120000
[reload]
watch = false
[[backends]]
name = "pool-rest"
protocol = "rest"
binary_data = true
endpoints = [{rest}]
[[backends]]
name = "pool-grpc"
protocol = "grpc"
endpoints = [{grpc}]
[[models]]
name = "add_sub"
versions = [ {{ version = "1", backend = "pool-rest" }}, {{ version = "2", backend = "pool-grpc" }} ]
default_version = "1"
[[models]]
name = "identity"
versions = [ {{ version = "1", backend = "pool-rest" }} ]
"""


def find_envoy(given=None):
    if given:
        return given
    if os.environ.get("INTEROP_ENVOY"):
        return os.environ["INTEROP_ENVOY"]
    found = sorted(glob.glob(str(harness.ROOT / "target/interop/envoy/lib/python3*/site-packages/envoy/_bin/envoy")))
    return found[0] if found else None


def find_binary(given=None):
    """`given`, else the production build when it has `oipgate epp`, else the release build."""
    has_epp = lambda path: path.exists() and subprocess.run([str(path), "epp", "--help"],
                                                            capture_output=True).returncode == 0
    if given:
        if not has_epp(Path(given)):
            raise SystemExit(f"bench_epp: {given} has no `oipgate epp` (an older build?)")
        return Path(given)
    for candidate in (harness.BINARY, harness.ROOT / "target" / "release" / "oipgate"):
        if has_epp(candidate):
            return candidate
    raise SystemExit("bench_epp: no build with `oipgate epp` (scripts/build-dist, or --binary)")


def lb_endpoints(addresses):
    return "[" + ", ".join(
        "{ endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: %d } } } }" % port
        for port in addresses) + "]"


def picker_envoy_config(listen, epp, admin, rest_ports, grpc_ports):
    """The interop suite's template, failure_mode_allow false, less its two test-only filters."""
    text = TEMPLATE.read_text()
    start = text.index("          # 1) Test-only subset hint")
    end = text.index("          # 2) The endpoint picker.")
    text = text[:start] + text[end:]
    for key, value in {"LISTEN_PORT": str(listen), "EPP_PORT": str(epp), "ADMIN_PORT": str(admin),
                       "FAILURE_MODE_ALLOW": "false", "POOL_REST": lb_endpoints(rest_ports),
                       "POOL_GRPC": lb_endpoints(grpc_ports)}.items():
        text = text.replace("{{" + key + "}}", value)
    assert "{{" not in text and "envoy.filters.http.lua" not in text and "x-test-subset" not in text
    return text


def processing_mode(config):
    """The ext_proc processing mode a rendered configuration runs, `name: value` pairs (comments left out): the
    filter's own, not the generate route's override ahead of it."""
    block = config[config.rindex("processing_mode:"):config.index("message_timeout:")]
    pairs = re.finditer(r"^[ \t]*(\w+_mode):[ \t]*(\w+)", block, re.M)
    return ", ".join(f"{m.group(1)}: {m.group(2)}" for m in pairs)


def alone_envoy_config(listen, admin, rest_ports, grpc_ports):
    text = ENVOY_ALONE
    for key, value in {"listen": str(listen), "admin": str(admin), "pool_rest": lb_endpoints(rest_ports),
                       "pool_grpc": lb_endpoints(grpc_ports)}.items():
        text = text.replace("{" + key + "}", value)
    return text


def http(method, url, body=None, headers=None, timeout=30):
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def picker_healthy(admin):
    try:
        _, text = http("GET", f"http://127.0.0.1:{admin}/clusters", timeout=2)
    except OSError:
        return False
    return any(line.startswith("epp::") and line.endswith("health_flags::healthy")
               for line in text.decode().splitlines())


def served(replicas, model):
    """Inferences the replicas answered for `model` (all versions), from their own statistics."""
    total = 0
    for rest in replicas:
        _, body = http("GET", f"http://127.0.0.1:{rest}/v2/models/{model}/stats")
        total += sum(stats["inference_count"] for stats in json.loads(body)["model_stats"])
    return total


def workloads(connections, files):
    """(key, label, model, protocol, connections, what runs it: a function of the setup's REST and gRPC ports)."""
    small, grpc_small, large = files
    json_headers = {"Content-Type": "application/json"}
    rest = lambda path, body, c, t, seconds: lambda ports: harness.wrk(
        f"http://127.0.0.1:{ports[0]}{path}", body, json_headers, seconds, c, t)
    grpc = lambda c, m, seconds: lambda ports: harness.h2load(
        f"http://127.0.0.1:{ports[1]}{GRPC_PATH}", grpc_small, seconds, c, m)
    streams = max(1, connections // 4)
    return [
        ("rest-1", "add_sub REST, 1 connection", "add_sub", 1,
         lambda s: rest("/v2/models/add_sub/versions/1/infer", small, 1, 1, s)),
        ("rest", f"add_sub REST, {connections} connections", "add_sub", connections,
         lambda s: rest("/v2/models/add_sub/versions/1/infer", small, connections, 2, s)),
        ("grpc-1", "add_sub gRPC, 1 x 1 stream", "add_sub", 1, lambda s: grpc(1, 1, s)),
        ("grpc", f"add_sub gRPC, 4 x {streams} streams", "add_sub", 4 * streams, lambda s: grpc(4, streams, s)),
        ("large", f"220 KB JSON REST, {LARGE_CONNECTIONS} connections", "identity", LARGE_CONNECTIONS,
         lambda s: rest("/v2/models/identity/versions/1/infer", large, LARGE_CONNECTIONS, 2, s)),
    ]


def measured(label, load, processes):
    """harness.run_one, with CPU in microseconds a request and the load generator's own CPU (this script's children)."""
    before = os.times()
    run = harness.run_one(label, load, processes)
    after = os.times()
    client = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    run["cpu_us"] = {name: v * 1000.0 for name, v in run.pop("cpu_per_1k").items()}
    run["cpu_us"]["client"] = client * 1e6 / max(run["requests"], 1)
    return run


def preflight(setups, replicas, files, large_bytes):
    """One call of each kind through each setup, its answer checked, before anything is measured."""
    small, grpc_small, large = files
    for name, (rest, grpc) in setups.items():
        status, body = http("POST", f"http://127.0.0.1:{rest}/v2/models/add_sub/versions/1/infer",
                            small.read_bytes(), {"Content-Type": "application/json"})
        outputs = {o["name"]: o["data"] for o in json.loads(body).get("outputs", [])} if status == 200 else {}
        if status != 200 or outputs.get("OUTPUT0") != [2 * v for v in range(16)]:
            raise SystemExit(f"bench_epp: {name}: add_sub over REST answered {status}: {body[:300]!r}")
        status, body = http("POST", f"http://127.0.0.1:{rest}/v2/models/identity/versions/1/infer",
                            large.read_bytes(), {"Content-Type": "application/json"})
        if status != 200 or len(body) < large_bytes * 0.9:
            raise SystemExit(f"bench_epp: {name}: the 220 KB call answered {status}, {len(body)} bytes: {body[:300]!r}")
        before = served(replicas, "add_sub")
        done = subprocess.run(["h2load", "-n", "8", "-c", "1", "-d", str(grpc_small), "-H",
                               "content-type: application/grpc", "-H", "te: trailers",
                               f"http://127.0.0.1:{grpc}{GRPC_PATH}"], capture_output=True, text=True)
        got = served(replicas, "add_sub") - before
        if "8 succeeded" not in done.stdout or got != 8:
            raise SystemExit(f"bench_epp: {name}: 8 gRPC calls, {got} served:\n{done.stdout[-1500:]}")


def epp_costs(seconds, rounds, connections, workers, binary=None, envoy=None):
    envoy = find_envoy(envoy)
    binary = find_binary(binary)
    print(f"bench_epp: measuring {binary}", flush=True)
    if not envoy or not Path(envoy).exists():
        raise SystemExit("bench_epp: no Envoy: run `scripts/interop --envoy` (scripts/bench does), or pass --envoy")
    harness.OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="oipgate-epp-"))
    version = lambda cmd: (subprocess.run(cmd, capture_output=True, text=True).stdout.strip().splitlines() or [""])[-1]
    results = {"machine": machine(binary), "oipgate": version([str(binary), "--version"]),
               "envoy": (re.search(r"/(\d+\.\d+\.\d+)/", version([envoy, "--version"])) or [None, "?"])[1],
               "args": {"seconds": seconds, "rounds": rounds, "connections": connections, "workers": workers,
                        "binary": str(binary), "envoy": envoy}, "runs": []}
    results["machine"]["oipgate"] = results["oipgate"]
    servers = {}
    env = harness.gateway_env(workers)
    try:
        replicas = []
        for name in ("a", "b"):
            rest, grpc = harness.free_port(), harness.free_port()
            servers[f"model-server {name}"] = harness.Server(
                f"epp-model-server-{name}",
                [str(binary), "model-server", "--rest", f"127.0.0.1:{rest}", "--grpc", f"127.0.0.1:{grpc}",
                 "--name", f"replica-{name}"], [rest, grpc])
            replicas.append((rest, grpc))
        rest_ports, grpc_ports = [r for r, _ in replicas], [g for _, g in replicas]
        pool = POOL_CONF.format(rest=", ".join(f'"127.0.0.1:{p}"' for p in rest_ports),
                                grpc=", ".join(f'"127.0.0.1:{p}"' for p in grpc_ports))
        # oipgate serve
        serve_rest, serve_grpc = harness.free_port(), harness.free_port()
        serve_conf = work / "serve.toml"
        serve_conf.write_text(f'[listen]\nrest = "127.0.0.1:{serve_rest}"\ngrpc = "127.0.0.1:{serve_grpc}"\n' + pool)
        servers["oipgate serve"] = harness.Server(
            "epp-oipgate-serve", [str(binary), "serve", "--config", str(serve_conf)], [serve_rest, serve_grpc], env)
        # the picker
        epp_port = harness.free_port()
        epp_conf = work / "epp.toml"
        epp_conf.write_text(f'[listen]\nepp = "127.0.0.1:{epp_port}"\n' + pool)
        servers["epp"] = harness.Server("epp-oipgate-epp", [str(binary), "epp", "--config", str(epp_conf)], [epp_port],
                                      env)
        # the two Envoys
        alone_listen, alone_admin = harness.free_port(), harness.free_port()
        alone_conf = work / "envoy-alone.yaml"
        alone_conf.write_text(alone_envoy_config(alone_listen, alone_admin, rest_ports, grpc_ports))
        servers["envoy"] = harness.Server(
            "epp-envoy-alone", [envoy, "-c", str(alone_conf), "--base-id", str(harness.free_port()), "-l", "warning"],
            [alone_listen, alone_admin])
        picker_listen, picker_admin = harness.free_port(), harness.free_port()
        picker_conf = work / "envoy-epp.yaml"
        picker_conf.write_text(picker_envoy_config(picker_listen, epp_port, picker_admin, rest_ports, grpc_ports))
        results["processing_mode"] = processing_mode(picker_conf.read_text())
        print(f"bench_epp: envoy + epp processing mode: {results['processing_mode']}", flush=True)
        servers["envoy (epp)"] = harness.Server(
            "epp-envoy-picker", [envoy, "-c", str(picker_conf), "--base-id", str(harness.free_port()), "-l", "warning"],
            [picker_listen, picker_admin])
        until = time.time() + 60
        while not picker_healthy(picker_admin):
            if time.time() > until:
                raise SystemExit("bench_epp: Envoy never found the picker healthy")
            time.sleep(0.1)

        small_body, _ = harness.add_sub_json("1")
        small = harness.write(harness.OUT / "epp_add_sub.json", small_body)
        grpc_body, _ = harness.add_sub_json("2")
        message = convert(binary, grpc_body)
        grpc_small = harness.write(harness.OUT / "epp_add_sub.grpc",
                                 harness.grpc_frame(harness.encode_name(message, "add_sub", "2")))
        large_body = harness.fp32_json(LARGE_ELEMENTS)
        large = harness.write(harness.OUT / "epp_220k.json", large_body)
        results["large_bytes"] = len(large_body)
        files = (small, grpc_small, large)

        ports = {"direct": replicas[0], "envoy": (alone_listen, alone_listen),
                 "envoy + epp": (picker_listen, picker_listen), "oipgate serve": (serve_rest, serve_grpc)}
        involved = {
            "direct": ["model-server a"],
            "envoy": ["envoy", "model-server a", "model-server b"],
            "envoy + epp": ["envoy (epp)", "epp", "model-server a", "model-server b"],
            "oipgate serve": ["oipgate serve", "model-server a", "model-server b"],
        }
        preflight(ports, rest_ports, files, len(large_body))
        time.sleep(1.0)
        order = list(SETUPS)
        for round_index in range(rounds):
            start = round_index % len(order)
            turn = order[start:] + order[:start]
            for key, label, model, concurrency, make in workloads(connections, files):
                for setup in turn:
                    before = served(rest_ports, model)
                    run = measured(setup, lambda: make(seconds)(ports[setup]),
                                   {name: servers[name] for name in involved[setup]})
                    got = served(rest_ports, model) - before
                    ok = run["requests"] - run["errors"]
                    run.update(workload=key, label=label, round=round_index + 1, served=got,
                               # Every success counted is an inference served; at most the calls in flight when the
                               # load generator stopped are served and not counted.
                               verified=ok <= got <= run["requests"] + concurrency + 8)
                    results["runs"].append(run)
                    proxy = {k: v for k, v in run["cpu_us"].items() if not k.startswith("model-server")}
                    print(f"  10 {key:<6} {setup:<14} {run['rps']:>9.1f} req/s  p50 {run.get('p50', float('nan')):7.3f}"
                          f"  p99 {run.get('p99', float('nan')):7.3f} ms  errors {run['errors']}"
                          f"{'' if run['verified'] else f' UNVERIFIED (served {got} of {ok})'}  CPU us "
                          + ", ".join(f"{k} {v:.1f}" for k, v in proxy.items()), flush=True)
                    time.sleep(0.3)
    finally:
        for server in reversed(list(servers.values())):
            server.stop()
    (harness.OUT / "epp.json").write_text(json.dumps(results, indent=2))
    (harness.OUT / "epp.md").write_text("\n".join(["# Endpoint picker (oipgate epp) behind Envoy", ""] + report(results)
                                                + ["", "| scenario | round | measured | target | verdict |",
                                                   "|---|---|---|---|---|"] + targets(results)) + "\n")
    print(f"bench_epp: wrote {harness.OUT / 'epp.md'} and {harness.OUT / 'epp.json'}", flush=True)
    return results


def machine(binary):
    """harness.machine(), which asks the production build and nginx their versions, for a run that may have neither."""
    saved = harness.BINARY
    harness.BINARY = binary
    try:
        return harness.machine()
    except OSError:
        version = lambda cmd: (subprocess.run(cmd, capture_output=True, text=True).stdout.strip()
                               or "?").splitlines()[0]
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "unknown")
        return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "wrk": version(["wrk", "-v"]),
                "h2load": version(["h2load", "--version"]), "date": time.strftime("%Y-%m-%d")}
    finally:
        harness.BINARY = saved


def convert(binary, body):
    """harness.convert, with the binary measured (harness.convert runs the production build's)."""
    done = subprocess.run([str(binary), "convert", "--from", "json", "--to", "protobuf"], input=body,
                          capture_output=True, check=True)
    return done.stdout


def runs_of(results, workload, setup):
    return [r for r in results["runs"] if r["workload"] == workload and r["setup"] == setup]


def median(runs, pick):
    values = [pick(r) for r in runs]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def report(results):
    if "skipped" in results:
        return [f"Skipped: {results['skipped']}.", ""]
    m, a = results["machine"], results["args"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, Linux {m['kernel']}; {results['oipgate']} ({a['binary']}); "
        f"Envoy {results['envoy']}; {m['wrk']}, {m['h2load']}; {m['date']}. "
        f"{a['rounds']} round(s) of {a['seconds']} s; "
        f"oipgate threads {a['workers']}, Envoy's default concurrency (one worker a core); nothing pinned. "
        f"Large body: {results['large_bytes']:,} bytes. "
        + (f"envoy + epp's ext_proc processing mode: {results['processing_mode']}. " if "processing_mode" in results
           else "")
        + "Medians over rounds; CPU in microseconds a request of each "
        "process (model servers: both replicas together; client: wrk or h2load).",
        "",
        "| workload | setup | req/s | p50 ms | p99 ms | p50 added vs direct | errors | envoy | epp | oipgate serve "
        "| model servers | client | verified |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    labels = {}
    for r in results["runs"]:
        labels.setdefault(r["workload"], r["label"])
    for workload, label in labels.items():
        direct = median(runs_of(results, workload, "direct"), lambda r: r.get("p50"))
        for setup in SETUPS:
            runs = runs_of(results, workload, setup)
            if not runs:
                continue
            cpu = lambda *names: median(runs, lambda r: sum(r["cpu_us"].get(n, 0.0) for n in names)
                                        if any(n in r["cpu_us"] for n in names) else None)
            cell = lambda v: "-" if v != v else f"{v:.1f}"
            p50 = median(runs, lambda r: r.get("p50"))
            added = "-" if setup == "direct" else f"{p50 - direct:+.3f}"
            lines.append(
                f"| {label} | {setup} | {median(runs, lambda r: r['rps']):,.0f} | {p50:.3f} | "
                f"{median(runs, lambda r: r.get('p99')):.3f} | {added} | {sum(r['errors'] for r in runs)} | "
                f"{cell(cpu('envoy', 'envoy (epp)'))} | {cell(cpu('epp'))} | {cell(cpu('oipgate serve'))} | "
                f"{cell(cpu('model-server a', 'model-server b'))} | {cell(cpu('client'))} | "
                f"{'yes' if all(r['verified'] for r in runs) else 'NO'} |")
    lines.append("")
    return lines


def targets(results):
    """The issue's three targets, judged round by round: the picker's own addition is Envoy + epp against Envoy
    alone in the same round (and, beside it, against direct); its CPU a request against Envoy's own in the same run."""
    if "skipped" in results:
        return []
    verdict = lambda met: "met" if met else "missed"
    lines = []
    rounds = sorted({r["round"] for r in results["runs"]})
    for workload, limit in (("rest-1", 0.3), ("grpc-1", 0.3), ("rest", 0.3), ("grpc", 0.3), ("large", 2.0)):
        for index in rounds:
            pick = lambda setup: next((r for r in runs_of(results, workload, setup) if r["round"] == index), None)
            direct, alone, picker = pick("direct"), pick("envoy"), pick("envoy + epp")
            if not (direct and alone and picker):
                continue
            added = picker["p50"] - alone["p50"]
            met = added <= limit and picker["errors"] == 0 and picker["verified"]
            lines.append(f"| 10 {workload} p50 | {index} | epp adds {added:+.3f} ms over Envoy alone "
                         f"({picker['p50'] - direct['p50']:+.3f} vs direct, "
                         f"Envoy alone {alone['p50'] - direct['p50']:+.3f}) | <= {limit} ms | {verdict(met)} |")
    for workload in ("rest-1", "rest", "grpc-1", "grpc", "large"):
        for index in rounds:
            picker = next((r for r in runs_of(results, workload, "envoy + epp") if r["round"] == index), None)
            if not picker:
                continue
            ours, theirs = picker["cpu_us"]["epp"], picker["cpu_us"]["envoy (epp)"]
            lines.append(f"| 10 {workload} CPU | {index} | epp {ours:.1f} us vs Envoy {theirs:.1f} us a request "
                         f"({ours / theirs:.2f}x) | <= Envoy's own | {verdict(ours <= theirs)} |")
    return lines


def main():
    # This scenario's small-request concurrency is 16 unless --connections says otherwise.
    sys.argv[1:1] = ["--connections", "16"]
    harness.scenario_main(__doc__, epp_costs, "epp", report, targets=targets,
                        extra=(("--binary", "the oipgate measured (default target/dist/oipgate, else the release "
                                            "build)"),
                               ("--envoy", "Envoy's binary (default scripts/interop's, or $INTEROP_ENVOY)")))


if __name__ == "__main__":
    main()

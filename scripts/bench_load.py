"""Scenario 8 of the load harness: what `least_load` costs (docs/BENCHMARKS.md, "Scenario 8: load-aware routing").

8a, the scrapes: a gateway with one backend of 100 endpoints (127.0.0.1 to 127.0.0.100, all the one model server,
which listens on every loopback address) and `load = { preset = "triton", interval_ms = 100 }`, idle for SECONDS,
against the same gateway without `load`: the CPU the scrapes take, per endpoint and second and per scrape.
8b, the balancing: scenario 1's small add_sub request (wrk, 2 threads x 32 connections) through a backend of two
endpoints (127.0.0.1 and 127.0.0.2) balanced `least_load`, against `round_robin`, alternated round by round.

Run by scripts/bench (`--only 8`), or alone once the production binary is built (`scripts/build-dist`):
    python3 scripts/bench_load.py --seconds 8 --rounds 3
"""

import os
import statistics
import tempfile
import time
from pathlib import Path

import bench_harness as harness

ENDPOINTS = 100
INTERVAL_MS = 100


def gateway_config(rest, grpc, backend_port, endpoints, lb, load):
    listed = ", ".join(f'"127.0.0.{i + 1}:{backend_port}"' for i in range(endpoints))
    lines = [
        "[listen]", f'rest = "127.0.0.1:{rest}"', f'grpc = "127.0.0.1:{grpc}"',
        "[reload]", "watch = false",
        "[[backends]]", 'name = "replicas"', 'protocol = "rest"', f"endpoints = [{listed}]", f'lb = "{lb}"',
    ]
    if load:
        lines.append(f'load = {{ preset = "triton", interval_ms = {INTERVAL_MS} }}')
    lines += ["[[models]]", 'name = "add_sub"', 'versions = [ { version = "1", backend = "replicas" } ]']
    return "\n".join(lines) + "\n"


def start_gateway(work, name, backend_port, endpoints, lb, load, env):
    ports = {k: harness.free_port() for k in ("rest", "grpc")}
    path = work / f"{name}.toml"
    path.write_text(gateway_config(ports["rest"], ports["grpc"], backend_port, endpoints, lb, load))
    server = harness.Server(name, [str(harness.BINARY), "serve", "--config", str(path)], [ports["rest"]], env)
    return server, ports


def load_costs(seconds, rounds, connections, workers):
    work = Path(tempfile.mkdtemp(prefix="oipgate-load-"))
    port = harness.free_port()
    backend = harness.Server("model-server-load", [str(harness.BINARY), "model-server", "--rest", f"0.0.0.0:{port}"],
                           [port])
    env = harness.gateway_env(workers)
    results = {"idle": [], "load": []}
    servers = []
    try:
        scraping, _ = start_gateway(work, "scraping", port, ENDPOINTS, "least_load", True, env)
        quiet, _ = start_gateway(work, "quiet", port, ENDPOINTS, "round_robin", False, env)
        servers += [scraping, quiet]
        time.sleep(1.0)
        for _ in range(rounds):
            for name, server in (("with load", scraping), ("without load", quiet)):
                before = harness.cpu_seconds(server.pid)
                time.sleep(seconds)
                cpu = harness.cpu_seconds(server.pid) - before
                results["idle"].append({"setup": name, "cpu_seconds": cpu, "seconds": seconds})
                print(f"  8a: {name:<13} idle {seconds} s: {cpu:.3f} CPU s", flush=True)
        least, least_ports = start_gateway(work, "least-load", port, 2, "least_load", True, env)
        rotating, rotating_ports = start_gateway(work, "round-robin", port, 2, "round_robin", False, env)
        servers += [least, rotating]
        body, _ = harness.add_sub_json("1")
        body_file = harness.write(harness.OUT / "add_sub_load.json", body)
        headers = {"Content-Type": "application/json"}
        threads = min(2, os.cpu_count() or 1)
        for _ in range(rounds):
            for name, server, ports in (("least_load", least, least_ports), ("round_robin", rotating, rotating_ports)):
                url = f"http://127.0.0.1:{ports['rest']}/v2/models/add_sub/infer"
                run = harness.run_one(name, lambda: harness.wrk(url, body_file, headers, seconds, connections, threads),
                                    {"oipgate": server, "model-server": backend})
                print(f"  8b: {name:<12} {run['rps']:>9.1f} req/s, oipgate CPU {run['cpu_per_1k']['oipgate']:.4f} s/1k, "
                      f"errors {run['errors']}", flush=True)
                results["load"].append(run)
    finally:
        for server in servers:
            server.stop()
        backend.stop()
    return results


def report(results):
    idle = results["idle"]
    with_load = statistics.median(r["cpu_seconds"] / r["seconds"] for r in idle if r["setup"] == "with load")
    without = statistics.median(r["cpu_seconds"] / r["seconds"] for r in idle if r["setup"] == "without load")
    per_endpoint_us = (with_load - without) / ENDPOINTS * 1e6
    per_scrape_us = per_endpoint_us / (1000 / INTERVAL_MS)
    lines = [
        f"8a: {ENDPOINTS} endpoints scraped every {INTERVAL_MS} ms: {with_load * 1000:.1f} ms of CPU a second against "
        f"{without * 1000:.1f} without `load`: {per_endpoint_us:.0f} us per endpoint per second, "
        f"{per_scrape_us:.0f} us per scrape.",
        "",
        "| 8b | req/s (median) | oipgate CPU s / 1k req (median) | errors |",
        "|---|---|---|---|",
    ]
    for name in ("least_load", "round_robin"):
        runs = [r for r in results["load"] if r["setup"] == name]
        if runs:
            lines.append(f"| {name} | {statistics.median(r['rps'] for r in runs):.0f} | "
                         f"{statistics.median(r['cpu_per_1k']['oipgate'] for r in runs):.4f} | "
                         f"{sum(r['errors'] for r in runs)} |")
    lines.append("")
    return lines


def main():
    harness.scenario_main(__doc__, load_costs, "load", report)


if __name__ == "__main__":
    main()

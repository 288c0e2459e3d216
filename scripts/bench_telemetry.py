"""Scenario 9 of the load harness: what traces and payload logging cost (docs/BENCHMARKS.md,
"Scenario 9: traces and payload log").

Four gateways on the same backends, alike but for one section: none (tracing off), `[tracing]` at sample_ratio 0.01,
`[tracing]` at 1.0, and `[payload_log]` at sample_ratio 1.0. The spans go to a real OTLP collector and the events to
a CloudEvents sink (benches/telemetry_sinks.rs, both decoding what they get). Each runs scenario 1's small add_sub
request proxied to the REST backend (9a) and scenario 3a's, translated from REST JSON to the gRPC backend (9b), wrk
2 threads x 32 connections, the four alternated, each round starting from the next.

`--baseline BINARY` adds a fifth gateway: another build of oipgate (one from before `[tracing]` existed) with the
same configuration as "off", to show what tracing off costs against not having it at all.

Run by scripts/bench (`--only 9`), or alone once the production binary is built (`scripts/build-dist`):
    python3 scripts/bench_telemetry.py --seconds 8 --rounds 3 [--baseline /path/to/older/oipgate]
"""

import os
import statistics
import tempfile
import time
from pathlib import Path

import bench_harness as harness

VARIANTS = (
    ("off", ""),
    ("tracing 0.01", '[tracing]\notlp_endpoint = "http://127.0.0.1:{otlp}"\nsample_ratio = 0.01\n'),
    ("tracing 1.0", '[tracing]\notlp_endpoint = "http://127.0.0.1:{otlp}"\nsample_ratio = 1.0\n'),
    ("payload log 1.0", '[payload_log]\nurl = "http://127.0.0.1:{events}/"\nsample_ratio = 1.0\n'),
)
PATHS = (
    ("9a", "REST passthrough (scenario 1)", "/v2/models/add_sub/versions/1/infer"),
    ("9b", "REST JSON -> gRPC (scenario 3a)", "/v2/models/add_sub/versions/2/infer"),
)


def telemetry_costs(seconds, rounds, connections, workers, baseline=None):
    work = Path(tempfile.mkdtemp(prefix="oipgate-telemetry-"))
    ports = {k: harness.free_port() for k in ("backend_rest", "backend_grpc", "otlp", "events")}
    backend = harness.model_server("model-server-telemetry", ports)
    sinks_binary = harness.bench_binaries(("telemetry_sinks",))["telemetry_sinks"]
    sinks = harness.Server(
        "telemetry-sinks",
        [sinks_binary, "--otlp", f"127.0.0.1:{ports['otlp']}", "--events", f"127.0.0.1:{ports['events']}"],
        [ports["otlp"], ports["events"]],
    )
    env = harness.gateway_env(workers)
    gateways = []
    results = {"runs": []}
    variants = [(name, section, harness.BINARY) for name, section in VARIANTS]
    if baseline:
        variants.insert(0, ("baseline binary", "", Path(baseline)))
    try:
        for name, section, binary in variants:
            rest, grpc = harness.free_port(), harness.free_port()
            path = harness.gateway_config(work / f"{name.replace(' ', '-')}.toml", rest, grpc, ports,
                                        section.format(otlp=ports["otlp"], events=ports["events"]))
            server = harness.Server(f"oipgate-{name}", [str(binary), "serve", "--config", str(path)], [rest], env)
            gateways.append((name, server, rest))
        time.sleep(1.0)
        body, _ = harness.add_sub_json("1")
        body_file = harness.write(harness.OUT / "add_sub_telemetry.json", body)
        headers = {"Content-Type": "application/json"}
        threads = min(2, os.cpu_count() or 1)
        for round_index in range(rounds):
            # Each round starts from the next gateway, so no setup always runs right after the same other one.
            start = round_index % len(gateways)
            order = gateways[start:] + gateways[:start]
            for key, _, target in PATHS:
                for name, server, rest in order:
                    url = f"http://127.0.0.1:{rest}{target}"
                    run = harness.run_one(name, lambda: harness.wrk(url, body_file, headers, seconds, connections, threads),
                                        {"oipgate": server, "model-server": backend, "sinks": sinks})
                    run["path"] = key
                    results["runs"].append(run)
                    print(f"  {key}: {name:<16} {run['rps']:>9.1f} req/s, oipgate CPU "
                          f"{run['cpu_per_1k']['oipgate']:.4f} s/1k, p99 {run.get('p99', 0):.2f} ms, "
                          f"errors {run['errors']}", flush=True)
    finally:
        for _, server, _ in gateways:
            server.stop()
        sinks.stop()
        backend.stop()
    return results


def report(results):
    lines = [
        "| path | setup | req/s (median) | x off | oipgate CPU s / 1k req (median) | x off | p99 ms (median) | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, title, _ in PATHS:
        runs = [r for r in results["runs"] if r["path"] == key]
        median = lambda name, f: statistics.median(f(r) for r in runs if r["setup"] == name)
        if not runs:
            continue
        off_rps = median("off", lambda r: r["rps"])
        off_cpu = median("off", lambda r: r["cpu_per_1k"]["oipgate"])
        for name in dict.fromkeys(r["setup"] for r in runs):
            rps = median(name, lambda r: r["rps"])
            cpu = median(name, lambda r: r["cpu_per_1k"]["oipgate"])
            p99 = median(name, lambda r: r.get("p99", 0.0))
            errors = sum(r["errors"] for r in runs if r["setup"] == name)
            lines.append(f"| {key} {title} | {name} | {rps:.0f} | {rps / off_rps:.3f} | {cpu:.4f} | "
                         f"{cpu / off_cpu:.3f} | {p99:.2f} | {errors} |")
    lines.append("")
    return lines


def targets(results):
    """Tracing at 0.01 within 3% of off, in CPU per request and req/s, round by round; off against the baseline
    binary when there is one."""
    lines = []
    runs = results["runs"]
    for key, title, _ in PATHS:
        paired = [r for r in runs if r["path"] == key]
        by_round = {}
        for run in paired:
            by_round.setdefault(run["setup"], []).append(run)
        for name, limit in (("tracing 0.01", 0.03), ("baseline binary", 0.03)):
            for index, (off, other) in enumerate(zip(by_round.get("off", []), by_round.get(name, [])), 1):
                cpu_off, cpu_other = off["cpu_per_1k"]["oipgate"], other["cpu_per_1k"]["oipgate"]
                if name == "baseline binary":
                    rise, what = cpu_off / cpu_other - 1.0, "off against the baseline binary"
                    rps = off["rps"] / other["rps"]
                else:
                    rise, what = cpu_other / cpu_off - 1.0, "tracing 0.01 against off"
                    rps = other["rps"] / off["rps"]
                met = rise <= limit and rps >= 1.0 - limit
                lines.append(f"| 9 {key} | {index} | {what}: CPU {rise:+.1%}, req/s {rps:.3f}x | CPU within "
                             f"{limit:.0%}, req/s >= {1.0 - limit:.2f}x | {'met' if met else 'missed'} |")
    return lines


def main():
    harness.scenario_main(__doc__, telemetry_costs, "telemetry", report, targets, rounds=3,
                        extra=[("--baseline", "an older oipgate binary run with the same configuration as off")])


if __name__ == "__main__":
    main()

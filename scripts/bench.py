#!/usr/bin/env python3
"""The end-to-end load harness (run through scripts/bench, which installs the tools and builds the binary).

Starts oipgate's model server as the backend, oipgate in front of it, and as reference rows nginx and HAProxy
configured as the equivalent reverse proxies (HTTP/1.1 keep-alive upstream for REST, grpc_pass / `proto h2` for
gRPC) and the smallest hyper (HTTP/1.1 and HTTP/2) and pingora proxies (benches/floor_*.rs). Drives each scenario
with wrk (HTTP/1.1) or h2load (gRPC unary over HTTP/2; scenario 2 at 4x8 and, as 2b, 16x8 connections x streams)
at a fixed concurrency and duration, alternating the setups
(A B C A B C) so drift hits all alike, and reports requests per second, p50/p90/p99 latency, CPU seconds per 1,000
requests of each process, and the gateway's peak RSS. Scenarios 1r and 2r run oipgate with its access log off and on
at one fixed rate (h2load --rps), so the log's own cost shows apart from how the load batches. Scenario 7 (scripts/bench_scale.py) runs gateways of 1, 1,000
and 10,000 models instead, scenario 8 (scripts/bench_load.py) what `least_load` costs, scenario 9
(scripts/bench_telemetry.py) what traces and payload logging cost, scenario 10 (scripts/bench_epp.py) the endpoint
picker behind Envoy, scenario 11 (scripts/bench_shared_limits.py) rate limits shared through Redis against
per-replica ones. Writes target/bench/results.json and target/bench/report.md.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_harness import (
    BINARY,
    FIXED_RATE,
    OUT,
    PARSE_BENCH,
    ROOT,
    add_sub_json,
    codec_parse_ms,
    convert,
    encode_name,
    fp32_binary,
    fp32_json,
    grpc_frame,
    h2load,
    idle_rss,
    machine,
    primitives,
    scenario_runs,
    start_all,
    write,
    wrk,
)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=10, help="duration of each run")
    parser.add_argument("--rounds", type=int, default=2, help="how many times each setup runs (A B C A B C)")
    parser.add_argument("--connections", type=int, default=32, help="concurrency of the small-request scenarios")
    parser.add_argument("--only", default="1,2,3,4,5,6,7,8,9,10,11", help="scenarios to run, e.g. 1,2,6")
    parser.add_argument("--workers", type=int, default=os.cpu_count(),
                        help="worker threads of oipgate's doors and nginx's worker processes (default: cores)")
    parser.add_argument("--binary", default=str(BINARY),
                        help="the oipgate measured (default the production build; target/release/oipgate for the "
                             "release build)")
    args = parser.parse_args()
    only = {int(s) for s in args.only.split(",")}
    OUT.mkdir(parents=True, exist_ok=True)
    if 3 in only:
        # Scenario 3's target is set against the codec's parse time on this machine: measured first, alone.
        print("bench: codec parse time (cargo bench --bench codec)", flush=True)
        done = subprocess.run(["cargo", "bench", "--locked", "--bench", "codec", "--", PARSE_BENCH], cwd=ROOT,
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stdout + done.stderr)
            raise SystemExit("bench: the codec bench failed")
    results = {"machine": machine(), "args": vars(args), "scenarios": {}}
    if 7 in only:
        # Scenario 7 runs its own gateways (1, 1,000 and 10,000 models), alone, before the others start.
        import bench_scale

        results["scenarios"]["7"] = bench_scale.scale(args.seconds, args.rounds, args.connections, args.workers)
    if 8 in only:
        # Scenario 8 too: gateways with and without `load` (scripts/bench_load.py).
        import bench_load

        results["scenarios"]["8"] = bench_load.load_costs(args.seconds, args.rounds, args.connections, args.workers)
    if 9 in only:
        # Scenario 9 too: gateways with and without [tracing] and [payload_log] (scripts/bench_telemetry.py).
        import bench_telemetry

        results["scenarios"]["9"] = bench_telemetry.telemetry_costs(args.seconds, args.rounds, args.connections,
                                                                    args.workers)
    if 10 in only:
        # Scenario 10 too: Envoy alone, Envoy with `oipgate epp`, oipgate serve (scripts/bench_epp.py).
        import bench_epp

        results["scenarios"]["10"] = bench_epp.epp_costs(args.seconds, args.rounds, 16, args.workers,
                                                         binary=args.binary)
    if 11 in only:
        # Scenario 11 too: scenario 1 with [auth], its limits per replica and shared through Redis
        # (scripts/bench_shared_limits.py).
        import bench_shared_limits

        results["scenarios"]["11"] = bench_shared_limits.shared_limit_costs(
            args.seconds, args.rounds, args.connections, args.workers, binary=args.binary)
    if only <= {7, 8, 9, 10, 11}:
        return finish(results)
    work = Path(tempfile.mkdtemp(prefix="oipgate-bench-"))
    ports, backend, gateway, gateway_auth, gateway_logged, nginx, haproxy, floors = start_all(
        work, args.workers, args.binary)
    processes = {"model-server": backend, "oipgate": gateway, "oipgate_auth": gateway_auth,
                 "oipgate_logged": gateway_logged, "nginx": nginx, "haproxy": haproxy, **floors}
    seconds, c = args.seconds, args.connections
    threads = min(2, os.cpu_count() or 1)
    try:
        if 6 in only:
            results["scenarios"]["6"] = idle_rss(ports, gateway, nginx)
        if 1 in only:
            body, _ = add_sub_json("1")
            f = write(OUT / "add_sub.json", body)
            h = {"Content-Type": "application/json"}
            url = lambda port: f"http://127.0.0.1:{port}/v2/models/add_sub/versions/1/infer"
            results["scenarios"]["1"] = scenario_runs("1", [
                ("direct", lambda: wrk(url(ports["backend_rest"]), f, h, seconds, c, threads), ["model-server"]),
                ("nginx", lambda: wrk(url(ports["nginx_rest"]), f, h, seconds, c, threads), ["model-server", "nginx"]),
                ("haproxy", lambda: wrk(url(ports["haproxy_rest"]), f, h, seconds, c, threads), ["model-server", "haproxy"]),
                ("floor: smallest hyper proxy", lambda: wrk(url(ports["floor_hyper"]), f, h, seconds, c, threads),
                 ["model-server", "floor_hyper"]),
                ("floor: smallest pingora proxy", lambda: wrk(url(ports["floor_pingora"]), f, h, seconds, c, threads),
                 ["model-server", "floor_pingora"]),
                ("oipgate", lambda: wrk(url(ports["rest"]), f, h, seconds, c, threads), ["model-server", "oipgate"]),
                ("auth: oipgate with [auth]", lambda: wrk(url(ports["rest_auth"]), f, dict(h, Authorization="Bearer bench-key"),
                                                          seconds, c, threads), ["model-server", "oipgate_auth"]),
                ("logs on: nginx", lambda: wrk(url(ports["nginx_rest_logged"]), f, h, seconds, c, threads),
                 ["model-server", "nginx"]),
                ("logs on: haproxy", lambda: wrk(url(ports["haproxy_rest_logged"]), f, h, seconds, c, threads),
                 ["model-server", "haproxy"]),
                ("logs on: oipgate", lambda: wrk(url(ports["rest_logged"]), f, h, seconds, c, threads),
                 ["model-server", "oipgate_logged"]),
            ], args.rounds, processes, gateway)
            # The access log's cost at one rate for both: at full load a slower gateway serves fewer requests a
            # wake-up, and its kernel time a request rises with that, whatever the log itself costs.
            json_header = ("content-type: application/json",)
            fixed = lambda port: h2load(url(port), f, seconds, c, 1, FIXED_RATE["1"], json_header, http1=True)
            results["scenarios"]["1r"] = scenario_runs(f"1r {FIXED_RATE['1']} req/s", [
                (f"oipgate, {FIXED_RATE['1']} req/s", lambda: fixed(ports["rest"]), ["model-server", "oipgate"]),
                (f"logs on: oipgate, {FIXED_RATE['1']} req/s", lambda: fixed(ports["rest_logged"]),
                 ["model-server", "oipgate_logged"]),
            ], args.rounds, processes, gateway)
        grpc_path = "/inference.GRPCInferenceService/ModelInfer"
        if 2 in only or 3 in only:
            body, _ = add_sub_json("2")
            message, _ = convert(body, "json", "protobuf")
            # The model and version go in the message: add_sub version 2 (a gRPC backend at the gateway).
            message = encode_name(message, "add_sub", "2")
            g = write(OUT / "add_sub.grpc", grpc_frame(message))
            f = write(OUT / "add_sub.json", body)
        if 2 in only:
            gurl = lambda port: f"http://127.0.0.1:{port}{grpc_path}"
            # 4 connections x 8 streams, and 16 x 8 (many clients, each multiplexing).
            for key, conns in (("2", 4), ("2b", 16)):
                streams = 8
                results["scenarios"][key] = scenario_runs(f"{key} {conns}x{streams}", [
                    ("direct", lambda: h2load(gurl(ports["backend_grpc"]), g, seconds, conns, streams), ["model-server"]),
                    ("nginx grpc_pass", lambda: h2load(gurl(ports["nginx_grpc"]), g, seconds, conns, streams),
                     ["model-server", "nginx"]),
                    ("haproxy", lambda: h2load(gurl(ports["haproxy_grpc"]), g, seconds, conns, streams),
                     ["model-server", "haproxy"]),
                    ("floor: smallest hyper HTTP/2 proxy", lambda: h2load(gurl(ports["floor_hyper_h2"]), g, seconds, conns, streams),
                     ["model-server", "floor_hyper_h2"]),
                    ("oipgate", lambda: h2load(gurl(ports["grpc"]), g, seconds, conns, streams), ["model-server", "oipgate"]),
                    ("logs on: nginx grpc_pass", lambda: h2load(gurl(ports["nginx_grpc_logged"]), g, seconds, conns, streams),
                     ["model-server", "nginx"]),
                    ("logs on: haproxy", lambda: h2load(gurl(ports["haproxy_grpc_logged"]), g, seconds, conns, streams),
                     ["model-server", "haproxy"]),
                    ("logs on: oipgate", lambda: h2load(gurl(ports["grpc_logged"]), g, seconds, conns, streams),
                     ["model-server", "oipgate_logged"]),
                ], args.rounds, processes, gateway)
            fixed = lambda port: h2load(gurl(port), g, seconds, 16, 1, FIXED_RATE["2"])
            results["scenarios"]["2r"] = scenario_runs(f"2r {FIXED_RATE['2']} calls/s", [
                (f"oipgate, {FIXED_RATE['2']} calls/s", lambda: fixed(ports["grpc"]), ["model-server", "oipgate"]),
                (f"logs on: oipgate, {FIXED_RATE['2']} calls/s", lambda: fixed(ports["grpc_logged"]),
                 ["model-server", "oipgate_logged"]),
            ], args.rounds, processes, gateway)
        if 3 in only:
            h = {"Content-Type": "application/json"}
            results["scenarios"]["3a"] = scenario_runs("3 small", [
                ("direct gRPC (pre-encoded)", lambda: h2load(f"http://127.0.0.1:{ports['backend_grpc']}{grpc_path}", g, seconds, 4, c // 4), ["model-server"]),
                ("oipgate REST JSON -> gRPC", lambda: wrk(f"http://127.0.0.1:{ports['rest']}/v2/models/add_sub/versions/2/infer", f, h, seconds, c, threads), ["model-server", "oipgate"]),
            ], args.rounds, processes, gateway)
            big = fp32_json(1 << 20)
            fb = write(OUT / "fp32_1m.json", big)
            message, _ = convert(big, "json", "protobuf")
            gb = write(OUT / "fp32_1m.grpc", grpc_frame(encode_name(message, "identity", "1")))
            results["scenarios"]["3b"] = scenario_runs("3 1M FP32", [
                ("direct gRPC (pre-encoded)", lambda: h2load(f"http://127.0.0.1:{ports['backend_grpc']}{grpc_path}", gb, seconds, 1, 1), ["model-server"]),
                ("oipgate REST JSON -> gRPC", lambda: wrk(f"http://127.0.0.1:{ports['rest']}/v2/models/identity/versions/1/infer", fb, h, seconds, 1, 1), ["model-server", "oipgate"]),
            ], args.rounds, processes, gateway)
            results["scenarios"]["3b"].append({"setup": "JSON body", "bytes": len(big)})
            # The same request asking for its answer in the binary extension: the gateway parses the JSON and
            # forwards, with no 1M-value JSON answer to write (which scenario 3b's figure includes).
            big_binary = fp32_json(1 << 20, binary_answer=True)
            fbb = write(OUT / "fp32_1m_binary_answer.json", big_binary)
            results["scenarios"]["3c"] = scenario_runs("3 1M FP32, binary answer", [
                ("direct gRPC (pre-encoded)", lambda: h2load(f"http://127.0.0.1:{ports['backend_grpc']}{grpc_path}", gb, seconds, 1, 1), ["model-server"]),
                ("oipgate REST JSON -> gRPC, binary answer", lambda: wrk(f"http://127.0.0.1:{ports['rest']}/v2/models/identity/versions/1/infer", fbb, h, seconds, 1, 1), ["model-server", "oipgate"]),
            ], args.rounds, processes, gateway)
            results["json_parse_ms"] = codec_parse_ms()
        if 4 in only or 5 in only:
            elements = 16 << 20  # 64 MiB of FP32
            results["primitives"] = primitives(elements * 4)
            body, header_length = fp32_binary(elements)
            fbin = write(OUT / "fp32_64m.bin", body)
            message, _ = convert(body, "binary", "protobuf", header_length)
            g64 = write(OUT / "fp32_64m_identity1.grpc", grpc_frame(encode_name(message, "identity", "1")))
            g64_rest = write(OUT / "fp32_64m_identity2.grpc", grpc_frame(encode_name(message, "identity", "2")))
            hb = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(header_length)}
        if 4 in only:
            results["scenarios"]["4"] = scenario_runs("4 64 MiB", [
                ("direct gRPC (pre-encoded)", lambda: h2load(f"http://127.0.0.1:{ports['backend_grpc']}{grpc_path}", g64, seconds, 1, 1), ["model-server"]),
                ("oipgate REST binary -> gRPC", lambda: wrk(f"http://127.0.0.1:{ports['rest']}/v2/models/identity/versions/1/infer", fbin, hb, seconds, 1, 1), ["model-server", "oipgate"]),
            ], args.rounds, processes, gateway)
        if 5 in only:
            results["scenarios"]["5"] = scenario_runs("5 64 MiB", [
                ("direct REST binary", lambda: wrk(f"http://127.0.0.1:{ports['backend_rest']}/v2/models/identity/versions/1/infer", fbin, hb, seconds, 1, 1), ["model-server"]),
                ("oipgate gRPC -> REST binary", lambda: h2load(f"http://127.0.0.1:{ports['grpc']}{grpc_path}", g64_rest, seconds, 1, 1), ["model-server", "oipgate"]),
            ], args.rounds, processes, gateway)
    finally:
        for server in (gateway, gateway_auth, gateway_logged, nginx, haproxy, *floors.values(), backend):
            server.stop()
    return finish(results)


def finish(results):
    (OUT / "results.json").write_text(json.dumps(results, indent=2))
    (OUT / "report.md").write_text(report(results))
    print(f"bench: wrote {OUT / 'report.md'} and {OUT / 'results.json'}")


def report(results):
    lines = ["# End-to-end load run", ""]
    m = results["machine"]
    lines += [f"Machine: {m['cpu']}, {m['cores']} cores, Linux {m['kernel']}; {m['oipgate']}, {m['nginx']}, "
              f"{m['wrk']}, {m['h2load']}; {m['date']}. Settings: {results['args']}.", ""]
    for name, runs in results["scenarios"].items():
        lines += [f"## Scenario {name}", ""]
        if name == "7":
            import bench_scale

            lines += bench_scale.report(runs)
            continue
        if name == "8":
            import bench_load

            lines += bench_load.report(runs)
            continue
        if name == "9":
            import bench_telemetry

            lines += bench_telemetry.report(runs)
            continue
        if name == "10":
            import bench_epp

            lines += bench_epp.report(runs)
            continue
        if name == "11":
            import bench_shared_limits

            lines += bench_shared_limits.report(runs)
            continue
        if name == "6":
            lines += ["| | idle RSS | RSS with 1,000 idle keep-alive connections | per connection |", "|---|---|---|---|"]
            for proc, r in runs.items():
                lines.append(f"| {proc} | {r['idle_rss_mib']:.1f} MiB | {r['rss_with_1000_idle_mib']:.1f} MiB | "
                             f"{r['per_connection_kib']:.1f} KiB |")
            lines.append("")
            continue
        lines += ["| setup | req/s | p50 ms | p90 ms | p99 ms | errors | CPU s / 1k req (of it the kernel's) | gateway peak RSS |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in runs:
            if "rps" not in r:
                continue
            kernel = r.get("kernel_per_1k", {})
            cpu = ", ".join(f"{k} {v:.3f}" + (f" (kernel {kernel[k]:.3f})" if k in kernel else "")
                            for k, v in r["cpu_per_1k"].items())
            rss = f"{r['gateway_peak_rss_mib']:.0f} MiB" if r.get("gateway_peak_rss_mib") else ""
            lines.append(f"| {r['setup']} | {r['rps']:.1f} | {r.get('p50', float('nan')):.3f} | "
                         f"{r.get('p90', float('nan')):.3f} | {r.get('p99', float('nan')):.3f} | {r['errors']} | {cpu} | {rss} |")
        lines.append("")
    lines += targets(results)
    return "\n".join(lines)


def rounds(runs, baseline, gateway="oipgate"):
    """(baseline, oipgate) run pairs, one per round, in the order they ran."""
    base = [r for r in runs if "rps" in r and r["setup"].startswith(baseline)]
    ours = [r for r in runs if "rps" in r and r["setup"].startswith(gateway)]
    return list(zip(base, ours))


def targets(results):
    """Each scenario's target from docs/BENCHMARKS.md, judged round by round from this run's figures."""
    scenarios = results["scenarios"]
    verdict = lambda met: "met" if met else "missed"
    lines = ["## Targets", "", "| scenario | round | measured | target | verdict |", "|---|---|---|---|---|"]
    one = scenarios.get("1", [])
    # Judged with every proxy's request log on, as users run them, against the faster peer of each round.
    for index, ((nginx, ours), (haproxy, _)) in enumerate(
            zip(rounds(one, "logs on: nginx", "logs on: oipgate"), rounds(one, "logs on: haproxy")), 1):
        peer, name = max(((nginx, "nginx"), (haproxy, "haproxy")), key=lambda p: p[0]["rps"])
        ratio = ours["rps"] / peer["rps"]
        cpu_ours, cpu_peer = ours["cpu_per_1k"]["oipgate_logged"], peer["cpu_per_1k"][name]
        lines.append(f"| 1, logs on | {index} | {ratio:.2f}x {name} req/s; p99 {ours['p99']:.2f} vs {peer['p99']:.2f} ms; "
                     f"CPU {cpu_ours:.3f} vs {cpu_peer:.3f} s/1k | >= 1.0x the faster peer, p99 and CPU <= its | "
                     f"{verdict(ratio >= 1.0 and ours['p99'] <= peer['p99'] and cpu_ours <= cpu_peer)} |")
    for key, door in (("1", "REST"), ("2", "gRPC"), ("2b", "gRPC"), ("1r", "REST, one rate"), ("2r", "gRPC, one rate")):
        for index, (off, on) in enumerate(rounds(scenarios.get(key, []), "oipgate", "logs on: oipgate"), 1):
            # CPU seconds per 1,000 requests are milliseconds a request: x 1,000 for microseconds.
            cost_us = (on["cpu_per_1k"]["oipgate_logged"] - off["cpu_per_1k"]["oipgate"]) * 1000.0
            lines.append(f"| {key} access log | {index} | {door}: {cost_us:+.2f} us CPU a request, log on vs off | "
                         f"<= 1 us | {verdict(cost_us <= 1.0)} |")
    for index, (ours, guarded) in enumerate(rounds(one, "oipgate", "auth:"), 1):
        cpu_ours, cpu_guarded = ours["cpu_per_1k"]["oipgate"], guarded["cpu_per_1k"]["oipgate_auth"]
        rise = cpu_guarded / cpu_ours - 1.0
        lines.append(f"| 1 with [auth] | {index} | CPU {cpu_guarded:.3f} vs {cpu_ours:.3f} s/1k ({rise:+.1%}), "
                     f"{guarded['rps']:.0f} vs {ours['rps']:.0f} req/s, errors {guarded['errors']} | "
                     f"CPU rise <= 5% | {verdict(rise <= 0.05 and guarded['errors'] == 0)} |")
    for key in ("2", "2b"):
        runs = scenarios.get(key, [])
        for index, ((nginx, ours), (haproxy, _)) in enumerate(
                zip(rounds(runs, "logs on: nginx", "logs on: oipgate"), rounds(runs, "logs on: haproxy")), 1):
            peer, name = max(((nginx, "nginx"), (haproxy, "haproxy")), key=lambda p: p[0]["rps"])
            ratio = ours["rps"] / peer["rps"]
            cpu_ours, cpu_peer = ours["cpu_per_1k"]["oipgate_logged"], peer["cpu_per_1k"][name]
            met = ratio >= 1.0 and ours["p99"] <= peer["p99"] and cpu_ours <= cpu_peer and ours["errors"] == 0
            lines.append(f"| {key}, logs on | {index} | {ratio:.2f}x {name} calls/s; p99 {ours['p99']:.2f} vs "
                         f"{peer['p99']:.2f} ms; CPU {cpu_ours:.3f} vs {cpu_peer:.3f} s/1k | >= 1.0x the faster peer, "
                         f"p99 and CPU <= its, no errors | {verdict(met)} |")
        for index, (floor, ours) in enumerate(rounds(runs, "floor: smallest hyper HTTP/2"), 1):
            cpu_ours, cpu_floor = ours["cpu_per_1k"]["oipgate"], floor["cpu_per_1k"]["floor_hyper_h2"]
            above = cpu_ours / cpu_floor - 1.0
            lines.append(f"| {key}, h2 floor | {index} | CPU {cpu_ours:.3f} vs {cpu_floor:.3f} s/1k ({above:+.1%}) | "
                         f"<= 5% above the smallest hyper HTTP/2 proxy | {verdict(above <= 0.05)} |")
    parse = results.get("json_parse_ms")
    for name, what in (("3c", "binary answer"), ("3b", "JSON answer")):
        for index, (direct, ours) in enumerate(rounds(scenarios.get(name, []), "direct"), 1):
            added = ours["p50"] - direct["p50"]
            if parse is None:
                lines.append(f"| {name} ({what}) | {index} | adds {added:.1f} ms at p50 | 1.5x the codec's parse time "
                             "(no codec bench result) | - |")
            else:
                lines.append(f"| {name} ({what}) | {index} | adds {added:.1f} ms at p50 | <= {1.5 * parse:.1f} ms "
                             f"(1.5x {parse:.1f} ms) | {verdict(added <= 1.5 * parse)} |")
    base = results.get("primitives")
    for name in ("4", "5"):
        if not base:
            break
        # The payload crosses the gateway's extra hop twice (the request in, the identity model's answer out).
        allowed = 2 * base["memcpy_ms"] + 2 * base["loopback_ms"]
        payload_mib = base["bytes"] / (1 << 20)
        for index, (direct, ours) in enumerate(rounds(scenarios.get(name, []), "direct"), 1):
            added = ours["p50"] - direct["p50"]
            rss = ours["gateway_peak_rss_mib"]
            lines.append(f"| {name} | {index} | adds {added:.1f} ms at p50; peak RSS {rss:.0f} MiB | <= {allowed:.1f} ms "
                         f"(2x memcpy {base['memcpy_ms']:.1f} + 2x loopback {base['loopback_ms']:.1f}); RSS <= "
                         f"{3 * payload_mib:.0f} MiB | latency {verdict(added <= allowed)}, RSS {verdict(rss <= 3 * payload_mib)} |")
    idle = scenarios.get("6", {}).get("oipgate")
    if idle:
        lines.append(f"| 6 | - | idle {idle['idle_rss_mib']:.1f} MiB; {idle['per_connection_kib']:.1f} KiB a connection | "
                     f"<= 30 MiB; <= 16 KiB | {verdict(idle['idle_rss_mib'] <= 30 and idle['per_connection_kib'] <= 16)} |")
    if "7" in scenarios:
        import bench_scale

        lines += bench_scale.targets(scenarios["7"])
    if "9" in scenarios:
        import bench_telemetry

        lines += bench_telemetry.targets(scenarios["9"])
    if "10" in scenarios:
        import bench_epp

        lines += bench_epp.targets(scenarios["10"])
    if "11" in scenarios:
        import bench_shared_limits

        lines += bench_shared_limits.targets(scenarios["11"])
    lines.append("")
    return lines


if __name__ == "__main__":
    sys.exit(main())

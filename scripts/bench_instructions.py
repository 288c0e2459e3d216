#!/usr/bin/env python3
"""Instructions a small request costs, counted under valgrind's callgrind: for a machine too noisy to compare CPU
time between builds (docs/benchmarks/history.md, "Run 4 of 2026-11-24").

Runs oipgate (scenario 1's REST passthrough and scenario 2's gRPC passthrough, each with its access log off and on,
and scenario 3a's REST JSON -> gRPC), the smallest hyper proxy (benches/floor_hyper.rs, on HTTP/1.1 and on HTTP/2),
HAProxy (scenario 1's and 2's peer, when installed: REST and gRPC, its log off and on) and nginx (scenario 1's peer,
when installed) under callgrind in front of oipgate's model server, each twice:
wrk (1 thread x 8 connections; h2load, 1 connection x 8 streams, for gRPC) for SECONDS and for 3 x SECONDS. What
the longer run counted beyond the shorter, divided by the requests it served beyond them, is the instructions a
request costs, start-up and idle work taken out. Prints those and, per request, the functions where oipgate spends
the most instructions of its own; writes
target/bench/instructions.json.

Counts agree from run to run within about 5% whatever else the machine does (how fast requests come changes how
many one wake-up serves, and so the count a little), where CPU time here varied by 20-70%. They are user-space
instructions only, and weigh every instruction alike: a copy done with `rep movsb` counts as one whatever its size,
and waiting on memory counts nothing.

With --cache, callgrind also simulates the caches and the report adds the misses a request: first-level
instruction reads (I1mr), data reads (D1mr) and writes (D1mw), and the functions with the most data misses. A miss
costs time an instruction count does not show; the simulation is deterministic, where the machine's own counters
are not reachable here.

With --locked, callgrind counts each instruction at its address too, and the report adds the locked instructions a
request executes: those objdump shows with a `lock` prefix, or `xchg` with memory (atomic read-modify-writes:
reference counts, atomic counters, uncontended locks). Each is an instruction to callgrind, but tens of cycles to
the processor, which it waits on (docs/benchmarks/history.md, "Run of 2026-11-28, midday").

Needs valgrind (`apt-get install valgrind`) and the production binary (`scripts/build-dist`):
    python3 scripts/bench_instructions.py --seconds 3
    python3 scripts/bench_instructions.py --binary /tmp/other/oipgate     # another build, to compare
    python3 scripts/bench_instructions.py --cache                         # and first-level cache misses
    python3 scripts/bench_instructions.py --locked                        # and atomic read-modify-writes
"""

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import time

import bench_harness as harness

CALLGRIND_TIMEOUT = 120.0
# The cache misses reported with --cache, of those callgrind's simulation counts.
MISSES = ("I1mr", "D1mr", "D1mw")


def wrk_load(url, body):
    """Drives `url` with wrk (1 thread x 8 connections) posting `body`: the REST rows' load."""
    return lambda seconds: harness.wrk(url, body, {"Content-Type": "application/json"}, seconds, 8, 1)


def h2load_load(url, body):
    """Drives `url` with h2load (1 connection x 8 streams) sending the gRPC frame in `body`: the gRPC rows' load."""
    return lambda seconds: harness.h2load(url, body, seconds, 1, 8)


def counted(name, command, port, load, seconds, env=None, cache=False, locked=False):
    """Runs `command` under callgrind, drives it with `load` for `seconds`; its totals by event and requests."""
    out = harness.OUT / f"callgrind-{name}-{seconds}.out"
    server = harness.Server(
        f"callgrind-{name}",
        ["valgrind", "--tool=callgrind", f"--cache-sim={'yes' if cache else 'no'}", f"--callgrind-out-file={out}",
         f"--dump-instr={'yes' if locked else 'no'}", *command],
        [],
        env,
    )
    if not harness.wait_port(port, timeout=CALLGRIND_TIMEOUT):
        server.stop()
        raise SystemExit(f"bench: {name} under callgrind does not listen on {port}: {server.log.read_text()[-2000:]}")
    time.sleep(1)
    served = load(seconds)
    server.stop()
    lines = out.read_text().splitlines()
    events = next(line.split()[1:] for line in lines if line.startswith("events:"))
    totals = next(line.split()[1:] for line in lines if line.startswith(("totals:", "summary:")))
    return out, dict(zip(events, map(int, totals))), served["requests"]


def functions(out, event="Ir"):
    """An event's count by function (exclusive) in a callgrind output: instructions unless told."""
    listing = subprocess.run(
        ["callgrind_annotate", f"--show={event}", "--inclusive=no", "--auto=no", "--threshold=100", str(out)],
        capture_output=True,
        text=True,
    ).stdout
    found = collections.Counter()
    for line in listing.splitlines():
        match = re.match(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(\S.*?)\s*$", line)
        if match and "PROGRAM TOTALS" not in match.group(2):
            name = re.sub(r"\s*\[.*\]$", "", match.group(2))
            name = re.sub(r"^(\S*?\.(?:rs|c|S|h)|\?\?\?):", "", name)
            found[name] += int(match.group(1).replace(",", ""))
    return found


def locked_addresses(path, known={}):
    """The addresses of an object's locked instructions, as objdump disassembles them (once per object)."""
    if path not in known:
        listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True).stdout
        known[path] = {
            int(match.group(1), 16)
            for match in re.finditer(r"^\s*([0-9a-f]+):\s+(lock |xchg\S*\s+\S*\()", listing, re.MULTILINE)
        }
    return known[path]


def by_address(out):
    """Instructions executed by object, function and address, from a callgrind output written with --dump-instr.

    Names, not the file's own numbers for them (which differ from one output to the next), key the counts; positions
    are read as the format compresses them (absolute in hex, or relative to the last), and a call's line (its
    inclusive cost) is left out."""
    counts = collections.Counter()
    names, current, last, after_call = {}, {"ob": None, "fn": None}, 0, False
    for line in out.read_text().splitlines():
        if line and line[0] in "0123456789+-*":
            position = line.split()
            token = position[0]
            if token.startswith("0x"):
                last = int(token, 16)
            elif token[0] in "+-":
                last += int(token)
            if after_call:
                after_call = False
            elif len(position) >= 3:
                counts[(current["ob"], current["fn"], last)] += int(position[2])
            continue
        match = re.match(r"(c?)(ob|fn|fl|fi|fe)=(?:\((\d+)\))?\s*(.*)", line)
        if match:
            called, kind, number, name = match.groups()
            kind = "fn" if kind == "fn" else "ob" if kind == "ob" else None
            if kind:
                if name:
                    names[(kind, number)] = name
                if not called:
                    current[kind] = names.get((kind, number), name)
        elif line.startswith("calls="):
            after_call = True
    return counts


def locked_per_request(short_out, long_out, served):
    """Locked instructions a request, in all and by function: what the longer run executed beyond the shorter."""
    short, long = by_address(short_out), by_address(long_out)
    functions = collections.Counter()
    for (path, function, address), count in long.items():
        extra = count - short.get((path, function, address), 0)
        if extra > 0 and path and os.path.exists(path) and address in locked_addresses(path):
            functions[function] += extra / served
    return sum(functions.values()), dict(functions.most_common(25))


def per_request(name, command, port, url, body, seconds, env=None, cache=False, load=None, locked=False):
    load = load or wrk_load(url, body)
    short_out, short_totals, short_requests = counted(name, command, port, load, seconds, env, cache, locked)
    long_out, long_totals, long_requests = counted(name, command, port, load, 3 * seconds, env, cache, locked)
    served = long_requests - short_requests
    if served <= 0:
        raise SystemExit(f"bench: {name} served no more requests in the longer run")

    def by_function(*events):
        counts = collections.Counter()
        for event in events:
            short, long = functions(short_out, event), functions(long_out, event)
            counts.update({key: (long[key] - short.get(key, 0)) / served for key in long})
        return dict(sorted(counts.items(), key=lambda item: -item[1])[:40])

    result = {
        "instructions": (long_totals["Ir"] - short_totals["Ir"]) / served,
        "requests": [short_requests, long_requests],
        "functions": by_function("Ir"),
    }
    if locked:
        result["locked"], result["locked_by_function"] = locked_per_request(short_out, long_out, served)
    if cache:
        result["misses"] = {event: (long_totals[event] - short_totals[event]) / served for event in MISSES}
        result["data_misses_by_function"] = by_function("D1mr", "D1mw")
    return result


def run(seconds, workers, binary, cache=False, locked=False):
    if not shutil.which("valgrind"):
        raise SystemExit("bench: valgrind is needed (apt-get install valgrind)")
    harness.OUT.mkdir(parents=True, exist_ok=True)
    work = harness.OUT / "instructions"
    work.mkdir(exist_ok=True)
    body, _ = harness.add_sub_json(1)
    body_file = harness.write(harness.OUT / "add_sub.json", body)
    message, _ = harness.convert(harness.add_sub_json("2")[0], "json", "protobuf")
    grpc_file = harness.write(harness.OUT / "add_sub.grpc", harness.grpc_frame(harness.encode_name(message, "add_sub", "2")))
    grpc_path = "/inference.GRPCInferenceService/ModelInfer"
    ports = {k: harness.free_port() for k in ("backend_rest", "backend_grpc", "rest", "grpc", "floor", "floor_h2",
                                            "haproxy", "haproxy_grpc", "haproxy_rest_logged", "haproxy_grpc_logged",
                                            "nginx_rest", "nginx_grpc", "nginx_rest_logged", "nginx_grpc_logged")}
    backend = harness.model_server("model-server", ports)
    results = {}
    try:
        config = harness.gateway_config(work / "gateway.toml", ports["rest"], ports["grpc"], ports)
        env = harness.gateway_env(workers)
        gateway = [str(binary), "serve", "--config", str(config)]
        rest = f"http://127.0.0.1:{ports['rest']}/v2/models/add_sub"
        results["oipgate REST passthrough"] = per_request(
            "oipgate", gateway, ports["rest"], f"{rest}/infer", body_file, seconds, env, cache,
            locked=locked)
        # As users run it: the access log on (the default `info`), its stderr a file (harness.Server's log).
        logged = dict(env)
        logged.pop("RUST_LOG", None)
        results["oipgate REST passthrough, access log on"] = per_request(
            "oipgate-logged", gateway, ports["rest"], f"{rest}/infer", body_file, seconds, logged, cache,
            locked=locked)
        results["oipgate REST JSON -> gRPC"] = per_request(
            "oipgate-3a", gateway, ports["rest"], f"{rest}/versions/2/infer", body_file, seconds, env, cache,
            locked=locked)
        floor = harness.floor_binaries()["floor_hyper"]
        results["floor: smallest hyper proxy"] = per_request(
            "floor", [floor, "--listen", f"127.0.0.1:{ports['floor']}", "--upstream",
                      f"127.0.0.1:{ports['backend_rest']}", "--threads", str(workers)],
            ports["floor"], f"http://127.0.0.1:{ports['floor']}/v2/models/add_sub/infer", body_file, seconds,
            cache=cache, locked=locked)
        # The gRPC door's passthrough (add_sub version 2 is on the gRPC backend) and its floor: the same smallest
        # hyper proxy on HTTP/2 in front of the gRPC backend.
        grpc_url = f"http://127.0.0.1:{ports['grpc']}{grpc_path}"
        results["oipgate gRPC passthrough"] = per_request(
            "oipgate-grpc", gateway, ports["grpc"], grpc_url, grpc_file, seconds, env, cache,
            load=h2load_load(grpc_url, grpc_file), locked=locked)
        results["oipgate gRPC passthrough, access log on"] = per_request(
            "oipgate-grpc-logged", gateway, ports["grpc"], grpc_url, grpc_file, seconds, logged, cache,
            load=h2load_load(grpc_url, grpc_file), locked=locked)
        floor_h2_url = f"http://127.0.0.1:{ports['floor_h2']}{grpc_path}"
        results["floor: smallest hyper HTTP/2 proxy"] = per_request(
            "floor-h2", [floor, "--listen", f"127.0.0.1:{ports['floor_h2']}", "--upstream",
                         f"127.0.0.1:{ports['backend_grpc']}", "--threads", str(workers), "--http2"],
            ports["floor_h2"], floor_h2_url, grpc_file, seconds, cache=cache,
            load=h2load_load(floor_h2_url, grpc_file), locked=locked)
        haproxy = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None)
        if haproxy:
            haproxy_conf = work / "haproxy.cfg"
            haproxy_conf.write_text(harness.HAPROXY_CONF.format(
                workers=workers, haproxy_rest=ports["haproxy"], haproxy_grpc=ports["haproxy_grpc"],
                haproxy_rest_logged=ports["haproxy_rest_logged"], haproxy_grpc_logged=ports["haproxy_grpc_logged"],
                rest=ports["backend_rest"], grpc=ports["backend_grpc"]))
            results["HAProxy"] = per_request(
                "haproxy", [haproxy, "-db", "-f", str(haproxy_conf)], ports["haproxy"],
                f"http://127.0.0.1:{ports['haproxy']}/v2/models/add_sub/infer", body_file, seconds, cache=cache,
                locked=locked)
            results["HAProxy, httplog to a ring"] = per_request(
                "haproxy-logged", [haproxy, "-db", "-f", str(haproxy_conf)], ports["haproxy_rest_logged"],
                f"http://127.0.0.1:{ports['haproxy_rest_logged']}/v2/models/add_sub/infer", body_file, seconds,
                cache=cache, locked=locked)
            # Scenario 2's peer: the gRPC passthrough on HAProxy's own HTTP/2 engine, its log off and on.
            for label, port in (("HAProxy, gRPC", ports["haproxy_grpc"]),
                                ("HAProxy, gRPC, httplog to a ring", ports["haproxy_grpc_logged"])):
                url = f"http://127.0.0.1:{port}{grpc_path}"
                results[label] = per_request(
                    label.lower().replace(", ", "-").replace(" ", "-"), [haproxy, "-db", "-f", str(haproxy_conf)],
                    port, url, grpc_file, seconds, cache=cache, load=h2load_load(url, grpc_file), locked=locked)
        nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
        if nginx:
            # Scenario 1's configuration, in one process (no master, its one worker under callgrind).
            prefix = work / "nginx"
            (prefix / "logs").mkdir(parents=True, exist_ok=True)
            nginx_conf = prefix / "nginx.conf"
            nginx_conf.write_text(harness.NGINX_CONF.format(
                user="user root;" if os.geteuid() == 0 else "", workers=1, prefix=prefix,
                rest=ports["backend_rest"], grpc=ports["backend_grpc"], nginx_rest=ports["nginx_rest"],
                nginx_grpc=ports["nginx_grpc"], nginx_rest_logged=ports["nginx_rest_logged"],
                nginx_grpc_logged=ports["nginx_grpc_logged"]))
            command = [nginx, "-p", str(prefix), "-c", str(nginx_conf), "-g", "daemon off; master_process off;"]
            results["nginx"] = per_request(
                "nginx", command, ports["nginx_rest"],
                f"http://127.0.0.1:{ports['nginx_rest']}/v2/models/add_sub/infer", body_file, seconds, cache=cache,
                locked=locked)
            results["nginx, access log buffered"] = per_request(
                "nginx-logged", command, ports["nginx_rest_logged"],
                f"http://127.0.0.1:{ports['nginx_rest_logged']}/v2/models/add_sub/infer", body_file, seconds,
                cache=cache, locked=locked)
    finally:
        backend.stop()
    return results


def report(results):
    lines = ["| setup | instructions a request | requests (short, long run) |", "|---|---|---|"]
    for setup, result in results.items():
        lines.append(f"| {setup} | {result['instructions']:,.0f} | {result['requests'][0]}, {result['requests'][1]} |")
    ours = results["oipgate REST passthrough"]["functions"]
    floor = results["floor: smallest hyper proxy"]["functions"]
    lines += ["", "REST passthrough, instructions a request by function (oipgate, the floor):", ""]
    lines += [f"    {count:8.0f} {floor.get(name, 0):8.0f}  {name[:110]}" for name, count in list(ours.items())[:25]]
    if "oipgate gRPC passthrough" in results:
        ours_grpc = results["oipgate gRPC passthrough"]["functions"]
        floor_h2 = results["floor: smallest hyper HTTP/2 proxy"]["functions"]
        lines += ["", "gRPC passthrough, instructions a call by function (oipgate, the HTTP/2 floor):", ""]
        lines += [f"    {count:8.0f} {floor_h2.get(name, 0):8.0f}  {name[:110]}"
                  for name, count in list(ours_grpc.items())[:25]]
    if "locked" in results["oipgate REST passthrough"]:
        lines += ["", "| setup | locked instructions a request |", "|---|---|"]
        lines += [f"| {setup} | {result['locked']:,.1f} |"
                  for setup, result in results.items() if "locked" in result]
        lines += ["", "REST passthrough, access log on, locked instructions a request by function:", ""]
        logged = results["oipgate REST passthrough, access log on"]["locked_by_function"]
        lines += [f"    {count:6.2f}  {name[:120]}" for name, count in logged.items()]
    if "misses" in results["oipgate REST passthrough"]:
        lines += ["", "| setup | " + " | ".join(f"{event} a request" for event in MISSES) + " |",
                  "|---|" + "---|" * len(MISSES)]
        for setup, result in results.items():
            lines.append(f"| {setup} | " + " | ".join(f"{result['misses'][e]:,.0f}" for e in MISSES) + " |")
        ours = results["oipgate REST passthrough"]["data_misses_by_function"]
        floor = results["floor: smallest hyper proxy"]["data_misses_by_function"]
        lines += ["", "REST passthrough, first-level data misses (reads and writes) a request by function (oipgate, "
                      "the floor):", ""]
        lines += [f"    {count:8.1f} {floor.get(name, 0):8.1f}  {name[:110]}" for name, count in list(ours.items())[:15]]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--binary", default=str(harness.BINARY), help="the oipgate to count (another build, to compare)")
    parser.add_argument("--cache", action="store_true", help="simulate the caches too, and report misses a request")
    parser.add_argument("--locked", action="store_true", help="count the locked instructions a request too")
    args = parser.parse_args()
    results = run(args.seconds, args.workers, args.binary, args.cache, args.locked)
    (harness.OUT / "instructions.json").write_text(json.dumps(results, indent=2))
    print("\n".join(report(results)))


if __name__ == "__main__":
    main()

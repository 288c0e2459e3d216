#!/usr/bin/env python3
"""Instructions a small request costs, counted under valgrind's callgrind: for a machine too noisy to compare CPU
time between builds (docs/BENCHMARKS.md, "Run 4 of 2026-11-24").

Runs oipgate (scenario 1's REST passthrough and scenario 3a's REST JSON -> gRPC) and the smallest hyper proxy
(benches/floor_hyper.rs) under callgrind in front of oipgate's model server, each twice: wrk (1 thread x 8
connections) for SECONDS and for 3 x SECONDS. What the longer run counted beyond the shorter, divided by the
requests it served beyond them, is the instructions a request costs, start-up and idle work taken out. Prints those
and, per request, the functions where oipgate spends the most instructions of its own; writes
target/bench/instructions.json.

Counts agree from run to run within about 5% whatever else the machine does (how fast requests come changes how
many one wake-up serves, and so the count a little), where CPU time here varied by 20-70%. They are user-space
instructions only, and weigh every instruction alike: a copy done with `rep movsb` counts as one whatever its size,
and waiting on memory counts nothing.

Needs valgrind (`apt-get install valgrind`) and the release binary:
    python3 scripts/bench_instructions.py --seconds 3
    python3 scripts/bench_instructions.py --binary /tmp/other/oipgate     # another build, to compare
"""

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import time

import bench

CALLGRIND_TIMEOUT = 120.0


def counted(name, command, port, url, body, seconds, env=None):
    """Runs `command` under callgrind, drives `url` with wrk for `seconds`; its total instructions and requests."""
    out = bench.OUT / f"callgrind-{name}-{seconds}.out"
    server = bench.Server(
        f"callgrind-{name}",
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *command],
        [],
        env,
    )
    if not bench.wait_port(port, timeout=CALLGRIND_TIMEOUT):
        server.stop()
        raise SystemExit(f"bench: {name} under callgrind does not listen on {port}: {server.log.read_text()[-2000:]}")
    time.sleep(1)
    load = bench.wrk(url, body, {"Content-Type": "application/json"}, seconds, 8, 1)
    server.stop()
    total = next(
        int(line.split()[1]) for line in out.read_text().splitlines() if line.startswith(("totals:", "summary:"))
    )
    return out, total, load["requests"]


def functions(out):
    """Instructions by function (exclusive) in a callgrind output."""
    listing = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--auto=no", "--threshold=100", str(out)],
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


def per_request(name, command, port, url, body, seconds, env=None):
    short_out, short_total, short_requests = counted(name, command, port, url, body, seconds, env)
    long_out, long_total, long_requests = counted(name, command, port, url, body, 3 * seconds, env)
    served = long_requests - short_requests
    if served <= 0:
        raise SystemExit(f"bench: {name} served no more requests in the longer run")
    short_functions, long_functions = functions(short_out), functions(long_out)
    by_function = {key: (long_functions[key] - short_functions.get(key, 0)) / served for key in long_functions}
    return {
        "instructions": (long_total - short_total) / served,
        "requests": [short_requests, long_requests],
        "functions": dict(sorted(by_function.items(), key=lambda item: -item[1])[:40]),
    }


def run(seconds, workers, binary):
    if not shutil.which("valgrind"):
        raise SystemExit("bench: valgrind is needed (apt-get install valgrind)")
    bench.OUT.mkdir(parents=True, exist_ok=True)
    work = bench.OUT / "instructions"
    work.mkdir(exist_ok=True)
    body, _ = bench.add_sub_json(1)
    body_file = bench.write(bench.OUT / "add_sub.json", body)
    ports = {k: bench.free_port() for k in ("backend_rest", "backend_grpc", "rest", "grpc", "floor")}
    backend = bench.Server(
        "model-server",
        [str(bench.BINARY), "model-server", "--rest", f"127.0.0.1:{ports['backend_rest']}", "--grpc",
         f"127.0.0.1:{ports['backend_grpc']}"],
        [ports["backend_rest"], ports["backend_grpc"]],
    )
    results = {}
    try:
        config = work / "gateway.toml"
        config.write_text(bench.GATEWAY_CONF.format(rest=ports["rest"], grpc=ports["grpc"],
                                                    backend_rest=ports["backend_rest"],
                                                    backend_grpc=ports["backend_grpc"]))
        env = dict(os.environ, RUST_LOG="warn", OIPGATE__RUNTIME__THREADS=str(workers))
        gateway = [str(binary), "serve", "--config", str(config)]
        rest = f"http://127.0.0.1:{ports['rest']}/v2/models/add_sub"
        results["oipgate REST passthrough"] = per_request(
            "oipgate", gateway, ports["rest"], f"{rest}/infer", body_file, seconds, env)
        results["oipgate REST JSON -> gRPC"] = per_request(
            "oipgate-3a", gateway, ports["rest"], f"{rest}/versions/2/infer", body_file, seconds, env)
        floor = bench.floor_binaries()["floor_hyper"]
        results["floor: smallest hyper proxy"] = per_request(
            "floor", [floor, "--listen", f"127.0.0.1:{ports['floor']}", "--upstream",
                      f"127.0.0.1:{ports['backend_rest']}", "--threads", str(workers)],
            ports["floor"], f"http://127.0.0.1:{ports['floor']}/v2/models/add_sub/infer", body_file, seconds)
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
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--binary", default=str(bench.BINARY), help="the oipgate to count (another build, to compare)")
    args = parser.parse_args()
    results = run(args.seconds, args.workers, args.binary)
    (bench.OUT / "instructions.json").write_text(json.dumps(results, indent=2))
    print("\n".join(report(results)))


if __name__ == "__main__":
    main()

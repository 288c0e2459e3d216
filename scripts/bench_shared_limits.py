#!/usr/bin/env python3
"""Scenario 11 of the load harness: what rate limits shared through Redis (`[limits.shared]`) cost against each
replica keeping its own (docs/BENCHMARKS.md, "Scenario 11: limits shared through Redis").

One model server, one `redis-server` on a free port (no persistence; started and stopped here) and three gateways,
all started at once with scenario 1's configuration and its `[auth]` (one API key whose rate, 1,000,000 calls a
second with a burst as large, is never reached, so no call is refused and the figure is what deciding costs):

- per-replica: no `[limits.shared]`, the key's token bucket in the gateway's memory (scenario 1's auth row);
- shared, lease 20: `[limits.shared]` with `lease = 20`, a Redis round trip for every 20th call or so;
- shared, lease 0: `[limits.shared]` with `lease = 0`, a Redis round trip for every call.

The two shared gateways use the same Redis under prefixes of their own, so neither spends the other's budget.
Each is driven as scenario 1's auth row is (the small add_sub request, wrk 2 threads x CONNECTIONS, the key as a
bearer token), alternated round by round (A B C, then B C A, ...) so drift hits all alike. Per run: requests/s, p50
and p99 (wrk's latency distribution), CPU microseconds a request of the gateway, of redis-server and of the model
server (/proc/PID/stat), and, from the gateway's metrics listener, how its calls were decided
(`oipgate_shared_limit_calls_total`: leased calls touched no network) and Redis's answers (`take` round trips and
their mean time). redis-server's CPU in a per-replica run is what the idle shared gateways' heartbeats cost it.

**Target:** shared limits with leases (lease 20) cost at most 5% more gateway CPU a request and at most 0.2 ms more
at p99 than per-replica limits, judged on the medians over rounds (one round swings more than 5% on a 2-core VM).

Run by scripts/bench (`--only 11`), or alone with the binary already built (target/dist/oipgate, else
target/release/oipgate; `--binary` another) and redis-server installed (`scripts/setup --tests`):
    python3 scripts/bench_shared_limits.py --seconds 8 --rounds 5
Writes target/bench/shared_limits.json and target/bench/shared_limits.md.

`python3 scripts/bench_shared_limits.py instructions [SECONDS]` counts the three setups' instructions a request
under callgrind instead (needs valgrind), for when CPU time swings more than the difference looked for.
"""

import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import bench_harness as harness
import bench_epp

# The key whose sha256 AUTH_CONF holds.
KEY = "bench-key"
SHARED_CONF = """
[limits.shared]
redis = "redis://127.0.0.1:{redis}/0"
prefix = "{prefix}"
lease = {lease}
when_unreachable = "local"
timeout_ms = 20
"""
# (name, lease: None for per-replica limits, the Redis prefix).
SETUPS = (
    ("per-replica", None, None),
    ("shared, lease 20", 20, "bench-lease20:"),
    ("shared, lease 0", 0, "bench-lease0:"),
)
BASELINE = SETUPS[0][0]
DECISIONS = ("leased", "allowed", "refused", "fallback_allowed", "fallback_refused")
CPU_TARGET = 0.05
P99_TARGET_MS = 0.2


def config_text(rest, grpc, metrics, ports, lease, prefix):
    """Scenario 1's configuration with its [auth] and a metrics listener; with `[limits.shared]` at `lease` calls
    under `prefix` unless `lease` is None."""
    text = harness.GATEWAY_CONF.format(rest=rest, grpc=grpc, backend_rest=ports["backend_rest"],
                                     backend_grpc=ports["backend_grpc"]) + harness.AUTH_CONF
    # The metrics listener belongs in [listen], which GATEWAY_CONF opens; every setup has one so they differ only
    # in [limits.shared].
    door = f'grpc = "127.0.0.1:{grpc}"\n'
    assert door in text
    text = text.replace(door, door + f'metrics = "127.0.0.1:{metrics}"\n', 1)
    if lease is not None:
        text += SHARED_CONF.format(redis=ports["redis"], prefix=prefix, lease=lease)
    return text


def find_binary(given=None):
    """`given`, else the production build when it knows `[limits.shared]`, else the release build."""

    def knows_shared(path):
        if not path.exists():
            return False
        with tempfile.TemporaryDirectory(prefix="oipgate-shared-check-") as work:
            probe = Path(work) / "gateway.toml"
            ports = {"backend_rest": 1, "backend_grpc": 2, "redis": 3}
            probe.write_text(config_text(4, 5, 6, ports, 20, "probe:"))
            return subprocess.run([str(path), "check-config", str(probe)], capture_output=True).returncode == 0

    if given:
        if not knows_shared(Path(given)):
            raise SystemExit(f"bench_shared_limits: {given} is missing or has no [limits.shared] (an older build?)")
        return Path(given)
    for candidate in (harness.BINARY, harness.ROOT / "target" / "release" / "oipgate"):
        if knows_shared(candidate):
            return candidate
    raise SystemExit("bench_shared_limits: no build with [limits.shared] (scripts/build-dist, or --binary)")


def redis_ping(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def http(method, url, body=None, headers=None):
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


SAMPLE = re.compile(r"^(oipgate_shared_limit_\w+)\{([^}]*)\}\s+(\S+)$", re.M)


def shared_metrics(port):
    """The gateway's shared-limit counters: decisions by result, and the `take` round trips (count, seconds)."""
    _, body = http("GET", f"http://127.0.0.1:{port}/metrics")
    found = {name: 0.0 for name in DECISIONS}
    found.update(take_count=0.0, take_seconds=0.0)
    for name, labels, value in SAMPLE.findall(body.decode()):
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if (
            name == "oipgate_shared_limit_calls_total"
            and label.get("limit") == "calls"
            and label.get("result") in DECISIONS
        ):
            found[label["result"]] = float(value)
        elif name == "oipgate_shared_limit_redis_duration_seconds_count" and label.get("operation") == "take":
            found["take_count"] = float(value)
        elif name == "oipgate_shared_limit_redis_duration_seconds_sum" and label.get("operation") == "take":
            found["take_seconds"] = float(value)
    return found


def preflight(gateways, body_file):
    """Each gateway answers the key and refuses a call without it; a shared one has reached Redis (a call decided
    by Redis or a lease, not by the fallback) before anything is measured."""
    body = body_file.read_bytes()
    json_headers = {"Content-Type": "application/json"}
    for name, lease, gateway in gateways:
        url = f"http://127.0.0.1:{gateway['rest']}/v2/models/add_sub/versions/1/infer"
        status, answer = http("POST", url, body, json_headers)
        if status != 401:
            raise SystemExit(f"bench_shared_limits: {name}: a call without the key answered {status}: {answer[:300]!r}")
        until = time.time() + 15
        while True:
            before = shared_metrics(gateway["metrics"])
            status, answer = http("POST", url, body, dict(json_headers, Authorization=f"Bearer {KEY}"))
            outputs = {o["name"]: o["data"] for o in json.loads(answer).get("outputs", [])} if status == 200 else {}
            if status != 200 or outputs.get("OUTPUT0") != [2 * v for v in range(16)]:
                raise SystemExit(f"bench_shared_limits: {name}: add_sub with the key answered {status}: "
                                 f"{answer[:300]!r}")
            after = shared_metrics(gateway["metrics"])
            shared = sum(after[k] - before[k] for k in ("leased", "allowed"))
            if lease is None or shared >= 1:
                break
            if time.time() > until:
                raise SystemExit(f"bench_shared_limits: {name}: calls still decided without Redis after 15 s: "
                                 f"{after}")
            time.sleep(0.2)


def shared_limit_costs(seconds, rounds, connections, workers, binary=None):
    if not shutil.which("redis-server"):
        raise SystemExit("bench_shared_limits: no redis-server: run `scripts/setup --tests`")
    binary = find_binary(binary)
    print(f"bench_shared_limits: measuring {binary}", flush=True)
    harness.OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="oipgate-shared-limits-"))
    version = lambda cmd: (subprocess.run(cmd, capture_output=True, text=True).stdout.strip().splitlines() or [""])[-1]
    results = {"machine": bench_epp.machine(binary), "oipgate": version([str(binary), "--version"]),
               "redis": (re.search(r"v=(\S+)", version(["redis-server", "--version"])) or [None, "?"])[1],
               "args": {"seconds": seconds, "rounds": rounds, "connections": connections, "workers": workers,
                        "binary": str(binary)}, "runs": []}
    results["machine"]["oipgate"] = results["oipgate"]
    servers = []
    try:
        ports = {k: harness.free_port() for k in ("backend_rest", "backend_grpc", "redis")}
        backend = harness.Server(
            "shared-limits-model-server",
            [str(binary), "model-server", "--rest", f"127.0.0.1:{ports['backend_rest']}", "--grpc",
             f"127.0.0.1:{ports['backend_grpc']}"], [ports["backend_rest"], ports["backend_grpc"]])
        servers.append(backend)
        redis = harness.Server(
            "shared-limits-redis",
            ["redis-server", "--port", str(ports["redis"]), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--protected-mode", "no", "--loglevel", "warning", "--dir", str(work)], [ports["redis"]])
        servers.append(redis)
        until = time.time() + 10
        while not redis_ping(ports["redis"]):
            if time.time() > until:
                raise SystemExit("bench_shared_limits: redis-server does not answer PING")
            time.sleep(0.05)
        env = harness.gateway_env(workers)
        gateways = []
        for name, lease, prefix in SETUPS:
            own = {k: harness.free_port() for k in ("rest", "grpc", "metrics")}
            path = work / f"{name.replace(', ', '-').replace(' ', '-')}.toml"
            path.write_text(config_text(own["rest"], own["grpc"], own["metrics"], ports, lease, prefix))
            server = harness.Server(f"shared-limits-oipgate-{path.stem}",
                                  [str(binary), "serve", "--config", str(path)], [own["rest"], own["metrics"]], env)
            servers.append(server)
            gateways.append((name, lease, dict(own, server=server)))
        body, _ = harness.add_sub_json("1")
        body_file = harness.write(harness.OUT / "shared_limits_add_sub.json", body)
        preflight(gateways, body_file)
        time.sleep(1.0)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        threads = min(2, os.cpu_count() or 1)
        for round_index in range(rounds):
            # Each round starts from the next setup, so none always runs right after the same other one.
            start = round_index % len(gateways)
            for name, lease, gateway in gateways[start:] + gateways[:start]:
                url = f"http://127.0.0.1:{gateway['rest']}/v2/models/add_sub/versions/1/infer"
                before = shared_metrics(gateway["metrics"])
                run = bench_epp.measured(name, lambda: harness.wrk(url, body_file, headers, seconds, connections,
                                                                 threads),
                                         {"gateway": gateway["server"], "redis-server": redis,
                                          "model-server": backend})
                after = shared_metrics(gateway["metrics"])
                run.update(round=round_index + 1, lease=lease,
                           shared={k: int(after[k] - before[k]) for k in DECISIONS},
                           redis_takes=int(after["take_count"] - before["take_count"]),
                           redis_take_seconds=after["take_seconds"] - before["take_seconds"])
                results["runs"].append(run)
                decided = run["shared"]
                touched = "" if lease is None else f"  leased {decided['leased']} allowed {decided['allowed']}" + \
                    "".join(f" {k} {decided[k]}" for k in DECISIONS[2:] if decided[k])
                print(f"  11 {name:<17} {run['rps']:>9.1f} req/s  p50 {run.get('p50', float('nan')):7.3f}  p99 "
                      f"{run.get('p99', float('nan')):7.3f} ms  errors {run['errors']}  CPU us gateway "
                      f"{run['cpu_us']['gateway']:.1f} redis {run['cpu_us']['redis-server']:.2f}{touched}",
                      flush=True)
                time.sleep(0.3)
    finally:
        for server in reversed(servers):
            server.stop()
    (harness.OUT / "shared_limits.json").write_text(json.dumps(results, indent=2))
    (harness.OUT / "shared_limits.md").write_text("\n".join(
        ["# Rate limits shared through Redis against per-replica limits", ""] + report(results)
        + ["", "| scenario | round | measured | target | verdict |", "|---|---|---|---|---|"] + targets(results))
        + "\n")
    print(f"bench_shared_limits: wrote {harness.OUT / 'shared_limits.md'} and {harness.OUT / 'shared_limits.json'}",
          flush=True)
    return results


def runs_of(results, setup):
    return [r for r in results["runs"] if r["setup"] == setup]


def median(runs, pick):
    values = [v for v in (pick(r) for r in runs) if v is not None]
    return statistics.median(values) if values else float("nan")


def figures(runs):
    """The medians a setup is judged on."""
    return {
        "rps": median(runs, lambda r: r["rps"]),
        "p50": median(runs, lambda r: r.get("p50")),
        "p99": median(runs, lambda r: r.get("p99")),
        "gateway": median(runs, lambda r: r["cpu_us"]["gateway"]),
        "redis": median(runs, lambda r: r["cpu_us"]["redis-server"]),
        "both": median(runs, lambda r: r["cpu_us"]["gateway"] + r["cpu_us"]["redis-server"]),
        "model": median(runs, lambda r: r["cpu_us"]["model-server"]),
        "client": median(runs, lambda r: r["cpu_us"]["client"]),
    }


def report(results):
    m, a = results["machine"], results["args"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, Linux {m['kernel']}; {results['oipgate']} ({a['binary']}); "
        f"Redis {results['redis']}; {m['wrk']}; {m['date']}. {a['rounds']} round(s) of {a['seconds']} s, wrk "
        f"{min(2, m['cores'] or 1)} threads x {a['connections']} connections; oipgate threads {a['workers']}; nothing "
        "pinned. Medians over rounds; CPU in microseconds a request of each process (client: wrk). Redis decisions and "
        "round trips are summed over the setup's runs: `leased` calls touched no network, `allowed` ones waited on "
        "Redis.",
        "",
        "| setup | req/s | p50 ms | p99 ms | gateway CPU us | redis CPU us | model server CPU us | client CPU us "
        "| leased | allowed | refused / fallback | Redis takes / 1k req | Redis take mean ms | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, lease, _ in SETUPS:
        runs = runs_of(results, name)
        if not runs:
            continue
        f = figures(runs)
        requests = sum(r["requests"] for r in runs)
        if lease is None:
            shared = "| - | - | - | - | - "
        else:
            total = lambda key: sum(r["shared"][key] for r in runs)
            decided = sum(total(k) for k in DECISIONS) or 1
            share = lambda n: f"{n:,} ({n / decided:.1%})"
            takes = sum(r["redis_takes"] for r in runs)
            took = sum(r["redis_take_seconds"] for r in runs)
            shared = (f"| {share(total('leased'))} | {share(total('allowed'))} "
                      f"| {total('refused'):,} / {total('fallback_allowed') + total('fallback_refused'):,} "
                      f"| {takes * 1000.0 / max(requests, 1):.1f} "
                      f"| {took * 1e3 / takes if takes else float('nan'):.3f} ")
        lines.append(f"| {name} | {f['rps']:,.0f} | {f['p50']:.3f} | {f['p99']:.3f} | {f['gateway']:.1f} | "
                     f"{f['redis']:.2f} | {f['model']:.1f} | {f['client']:.1f} {shared}| "
                     f"{sum(r['errors'] for r in runs)} |")
    base = runs_of(results, BASELINE)
    if base:
        b = figures(base)
        lines += ["", f"Against {BASELINE} (medians):", "",
                  "| setup | gateway CPU a request | gateway + Redis CPU a request | p99 | req/s |",
                  "|---|---|---|---|---|"]
        for name, _, _ in SETUPS[1:]:
            runs = runs_of(results, name)
            if not runs:
                continue
            f = figures(runs)
            lines.append(f"| {name} | {f['gateway'] - b['gateway']:+.1f} us ({f['gateway'] / b['gateway'] - 1:+.1%}) | "
                         f"{f['both'] - b['both']:+.1f} us ({f['both'] / b['both'] - 1:+.1%}) | "
                         f"{f['p99'] - b['p99']:+.3f} ms | {f['rps'] / b['rps']:.3f}x |")
    fallback = sum(fell_back(r) for r in results["runs"])
    if fallback:
        lines += ["", f"{fallback:,} calls of the shared setups were decided by the fallback (Redis's answer later "
                  "than timeout_ms = 20 as the gateway saw it: a gateway or machine out of CPU); those calls cost no "
                  "Redis, so their runs understate what sharing costs."]
    lines.append("")
    return lines


def fell_back(run):
    """Calls of a run the fallback decided: Redis answered later than timeout_ms as the gateway saw it, so they
    measure no Redis at all."""
    shared = run.get("shared") or {}
    return shared.get("fallback_allowed", 0) + shared.get("fallback_refused", 0)


def targets(results):
    """Lease 20 against per-replica limits: gateway CPU a request within 5% and p99 within 0.2 ms, no errors and no
    call left to the fallback, judged on the medians over rounds; each round's pair beside them, for how much one
    round swings."""
    verdict = lambda met: "met" if met else "missed"
    base, leased = runs_of(results, BASELINE), runs_of(results, SETUPS[1][0])
    target = f"CPU <= +{CPU_TARGET:.0%}, p99 <= +{P99_TARGET_MS} ms, no errors or fallback"

    def row(index, cpu_a, cpu_b, p99_a, p99_b, errors, fallback):
        rise, added = cpu_b / cpu_a - 1.0, p99_b - p99_a
        met = rise <= CPU_TARGET and added <= P99_TARGET_MS and not errors and not fallback
        return (f"| 11 lease 20 | {index} | CPU {cpu_b:.1f} vs {cpu_a:.1f} us ({rise:+.1%}); p99 {p99_b:.3f} vs "
                f"{p99_a:.3f} ms ({added:+.3f}); errors {errors}, fallback {fallback} | {target} | {verdict(met)} |")

    lines = []
    for index in sorted({r["round"] for r in results["runs"]}):
        pick = lambda runs: next((r for r in runs if r["round"] == index), None)
        a, b = pick(base), pick(leased)
        if a and b:
            lines.append(row(index, a["cpu_us"]["gateway"], b["cpu_us"]["gateway"], a.get("p99", float("nan")),
                             b.get("p99", float("nan")), b["errors"], fell_back(b)))
    if base and leased:
        a, b = figures(base), figures(leased)
        lines.append(row("medians (judged)", a["gateway"], b["gateway"], a["p99"], b["p99"],
                         sum(r["errors"] for r in leased), sum(fell_back(r) for r in leased)))
    return lines


def instruction_costs(seconds, binary=None):
    """Instructions a request costs in each setup, counted under callgrind (scripts/bench_instructions.py's method:
    wrk 1 x 8 for SECONDS and 3 x SECONDS, the difference over the requests between), for a machine whose CPU time
    swings more than the difference looked for. User space only: the Redis round trips' system calls are not in it.
    Redis's timeout is raised to a second, as a gateway under callgrind runs tens of times slower."""
    import bench_instructions

    binary = find_binary(binary)
    work = Path(tempfile.mkdtemp(prefix="oipgate-shared-instructions-"))
    ports = {k: harness.free_port() for k in ("backend_rest", "backend_grpc", "redis", "rest", "grpc", "metrics")}
    body, _ = harness.add_sub_json(1)
    body_file = harness.write(harness.OUT / "add_sub.json", body)
    servers = [
        harness.model_server("instructions-model-server", ports),
        harness.Server("instructions-redis",
                     ["redis-server", "--port", str(ports["redis"]), "--bind", "127.0.0.1", "--save", "",
                      "--appendonly", "no", "--loglevel", "warning", "--dir", str(work)], [ports["redis"]]),
    ]
    results = {}
    try:
        url = f"http://127.0.0.1:{ports['rest']}/v2/models/add_sub/infer"
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        load = lambda span: harness.wrk(url, body_file, headers, span, 8, 1)
        for name, lease, prefix in SETUPS:
            text = config_text(ports["rest"], ports["grpc"], ports["metrics"], ports, lease, prefix)
            path = work / f"{name.replace(' ', '').replace(',', '-')}.toml"
            path.write_text(text.replace("timeout_ms = 20", "timeout_ms = 1000"))
            command = [str(binary), "serve", "--config", str(path)]
            counted = bench_instructions.per_request(
                f"shared-{lease}", command, ports["rest"], url, body_file, seconds, harness.gateway_env(1), load=load)
            results[name] = round(counted["instructions"])
            print(f"  11 {name:<20} {results[name]:>8,} instructions a request", flush=True)
    finally:
        for server in servers:
            server.stop()
    return results


def main():
    if sys.argv[1:2] == ["instructions"]:
        seconds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
        print(json.dumps(instruction_costs(seconds), indent=1))
        return
    harness.scenario_main(__doc__, shared_limit_costs, "shared_limits", report, targets=targets, rounds=5,
                        extra=(("--binary", "the oipgate measured (default target/dist/oipgate, else the release "
                                            "build)"),))


if __name__ == "__main__":
    main()

"""Scenario 7 of the load harness: one gateway in front of many models (docs/BENCHMARKS.md,
"Scenario 7: ten thousand models").

Generates configurations of 1, 1,000 and 10,000 public models over 200 backends (each model an alias of the model
server's add_sub, spread over the backends, which all reach the one model server), starts a gateway on each, and
reports per gateway: `check-config` time, start time, RSS after start and after a SIGHUP reload, the reload's time,
`GET /metrics` bytes and time before and after traffic to 100 models, `POST /v2/repository/index` time, and
add_sub requests/s and CPU per request under wrk, alternated with the 1-model gateway in the same run (A B A B).

Run by scripts/bench (`--only 7`), or alone once the production binary is built (`scripts/build-dist`):
    python3 scripts/bench_scale.py --seconds 8 --rounds 3
"""

import os
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import bench_harness as harness

BACKENDS = 200
SIZES = (1, 1000, 10000)
TOUCHED = 100  # models that get traffic before the second /metrics
REPEAT = 5  # samples of each timed call; the median is reported


def config_text(models, rest, grpc, metrics, backend_rest, backends=BACKENDS):
    lines = [
        "[listen]",
        f'rest = "127.0.0.1:{rest}"',
        f'grpc = "127.0.0.1:{grpc}"',
        f'metrics = "127.0.0.1:{metrics}"',
        "[reload]",
        "watch = false",
    ]
    for b in range(backends):
        lines += ["[[backends]]", f'name = "b{b:03}"', 'protocol = "rest"', f'endpoints = ["127.0.0.1:{backend_rest}"]']
    for m in range(models):
        lines += [
            "[[models]]",
            f'name = "m{m:05}"',
            f'versions = [ {{ version = "1", backend = "b{m % backends:03}", upstream_name = "add_sub" }} ]',
        ]
    return "\n".join(lines) + "\n"


def call(url, body=None):
    """(seconds, bytes) of one call that must answer 200."""
    started = time.perf_counter()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"} if body else {})
    with urllib.request.urlopen(request, timeout=60) as response:
        data = response.read()
    return time.perf_counter() - started, len(data)


def timed(url, body=None):
    samples = [call(url, body) for _ in range(REPEAT)]
    return statistics.median(s for s, _ in samples) * 1e3, samples[-1][1]


def reloads_ok(metrics_port):
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=60) as response:
        for line in response.read().decode().splitlines():
            if line.startswith('oipgate_config_reloads_total{result="ok"}'):
                return int(float(line.split()[-1]))
    return 0


def wait_ready(port, timeout=60.0):
    until = time.time() + timeout
    while time.time() < until:
        try:
            call(f"http://127.0.0.1:{port}/v2/health/live")
            return True
        except OSError:
            time.sleep(0.02)
    return False


def settle_rss(pid, seconds=1.5):
    time.sleep(seconds)
    return harness.status_kib(pid, "VmRSS") / 1024


def start(work, models, backend_rest, env, backends=BACKENDS):
    ports = {k: harness.free_port() for k in ("rest", "grpc", "metrics")}
    path = work / f"scale-{models}-{backends}.toml"
    path.write_text(config_text(models, ports["rest"], ports["grpc"], ports["metrics"], backend_rest, backends))
    started = time.perf_counter()
    done = subprocess.run([str(harness.BINARY), "check-config", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench: the {models}-model configuration is refused: {done.stderr[-2000:]}")
    check_ms = (time.perf_counter() - started) * 1e3
    started = time.perf_counter()
    server = harness.Server(f"oipgate-{models}-{backends}", [str(harness.BINARY), "serve", "--config", str(path)],
                          [ports["rest"], ports["metrics"]], env)
    if not wait_ready(ports["rest"]):
        raise SystemExit(f"bench: the {models}-model gateway does not answer")
    start_ms = (time.perf_counter() - started) * 1e3
    return server, ports, {"models": models, "check_config_ms": check_ms, "start_ms": start_ms}


def measure_idle(server, ports, figures, body):
    """Everything but the load: RSS, /metrics, index, reload, then traffic to TOUCHED models and /metrics again."""
    rest, metrics = ports["rest"], ports["metrics"]
    figures["rss_start_mib"] = settle_rss(server.pid)
    figures["metrics_ms"], figures["metrics_bytes"] = timed(f"http://127.0.0.1:{metrics}/metrics")
    figures["index_ms"], figures["index_bytes"] = timed(f"http://127.0.0.1:{rest}/v2/repository/index", b"{}")
    before = reloads_ok(metrics)
    started = time.perf_counter()
    os.kill(server.pid, signal.SIGHUP)
    while reloads_ok(metrics) == before:
        if time.perf_counter() - started > 60:
            raise SystemExit(f"bench: the {figures['models']}-model gateway did not reload")
        time.sleep(0.01)
    figures["reload_ms"] = (time.perf_counter() - started) * 1e3
    figures["rss_reload_mib"] = settle_rss(server.pid, 3.0)
    for m in range(min(TOUCHED, figures["models"])):
        for _ in range(3):
            call(f"http://127.0.0.1:{rest}/v2/models/m{m:05}/infer", body)
    figures["metrics_traffic_ms"], figures["metrics_traffic_bytes"] = timed(f"http://127.0.0.1:{metrics}/metrics")
    print(f"  7: {figures['models']:>6} models: check-config {figures['check_config_ms']:.0f} ms, start "
          f"{figures['start_ms']:.0f} ms, RSS {figures['rss_start_mib']:.1f} MiB, after reload "
          f"{figures['rss_reload_mib']:.1f} MiB (reload {figures['reload_ms']:.0f} ms); /metrics "
          f"{figures['metrics_bytes']:,} B {figures['metrics_ms']:.1f} ms, after traffic "
          f"{figures['metrics_traffic_bytes']:,} B {figures['metrics_traffic_ms']:.1f} ms; index "
          f"{figures['index_ms']:.1f} ms", flush=True)


def scale(seconds, rounds, connections, workers):
    """Runs scenario 7; its results (a dict per gateway, and the alternated load runs)."""
    work = Path(tempfile.mkdtemp(prefix="oipgate-scale-"))
    ports = {k: harness.free_port() for k in ("backend_rest", "backend_grpc")}
    backend = harness.model_server("model-server-scale", ports)
    env = harness.gateway_env(workers)
    body, _ = harness.add_sub_json("1")
    body_file = harness.write(harness.OUT / "add_sub_scale.json", body)
    gateways, results = {}, {"gateways": [], "load": []}
    try:
        # What 199 more backends cost: the 1-model gateway with one backend, for the per-backend figure.
        server, _, _ = start(work, 1, ports["backend_rest"], env, backends=1)
        results["one_backend_rss_mib"] = settle_rss(server.pid)
        server.stop()
        for models in SIZES:
            server, gateway_ports, figures = start(work, models, ports["backend_rest"], env)
            gateways[models] = (server, gateway_ports)
            measure_idle(server, gateway_ports, figures, body)
            results["gateways"].append(figures)
        threads = min(2, os.cpu_count() or 1)
        headers = {"Content-Type": "application/json"}
        # The most-numbered model of each gateway, so its route sits wherever the table puts the last one.
        for _ in range(rounds):
            for models, (server, gateway_ports) in gateways.items():
                url = f"http://127.0.0.1:{gateway_ports['rest']}/v2/models/m{models - 1:05}/infer"
                run = harness.run_one(f"{models} models", lambda: harness.wrk(url, body_file, headers, seconds, connections,
                                                                          threads),
                                    {"oipgate": server, "model-server": backend})
                run["models"] = models
                run["rss_after_load_mib"] = harness.status_kib(server.pid, "VmRSS") / 1024
                print(f"  7: {models:>6} models: {run['rps']:>9.1f} req/s, oipgate CPU "
                      f"{run['cpu_per_1k']['oipgate']:.3f} s/1k, errors {run['errors']}", flush=True)
                results["load"].append(run)
    finally:
        for server, _ in gateways.values():
            server.stop()
        backend.stop()
    return results


def report(results):
    lines = ["| models | check-config | start | RSS after start | after reload (reload time) | /metrics before traffic "
             "| after traffic to 100 models | index | add_sub req/s (median) | CPU s / 1k req (median) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for g in results["gateways"]:
        runs = [r for r in results["load"] if r["models"] == g["models"]]
        rps = statistics.median(r["rps"] for r in runs) if runs else float("nan")
        cpu = statistics.median(r["cpu_per_1k"]["oipgate"] for r in runs) if runs else float("nan")
        lines.append(f"| {g['models']:,} | {g['check_config_ms']:.0f} ms | {g['start_ms']:.0f} ms | "
                     f"{g['rss_start_mib']:.1f} MiB | {g['rss_reload_mib']:.1f} MiB ({g['reload_ms']:.0f} ms) | "
                     f"{g['metrics_bytes']:,} B, {g['metrics_ms']:.1f} ms | {g['metrics_traffic_bytes']:,} B, "
                     f"{g['metrics_traffic_ms']:.1f} ms | {g['index_ms']:.1f} ms | {rps:.0f} | {cpu:.4f} |")
    by = {g["models"]: g for g in results["gateways"]}
    if 1 in by and 10000 in by and "one_backend_rss_mib" in results:
        per_model = (by[10000]["rss_start_mib"] - by[1]["rss_start_mib"]) * 1024 / 9999
        per_backend = (by[1]["rss_start_mib"] - results["one_backend_rss_mib"]) * 1024 / (BACKENDS - 1)
        lines += ["", f"Memory: {per_model:.2f} KiB per model version (10,000 against 1 model), {per_backend:.1f} KiB per "
                  f"backend of one endpoint (200 against 1 backend, {results['one_backend_rss_mib']:.1f} MiB)."]
    lines.append("")
    return lines


def targets(results):
    """The targets of docs/BENCHMARKS.md ("Scenario 7: ten thousand models") at 10,000 models, against the 1-model
    gateway of the same run."""
    by = {g["models"]: g for g in results["gateways"]}
    one, big = by.get(1), by.get(10000)
    if not one or not big:
        return []
    verdict = lambda met: "met" if met else "missed"
    lines = []
    rss = big["rss_start_mib"] - one["rss_start_mib"]
    lines.append(f"| 7 RSS | - | {rss:+.1f} MiB over the 1-model gateway | <= 64 MiB | {verdict(rss <= 64)} |")
    lines.append(f"| 7 /metrics | - | {big['metrics_bytes']:,} B, {big['metrics_ms']:.1f} ms | <= 1 MB, <= 50 ms | "
                 f"{verdict(big['metrics_bytes'] <= 1_000_000 and big['metrics_ms'] <= 50)} |")
    lines.append(f"| 7 index | - | {big['index_ms']:.1f} ms | <= 50 ms | {verdict(big['index_ms'] <= 50)} |")
    grew = big["rss_reload_mib"] / big["rss_start_mib"] - 1
    lines.append(f"| 7 reload | - | {big['reload_ms']:.0f} ms; RSS {grew:+.1%} | <= 1 s; RSS within 10% | "
                 f"{verdict(big['reload_ms'] <= 1000 and abs(grew) <= 0.10)} |")
    ones = [r for r in results["load"] if r["models"] == 1]
    bigs = [r for r in results["load"] if r["models"] == 10000]
    for index, (a, b) in enumerate(zip(ones, bigs), 1):
        ratio = b["rps"] / a["rps"]
        lines.append(f"| 7 req/s | {index} | {ratio:.2f}x the 1-model gateway; CPU {b['cpu_per_1k']['oipgate']:.4f} vs "
                     f"{a['cpu_per_1k']['oipgate']:.4f} s/1k | >= 0.95x | {verdict(ratio >= 0.95)} |")
    return lines


def main():
    harness.scenario_main(__doc__, scale, "scale", report, targets)


if __name__ == "__main__":
    main()

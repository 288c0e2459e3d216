#!/usr/bin/env python3
"""The workload a profile-guided build learns from (run by scripts/build-dist, not by hand).

Starts an instrumented oipgate as the model server and as the gateway in front of it (scripts/bench_harness.py's
configuration, two worker threads, its access log on as by default), drives each of the paths scripts/bench
measures for a few seconds (REST passthrough, gRPC passthrough, REST JSON -> gRPC, gRPC -> REST, the binary
extension, a 1M-value JSON body, health and metadata), then stops both with SIGTERM so that they write their
profiles on the way out.
    scripts/pgo_train.py INSTRUMENTED_BINARY [SECONDS]
"""

import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path

import bench_harness as harness


def main():
    harness.BINARY = Path(sys.argv[1]).resolve()
    seconds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    harness.OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="oipgate-pgo-"))
    ports = {k: harness.free_port() for k in ("backend_rest", "backend_grpc", "rest", "grpc")}
    backend = harness.model_server("pgo-model-server", ports)
    gateway = None
    try:
        config = harness.gateway_config(work / "gateway.toml", ports["rest"], ports["grpc"], ports)
        # As users run it, access log on: trained without it, the build takes the line's code for cold and lays it
        # out for size (the line cost more instructions in the production build than in release).
        gateway = harness.Server("pgo-oipgate", [str(harness.BINARY), "serve", "--config", str(config)],
                               [ports["rest"], ports["grpc"]], harness.gateway_env(2, access_log=True))
        rest = f"http://127.0.0.1:{ports['rest']}"
        grpc = f"http://127.0.0.1:{ports['grpc']}/inference.GRPCInferenceService/ModelInfer"
        json_header = {"Content-Type": "application/json"}

        small, _ = harness.add_sub_json("1")
        small_file = harness.write(work / "add_sub.json", small)
        message, _ = harness.convert(small, "json", "protobuf")
        grpc_to_grpc = harness.write(work / "add_sub2.grpc", harness.grpc_frame(harness.encode_name(message, "add_sub", "2")))
        grpc_to_rest = harness.write(work / "add_sub1.grpc", harness.grpc_frame(harness.encode_name(message, "add_sub", "1")))
        binary_body, header_length = harness.fp32_binary(4096)
        binary_file = harness.write(work / "fp32_4k.bin", binary_body)
        binary_header = {"Content-Type": "application/octet-stream",
                         "Inference-Header-Content-Length": str(header_length)}
        big_file = harness.write(work / "fp32_1m.json", harness.fp32_json(1 << 20))

        loads = [
            ("REST passthrough", lambda: harness.wrk(f"{rest}/v2/models/add_sub/versions/1/infer", small_file,
                                                   json_header, seconds * 2, 32, 2)),
            ("REST JSON -> gRPC", lambda: harness.wrk(f"{rest}/v2/models/add_sub/versions/2/infer", small_file,
                                                    json_header, seconds, 32, 2)),
            ("gRPC passthrough", lambda: harness.h2load(grpc, grpc_to_grpc, seconds, 4, 8)),
            ("gRPC -> REST", lambda: harness.h2load(grpc, grpc_to_rest, seconds, 4, 8)),
            ("REST binary extension -> gRPC", lambda: harness.wrk(f"{rest}/v2/models/identity/versions/1/infer",
                                                                binary_file, binary_header, seconds, 4, 1)),
            ("REST 1M-value JSON -> gRPC", lambda: harness.wrk(f"{rest}/v2/models/identity/versions/1/infer", big_file,
                                                             json_header, seconds, 1, 1)),
        ]
        for name, load in loads:
            result = load()
            print(f"pgo: {name}: {result['requests']} requests, {result['errors']} errors", flush=True)
            if result["requests"] == 0 or result["errors"]:
                raise SystemExit(f"pgo: the {name} workload failed; a profile of errors would mislead the build")
        for path in ("/v2/health/ready", "/v2", "/v2/models/add_sub", "/v2/models/add_sub/ready"):
            for _ in range(200):
                with urllib.request.urlopen(rest + path) as answer:
                    answer.read()
    finally:
        for server in (gateway, backend):
            if server is not None:
                server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

# syntax=docker/dockerfile:1
# The oipgate image: the production binary (scripts/build-dist: the `dist` profile, profile-guided, laid out by BOLT)
# on Debian slim, running the gateway with config/gateway.toml as non-root.
# Build: DOCKER_BUILDKIT=1 docker build -t oipgate:latest .   (the cache mounts below need BuildKit)

FROM rust:1-bookworm AS build
# pingora's build needs cmake; the gRPC protos are compiled by protox, so no protoc. The profile-guided build needs
# llvm-profdata of rustc's own LLVM (rustup's llvm-tools), llvm-bolt (Debian's bolt-19) and, for the workload both
# learn from, python3, wrk and h2load.
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends cmake python3 wrk nghttp2-client bolt-19 \
 && rm -rf /var/lib/apt/lists/* \
 && rustup component add llvm-tools
WORKDIR /src
COPY . .
# The registry and target directory live in cache mounts, kept between builds; the binary is copied out of the
# cache mount (which is not part of the image) to /out.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    scripts/build-dist \
 && mkdir -p /out \
 && strip -o /out/oipgate target/dist/oipgate

FROM debian:bookworm-slim
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/oipgate /usr/local/bin/oipgate
# The default configuration; in Kubernetes the oipgate-config ConfigMap is mounted over /etc/oipgate
# (deploy/base). It points at the model-servers headless Service, so outside a cluster mount your own.
COPY config/gateway.toml /etc/oipgate/gateway.toml
USER 65532:65532
# REST (HTTP/1.1 and h2c), gRPC, Prometheus metrics.
EXPOSE 8000 8001 8002
# No HEALTHCHECK: the image has no curl. Probe over HTTP on 8000 instead (deploy/base/deployment.yaml does):
#   readiness  GET /v2/health/ready   200 when every model has a ready backend endpoint; 503 from SIGTERM on
#   liveness   GET /v2/health/live    200 while the process serves
ENTRYPOINT ["oipgate"]
CMD ["serve", "--config", "/etc/oipgate/gateway.toml"]

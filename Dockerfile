# Builds the oipgate binary and ships it on a slim Debian base.
FROM rust:1-bookworm AS build
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends cmake && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked && strip target/release/oipgate

FROM debian:bookworm-slim
COPY --from=build /src/target/release/oipgate /usr/local/bin/oipgate
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/oipgate"]

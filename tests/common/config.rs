//! Pieces of gateway configurations (TOML tables) that tests put together. A key written after a table belongs to it
//! until the next table begins, so a test adds its own keys to a table by writing them after it.

use std::fmt::Display;

/// A `[[backends]]` table: `name`, speaking `protocol` ("rest" or "grpc"), at `endpoints`.
pub fn backend<A: Display>(name: &str, protocol: &str, endpoints: impl IntoIterator<Item = A>) -> String {
    let endpoints: Vec<String> = endpoints.into_iter().map(|e| format!("\"{e}\"")).collect();
    format!(
        "[[backends]]\nname = \"{name}\"\nprotocol = \"{protocol}\"\nendpoints = [{}]\n",
        endpoints.join(", ")
    )
}

/// A `[[backends]]` table: `name`, speaking `protocol`, its endpoints found by resolving `dns` (a name and a port).
pub fn dns_backend(name: &str, protocol: &str, dns: &str) -> String {
    format!("[[backends]]\nname = \"{name}\"\nprotocol = \"{protocol}\"\ndns = \"{dns}\"\n")
}

/// A `[[models]]` table: `name` with one version, "1", on `backend`.
pub fn model(name: &str, backend: &str) -> String {
    format!("[[models]]\nname = \"{name}\"\nversions = [ {{ version = \"1\", backend = \"{backend}\" }} ]\n")
}

/// The two backends most gateway tests put in front of their model servers: `fleet-a`, REST with the binary tensor
/// data extension, at `rest`; and `fleet-b`, gRPC, at `grpc`.
pub fn fleet_backends(rest: impl Display, grpc: impl Display) -> String {
    format!(
        "{}binary_data = true\n{}",
        backend("fleet-a", "rest", [rest]),
        backend("fleet-b", "grpc", [grpc])
    )
}

/// `add_sub` over [`fleet_backends`]: version 1 on `fleet-a` (REST), version 2 on `fleet-b` (gRPC), 1 the default.
pub const ADD_SUB_ON_BOTH: &str = r#"
[[models]]
name = "add_sub"
versions = [ { version = "1", backend = "fleet-a" }, { version = "2", backend = "fleet-b" } ]
default_version = "1"
"#;

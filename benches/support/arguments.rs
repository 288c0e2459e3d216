//! The command line of the harness's helper programs (benches/floor_*.rs, benches/telemetry_sinks.rs).

/// The value after `--name` on the command line, if given.
pub fn argument(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

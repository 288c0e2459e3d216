//! Fuzz target: oipgate::fuzzing::compression.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::fuzzing::compression(data));

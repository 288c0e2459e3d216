//! Fuzz target: oipgate::fuzzing::key_scan.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::fuzzing::key_scan(data));

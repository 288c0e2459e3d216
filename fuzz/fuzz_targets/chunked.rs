//! Fuzz target: oipgate::fuzzing::chunked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::fuzzing::chunked(data));

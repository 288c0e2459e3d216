//! Fuzz target: oipgate::fuzzing::decthings.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::fuzzing::decthings(data));

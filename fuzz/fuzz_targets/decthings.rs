//! Fuzz target: oipgate::codec::fuzzing::decthings.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::codec::fuzzing::decthings(data));

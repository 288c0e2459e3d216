//! Fuzz target: oipgate::fuzzing::splice.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::fuzzing::splice(data));

//! Fuzz target: oipgate::codec::fuzzing::splice.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::codec::fuzzing::splice(data));

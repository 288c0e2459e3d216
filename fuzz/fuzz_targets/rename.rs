//! Fuzz target: oipgate::fuzzing::rename.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::fuzzing::rename(data));

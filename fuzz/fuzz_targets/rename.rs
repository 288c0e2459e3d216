//! Fuzz target: oipgate::codec::fuzzing::rename.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::codec::fuzzing::rename(data));

//! Fuzz target: oipgate::fuzzing::leading_fields.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::fuzzing::leading_fields(data));

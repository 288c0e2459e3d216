//! Fuzz target: oipgate::fuzzing::binary_request.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::fuzzing::binary_request(data));

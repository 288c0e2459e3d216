//! Fuzz target: oipgate::codec::fuzzing::binary_request.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::codec::fuzzing::binary_request(data));

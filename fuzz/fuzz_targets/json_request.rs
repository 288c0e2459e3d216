//! Fuzz target: oipgate::codec::fuzzing::json_request.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::codec::fuzzing::json_request(data));

//! Fuzz target: oipgate::fuzzing::json_request.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::fuzzing::json_request(data));

//! Fuzz target: oipgate::fuzzing::protobuf_request.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::fuzzing::protobuf_request(data));

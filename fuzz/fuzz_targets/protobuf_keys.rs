//! Fuzz target: oipgate::fuzzing::protobuf_keys.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::fuzzing::protobuf_keys(data));

//! Fuzz target: oipgate::fuzzing::generate_answer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::fuzzing::generate_answer(data));

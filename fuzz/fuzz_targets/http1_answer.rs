//! Fuzz target: oipgate::fuzzing::http1_answer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| oipgate::fuzzing::http1_answer(data));

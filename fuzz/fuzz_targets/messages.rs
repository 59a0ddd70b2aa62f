//! Fuzz target: see `perseus::fuzzing::messages`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| perseus::fuzzing::messages(data));

//! Fuzz target: see `perseus::fuzzing::config`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| perseus::fuzzing::config(data));

//! Fuzz target: see `perseus::fuzzing::frames`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| perseus::fuzzing::frames(data));

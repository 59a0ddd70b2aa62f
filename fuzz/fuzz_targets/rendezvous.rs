//! Fuzz target: see `perseus::fuzzing::rendezvous`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| perseus::fuzzing::rendezvous(data));

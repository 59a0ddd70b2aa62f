//! Rules of the Rust source that no single feature's test would notice breaking.

use std::fs;
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn only_env_rs_reads_the_process_environment() {
    // Every variable is read through src/env.rs (the configuration, the logger and the
    // GPU library search alike), so tests and the fuzz target can give a thread its own.
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(
        files.len() > 50,
        "found only {} files under {src:?}",
        files.len()
    );
    let readers: Vec<String> = files
        .iter()
        .filter(|p| !p.ends_with("src/env.rs"))
        .filter(|p| {
            // std::env::var, var_os, vars, vars_os, or any of them after `use std::env`.
            let text = fs::read_to_string(p).unwrap();
            text.contains("std::env::var") || text.contains("use std::env")
        })
        .map(|p| p.strip_prefix(&src).unwrap().display().to_string())
        .collect();
    assert!(
        readers.is_empty(),
        "read the environment past src/env.rs: {readers:?}"
    );
}

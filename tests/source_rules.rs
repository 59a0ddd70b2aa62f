//! Rules of the Rust source that no single feature's test would notice breaking.

use std::collections::{BTreeMap, BTreeSet};
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

/// A file's module path below `src` (`engine/mod.rs` is `engine`, `lib.rs` the root).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// The code of a file that builds outside tests: comments dropped, and the inline
/// `mod tests` cut off (tests may reach any layer).
fn code_of(text: &str) -> String {
    let body = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    body.lines()
        .map(|l| match l.find("//") {
            Some(at) => &l[..at],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn ident_at(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// The first one or two path segments after each `prefix` (`crate::` or `super::`),
/// braces included: `crate::{a::b, c}` names `[a, b]` and `[c]`.
fn paths_after(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices(prefix) {
        if code[..at].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[at + prefix.len()..];
        let items: Vec<&str> = if let Some(inner) = rest.strip_prefix('{') {
            let mut depth = 1;
            let end = inner
                .char_indices()
                .find(|&(_, c)| {
                    depth += match c {
                        '{' => 1,
                        '}' => -1,
                        _ => 0,
                    };
                    depth == 0
                })
                .map_or(inner.len(), |(i, _)| i);
            let mut parts = Vec::new();
            let (mut depth, mut start) = (0, 0);
            for (i, c) in inner[..end].char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        parts.push(inner[start..i].trim());
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            parts.push(inner[start..end].trim());
            parts
        } else {
            vec![rest]
        };
        for item in items {
            let first = ident_at(item);
            if first.is_empty() || first == "self" {
                continue;
            }
            let mut path = vec![first.clone()];
            if let Some(more) = item[first.len()..].strip_prefix("::") {
                let second = ident_at(more);
                if !second.is_empty() {
                    path.push(second);
                }
            }
            out.push(path);
        }
    }
    out
}

/// A cycle of `graph`, if it has one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, done, path) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut done, &mut Vec::new()))
}

#[test]
fn no_module_depends_on_a_module_that_depends_on_it() {
    // The layers point only down: between the crate's top-level modules, and between
    // the submodules of each. Tests (files named *tests.rs and inline `mod tests`) may
    // reach anything and are left out.
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut top: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut inner: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    let is_module = |path: &[String]| {
        let dir = path.iter().fold(src.clone(), |d, p| d.join(p));
        dir.is_dir() || dir.with_extension("rs").is_file()
    };
    let mut edges = 0;
    for file in &files {
        let name = file.file_name().unwrap().to_string_lossy();
        if name.ends_with("tests.rs") {
            continue;
        }
        let me = module_of(&src, file);
        if me.is_empty() {
            continue;
        }
        let code = code_of(&fs::read_to_string(file).unwrap());
        let mut targets = paths_after(&code, "crate::");
        for p in paths_after(&code, "super::") {
            // `super` of a file's module: its parent.
            let mut abs = me[..me.len() - 1].to_vec();
            abs.extend(p);
            targets.push(abs);
        }
        for t in targets {
            if t.is_empty() || !is_module(&t[..1]) {
                continue;
            }
            edges += 1;
            if t[0] != me[0] {
                top.entry(me[0].clone()).or_default().insert(t[0].clone());
            } else if me.len() > 1 && t.len() > 1 && t[1] != me[1] && is_module(&t[..2]) {
                inner
                    .entry(me[0].clone())
                    .or_default()
                    .entry(me[1].clone())
                    .or_default()
                    .insert(t[1].clone());
            }
        }
    }
    assert!(edges > 200, "found only {edges} references between modules");
    assert!(top["engine"].contains("device"), "{top:?}");
    assert_eq!(find_cycle(&top), None, "a cycle among src/'s modules");
    for (parent, graph) in &inner {
        assert_eq!(
            find_cycle(graph),
            None,
            "a cycle among the modules of src/{parent}"
        );
    }
}

#[test]
fn tests_are_the_tests_child_of_the_module_they_test() {
    // One layout: a module's tests are its child `tests`, inline (`mod tests { .. }`) or
    // in `<module>/tests.rs` (`tests.rs` beside a `mod.rs`). So the test of a module is
    // found where the module is, and no file is renamed by a #[path].
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let misplaced: Vec<String> = files
        .iter()
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            let text = fs::read_to_string(p).unwrap();
            (name.ends_with("tests.rs") && name != "tests.rs")
                || text.contains("#[path")
                || text.lines().any(|l| {
                    let l = l.trim_start();
                    l.starts_with("mod ") && l.contains("_tests")
                })
        })
        .map(|p| p.strip_prefix(&src).unwrap().display().to_string())
        .collect();
    assert!(
        misplaced.is_empty(),
        "tests outside the layout: {misplaced:?}"
    );
}

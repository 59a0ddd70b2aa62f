use super::*;
use std::collections::HashSet;

const DOC: &str = include_str!("../../docs/environment.md");

/// The rows of docs/environment.md's tables of settings (variable, default, allowed,
/// effect): each variable and its row.
fn documented_settings() -> Vec<(&'static str, &'static str)> {
    DOC.lines()
        .filter(|l| l.starts_with("| `") && l.matches(" | ").count() >= 3)
        .filter_map(|l| {
            let name = l.strip_prefix("| `")?.split('`').next()?;
            Some((name, l))
        })
        .collect()
}

#[test]
fn every_setting_is_documented_with_its_default() {
    let rows = documented_settings();
    for p in PARAMS {
        let (_, row) = rows
            .iter()
            .find(|(n, _)| *n == p.name)
            .unwrap_or_else(|| panic!("{} has no row in docs/environment.md", p.name));
        let default = match p.default_text() {
            t if t.is_empty() => "unset".to_string(),
            t => t,
        };
        assert!(
            row.contains(&format!("| {default}")),
            "{}: default {default} not in {row}",
            p.name
        );
    }
}

#[test]
fn every_documented_setting_is_in_the_table() {
    let known: HashSet<&str> = PARAMS
        .iter()
        .flat_map(|p| std::iter::once(p.name).chain(p.aliases.iter().copied()))
        .collect();
    let rows = documented_settings();
    assert!(rows.len() > 60, "found only {} rows", rows.len());
    for (name, row) in rows {
        assert!(
            known.contains(name),
            "{name} is documented but not in src/params: {row}"
        );
    }
}

#[test]
fn names_and_aliases_are_each_one_settings() {
    let mut seen = HashSet::new();
    for p in PARAMS {
        for n in std::iter::once(p.name).chain(p.aliases.iter().copied()) {
            assert!(seen.insert(n), "{n} is declared twice");
        }
        assert!(!p.doc.is_empty(), "{} has no doc", p.name);
    }
}

#[test]
fn every_default_is_one_of_its_settings_values() {
    for p in PARAMS {
        let Some(want) = p.default_value() else {
            continue;
        };
        let text = p.default_text();
        assert_eq!(p.parse(p.name, &text).ok(), Some(want), "{}", p.name);
    }
}

#[test]
fn the_allowed_values_are_said_in_words_from_the_kind() {
    let words = |name| param(name).allowed();
    assert_eq!(
        words("GLOO_TIMEOUT_SECONDS"),
        "an integer from 1 to 86400 (seconds)"
    );
    assert_eq!(
        words("HOROVOD_FUSION_THRESHOLD"),
        "an integer >= 0 (bytes; 0 disables fusion)"
    );
    assert_eq!(
        words("PERSEUS_ALLREDUCE_GRADIENT_SCALE"),
        "a number greater than 0 and at most 65504"
    );
    assert_eq!(words("PERSEUS_SHM"), "0 or 1");
    assert_eq!(words("PERSEUS_DGC"), "0 or 1 (or true/false)");
    assert_eq!(words("PERSEUS_CLIP_GRAD_FUNC"), "norm or value");
    assert_eq!(
        words("PERSEUS_CLIP_GRAD_FUNC_PARAMS"),
        "a number greater than 0"
    );
    assert_eq!(
        words("PERSEUS_DGC_WARMUP_COEFF"),
        "numbers separated by spaces, each greater than 0 and at most 1"
    );
    assert_eq!(
        words("PERSEUS_LOG_LEVEL"),
        "TRACE, DEBUG, INFO, WARNING, ERROR or FATAL (any case)"
    );
    assert_eq!(words("PERSEUS_TIMELINE"), "a file path");
}

#[test]
fn a_value_is_read_under_the_name_else_an_alias_and_an_error_names_where_it_came_from() {
    let p = param("GLOO_TIMEOUT_SECONDS");
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |n: &str| {
            pairs
                .iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.to_string())
        }
    };
    assert_eq!(p.read_with(&env(&[])).unwrap(), None);
    let alias = env(&[("HOROVOD_GLOO_TIMEOUT_SECONDS", "30")]);
    assert_eq!(p.read_with(&alias).unwrap(), Some(Value::Int(30)));
    let both = env(&[
        ("HOROVOD_GLOO_TIMEOUT_SECONDS", "30"),
        ("GLOO_TIMEOUT_SECONDS", "45"),
    ]);
    assert_eq!(p.read_with(&both).unwrap(), Some(Value::Int(45)));
    let bad = env(&[("HOROVOD_GLOO_TIMEOUT_SECONDS", "0")]);
    let e = p.read_with(&bad).unwrap_err().to_string();
    assert!(
        e.contains("HOROVOD_GLOO_TIMEOUT_SECONDS")
            && e.contains("\"0\"")
            && e.contains("an integer from 1 to 86400"),
        "{e}"
    );
}

#[test]
fn each_kind_refuses_what_is_not_its_own() {
    let refused = |name: &str, text: &str| param(name).parse(name, text).is_err();
    for text in ["2", "true", "-1", "1.0", "01x"] {
        assert!(refused("PERSEUS_SHM", text), "{text}");
    }
    for text in ["-1", "1025", "1.5", "1e3", "18446744073709551616"] {
        assert!(refused("PERSEUS_ACCUMULATE_N_STEPS", text), "{text}");
    }
    for text in ["0", "-1", "inf", "nan", "65505", "1e400"] {
        assert!(refused("PERSEUS_ALLREDUCE_GRADIENT_SCALE", text), "{text}");
    }
    for text in ["0.5 0", "0.5,2", ",", "a"] {
        assert!(refused("PERSEUS_DGC_WARMUP_COEFF", text), "{text}");
    }
    assert!(refused("PERSEUS_LOG_LEVEL", "LOUD"));
    let level = param("PERSEUS_LOG_LEVEL").parse("PERSEUS_LOG_LEVEL", "debug");
    assert_eq!(level.unwrap(), Value::Text("DEBUG".into()));
    let ratios = param("PERSEUS_DGC_WARMUP_COEFF").parse("X", "0.5,0.25 0.125");
    assert_eq!(ratios.unwrap(), Value::Floats(vec![0.5, 0.25, 0.125]));
}

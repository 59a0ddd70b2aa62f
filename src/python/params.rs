//! The table of settings for the Python side (`_core.params()`), which builds its reader
//! (`perseus.common.knobs`) and the launcher's flag ranges from it.

use crate::params::{Default, Kind, Scope, PARAMS};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Every setting, as a dict: `name`, `aliases`, `kind` (flag, int, float, ratios,
/// choice or text), `low` and `high` (numbers; None where the kind has none),
/// `low_open`, `choices`, `default` (None when unset), `scope` (core, python or
/// launcher), `allowed` (in words) and `doc`.
#[pyfunction]
pub fn params(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    PARAMS
        .iter()
        .map(|p| {
            let d = PyDict::new(py);
            d.set_item("name", p.name)?;
            d.set_item("aliases", p.aliases.to_vec())?;
            let (kind, open, choices): (_, _, &[&str]) = match p.kind {
                Kind::Flag => ("flag", false, &[]),
                Kind::Int { min, max } => {
                    // Integers as integers: a float would round u64::MAX up.
                    d.set_item("low", min)?;
                    d.set_item("high", max)?;
                    ("int", false, &[])
                }
                Kind::Float { min, max, open } | Kind::Ratios { min, max, open } => {
                    d.set_item("low", min)?;
                    d.set_item("high", max)?;
                    let ratios = matches!(p.kind, Kind::Ratios { .. });
                    (if ratios { "ratios" } else { "float" }, open, &[])
                }
                Kind::Choice(words) => ("choice", false, words),
                Kind::Text => ("text", false, &[]),
            };
            if !d.contains("low")? {
                d.set_item("low", py.None())?;
                d.set_item("high", py.None())?;
            }
            d.set_item("kind", kind)?;
            d.set_item("low_open", open)?;
            d.set_item("choices", choices.to_vec())?;
            match p.default {
                Default::Unset => d.set_item("default", py.None())?,
                Default::Flag(b) => d.set_item("default", b)?,
                Default::Int(n) => d.set_item("default", n)?,
                Default::Float(x) => d.set_item("default", x)?,
                Default::Text(t) => d.set_item("default", t)?,
            }
            let scope = match p.scope {
                Scope::Core => "core",
                Scope::Python => "python",
                Scope::Launcher => "launcher",
            };
            d.set_item("scope", scope)?;
            d.set_item("allowed", p.allowed())?;
            d.set_item("doc", p.doc)?;
            Ok(d)
        })
        .collect()
}

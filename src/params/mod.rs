//! Every setting Perseus reads from the environment, declared once ([`PARAMS`]): its
//! kind and range, its typed default, the other names it is read under, who acts on it
//! (the core, the Python side or the launcher) and one line on what it does.
//!
//! The core reads its settings only through this module ([`flag`], [`int`], [`float`],
//! [`text`] and their `_opt` forms), which parse and check them the same way for every
//! setting: a value that is not one of the setting's is an
//! [`PerseusError::InvalidConfig`] naming the variable it came from (an alias, say), the
//! value and the allowed values in words ([`Param::allowed`]). The Python side builds
//! its own reader from the same table (`_core.params()`, `perseus.common.knobs`), the
//! launcher takes its flags' ranges from it, and `docs/environment.md` is checked
//! against it both ways.

mod table;

pub use table::{LANE_MAX_BYTES, PARAMS};

use crate::error::{PerseusError, Result};

/// Who acts on a setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The core, at `init()`.
    Core,
    /// The Python side (front-ends and their optimizers), where it uses it.
    Python,
    /// perseusrun, as it starts a job.
    Launcher,
}

/// What a setting's values are.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    /// 0 or 1 (the Python side's also take true/false and yes/no).
    Flag,
    /// An integer from `min` to `max`.
    Int {
        /// The least allowed.
        min: u64,
        /// The largest allowed (`u64::MAX`: no bound).
        max: u64,
    },
    /// A finite number from `min` (excluded when `open`) to `max`.
    Float {
        /// The least allowed.
        min: f64,
        /// The largest allowed (infinite: no bound).
        max: f64,
        /// Whether `min` itself is refused.
        open: bool,
    },
    /// Numbers separated by spaces or commas, each as [`Kind::Float`] says.
    Ratios {
        /// The least allowed.
        min: f64,
        /// The largest allowed.
        max: f64,
        /// Whether `min` itself is refused.
        open: bool,
    },
    /// One of these words, in any case.
    Choice(&'static [&'static str]),
    /// Any text: a path, an interface name, a list the reader parses.
    Text,
}

/// A setting's value when it is not set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Default {
    /// None: unset has a meaning of its own (automatic, off), which the doc says.
    Unset,
    /// A flag's.
    Flag(bool),
    /// An integer's.
    Int(u64),
    /// A number's.
    Float(f64),
    /// A choice's or a text's.
    Text(&'static str),
}

/// One setting.
#[derive(Debug)]
pub struct Param {
    /// The variable.
    pub name: &'static str,
    /// Other spellings read when `name` is unset, in order (Horovod's, a seed's).
    pub aliases: &'static [&'static str],
    /// What its values are.
    pub kind: Kind,
    /// Its value when unset.
    pub default: Default,
    /// Who acts on it.
    pub scope: Scope,
    /// Words after the kind's in [`Param::allowed`] (for [`Kind::Text`], all of them).
    pub note: &'static str,
    /// One line on its effect.
    pub doc: &'static str,
}

/// A value read, typed by its setting's kind.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A flag's.
    Flag(bool),
    /// An integer's.
    Int(u64),
    /// A number's, or each of a list's.
    Floats(Vec<f64>),
    /// A choice's (as the table spells it) or a text's (trimmed).
    Text(String),
}

/// A number as the allowed values write it (`0.000001`, `65504`).
fn number(x: f64) -> String {
    format!("{x}")
}

impl Param {
    /// The allowed values, in words: what errors and the docs say.
    pub fn allowed(&self) -> String {
        let range = |min: f64, max: f64, open: bool| match (open, max.is_finite()) {
            (false, false) => format!(">= {}", number(min)),
            (true, false) => format!("greater than {}", number(min)),
            (false, true) => format!("from {} to {}", number(min), number(max)),
            (true, true) => format!("greater than {} and at most {}", number(min), number(max)),
        };
        let base = match self.kind {
            Kind::Flag if self.scope == Scope::Core => "0 or 1".to_string(),
            Kind::Flag => "0 or 1 (or true/false)".to_string(),
            Kind::Int { min, max } if max == u64::MAX => format!("an integer >= {min}"),
            Kind::Int { min, max } => format!("an integer from {min} to {max}"),
            Kind::Float { min, max, open } => format!("a number {}", range(min, max, open)),
            Kind::Ratios { min, max, open } => {
                format!(
                    "numbers separated by spaces, each {}",
                    range(min, max, open)
                )
            }
            Kind::Choice(words) => match words.split_last() {
                Some((last, [])) => last.to_string(),
                Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
                None => String::new(),
            },
            Kind::Text => String::new(),
        };
        match (base.is_empty(), self.note.is_empty()) {
            (_, true) => base,
            (true, false) => self.note.to_string(),
            (false, false) => format!("{base} {}", self.note),
        }
    }

    /// The default as a user would write it ("" when unset).
    pub fn default_text(&self) -> String {
        match self.default {
            Default::Unset => String::new(),
            Default::Flag(b) => u8::from(b).to_string(),
            Default::Int(n) => n.to_string(),
            Default::Float(x) => number(x),
            Default::Text(t) => t.to_string(),
        }
    }

    /// Parses `text` (trimmed, not empty) as read from `var` (this setting's name or an
    /// alias); an error names `var`.
    pub fn parse(&self, var: &str, text: &str) -> Result<Value> {
        let bad = || PerseusError::InvalidConfig {
            var: var.into(),
            value: text.into(),
            allowed: self.allowed(),
        };
        let within = |x: f64, min: f64, max: f64, open: bool| {
            x.is_finite() && x <= max && if open { x > min } else { x >= min }
        };
        let float = |t: &str| t.parse::<f64>().ok();
        match self.kind {
            Kind::Flag => match text {
                "0" => Ok(Value::Flag(false)),
                "1" => Ok(Value::Flag(true)),
                _ => Err(bad()),
            },
            Kind::Int { min, max } => match text.parse::<u64>() {
                Ok(n) if (min..=max).contains(&n) => Ok(Value::Int(n)),
                _ => Err(bad()),
            },
            Kind::Float { min, max, open } => match float(text) {
                Some(x) if within(x, min, max, open) => Ok(Value::Floats(vec![x])),
                _ => Err(bad()),
            },
            Kind::Ratios { min, max, open } => {
                let xs: Option<Vec<f64>> = text
                    .split([' ', ','])
                    .filter(|p| !p.is_empty())
                    .map(|p| float(p).filter(|&x| within(x, min, max, open)))
                    .collect();
                match xs {
                    Some(xs) if !xs.is_empty() => Ok(Value::Floats(xs)),
                    _ => Err(bad()),
                }
            }
            Kind::Choice(words) => words
                .iter()
                .find(|w| w.eq_ignore_ascii_case(text))
                .map(|w| Value::Text(w.to_string()))
                .ok_or_else(bad),
            Kind::Text => Ok(Value::Text(text.into())),
        }
    }

    /// The value in the environment `get` reads (under the name, else the first alias
    /// set), parsed; `None` when none is set.
    pub fn read_with(&self, get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Value>> {
        for var in std::iter::once(&self.name).chain(self.aliases) {
            if let Some(v) = get(var) {
                return self.parse(var, &v).map(Some);
            }
        }
        Ok(None)
    }

    /// The default as a value (`None` when unset).
    pub fn default_value(&self) -> Option<Value> {
        match self.default {
            Default::Unset => None,
            Default::Flag(b) => Some(Value::Flag(b)),
            Default::Int(n) => Some(Value::Int(n)),
            Default::Float(x) => Some(Value::Floats(vec![x])),
            Default::Text(t) => Some(Value::Text(t.into())),
        }
    }
}

/// The setting `name`. Every name the code reads is in the table (a test reads each
/// one), so an unknown one is a bug in Perseus.
pub fn param(name: &str) -> &'static Param {
    PARAMS
        .iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("{name} is not in the table of settings (src/params)"))
}

/// Setting `name` from the environment (through [`crate::env::var`]), else its default.
fn read(name: &str) -> Result<Option<Value>> {
    let p = param(name);
    Ok(p.read_with(&crate::env::var)?.or_else(|| p.default_value()))
}

/// Whether `name`, or one of its aliases, is set.
pub fn is_set(name: &str) -> bool {
    let p = param(name);
    std::iter::once(&p.name)
        .chain(p.aliases)
        .any(|v| crate::env::var(v).is_some())
}

/// A bug in Perseus: `name` read as a kind, or with a default, that its entry does
/// not give. Every setting the core reads is read by the config tests, which find it.
fn misread(name: &str, what: &str) -> ! {
    panic!("{name} is read as {what}, which its entry in src/params/table.rs does not give")
}

/// A flag setting; `None` when unset with no default.
pub fn flag_opt(name: &str) -> Result<Option<bool>> {
    match read(name)? {
        Some(Value::Flag(b)) => Ok(Some(b)),
        None => Ok(None),
        Some(_) => misread(name, "a flag"),
    }
}

/// A flag setting with a default.
pub fn flag(name: &str) -> Result<bool> {
    Ok(flag_opt(name)?.unwrap_or_else(|| misread(name, "a flag with a default")))
}

/// An integer setting; `None` when unset with no default.
pub fn int_opt(name: &str) -> Result<Option<u64>> {
    match read(name)? {
        Some(Value::Int(n)) => Ok(Some(n)),
        None => Ok(None),
        Some(_) => misread(name, "an integer"),
    }
}

/// An integer setting with a default.
pub fn int(name: &str) -> Result<u64> {
    Ok(int_opt(name)?.unwrap_or_else(|| misread(name, "an integer with a default")))
}

/// A number setting with a default (a list's first number).
pub fn float(name: &str) -> Result<f64> {
    match read(name)? {
        Some(Value::Floats(xs)) if !xs.is_empty() => Ok(xs[0]),
        None => misread(name, "a number with a default"),
        Some(_) => misread(name, "a number"),
    }
}

/// A choice or text setting; `None` when unset with no default.
pub fn text(name: &str) -> Result<Option<String>> {
    match read(name)? {
        Some(Value::Text(t)) => Ok(Some(t)),
        None => Ok(None),
        Some(_) => misread(name, "text"),
    }
}

#[cfg(test)]
mod tests;

//! The one reader of the process environment. The configuration (`config/`) parses
//! and checks what it reads; the logger and the GPU library search read through here
//! too, since they act before a configuration exists. Tests and the fuzz target can
//! hand a thread a map to read instead ([`with_vars`]).

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::ffi::OsString;

/// The values [`var`] reads instead of the process environment, and the names it
/// was asked for.
type Given = (HashMap<String, String>, BTreeSet<String>);

thread_local! {
    /// Set by [`with_vars`] on this thread.
    static GIVEN: RefCell<Option<Given>> = const { RefCell::new(None) };
}

/// The given value of `name` on this thread (`Some(None)`: given, and unset), else
/// None to read the process environment.
fn given(name: &str) -> Option<Option<String>> {
    GIVEN.with(|g| {
        g.borrow_mut().as_mut().map(|(values, asked)| {
            asked.insert(name.to_string());
            values.get(name).cloned()
        })
    })
}

/// Reads a variable, trimmed, treating empty as unset.
pub fn var(name: &str) -> Option<String> {
    given(name)
        .unwrap_or_else(|| std::env::var(name).ok())
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// Reads a variable as the operating system gives it (a path or a list of paths),
/// treating empty as unset.
pub fn var_os(name: &str) -> Option<OsString> {
    given(name)
        .map(|v| v.map(OsString::from))
        .unwrap_or_else(|| std::env::var_os(name))
        .filter(|v| !v.is_empty())
}

/// Runs `f` with [`var`] and [`var_os`] reading `values` (and nothing else) on this
/// thread instead of the process environment; returns what `f` returned and every
/// name it read. The configuration's fuzz target and tests use it.
#[doc(hidden)]
pub fn with_vars<T>(
    values: HashMap<String, String>,
    f: impl FnOnce() -> T,
) -> (T, BTreeSet<String>) {
    GIVEN.with(|g| *g.borrow_mut() = Some((values, BTreeSet::new())));
    let out = f();
    let asked = GIVEN.with(|g| g.borrow_mut().take().map(|(_, a)| a).unwrap_or_default());
    (out, asked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_values_are_read_instead_of_the_environment_and_the_names_kept() {
        let values = HashMap::from([
            ("A_SET".to_string(), " 7 ".to_string()),
            ("A_BLANK".to_string(), "  ".to_string()),
            ("A_PATHS".to_string(), "/x:/y".to_string()),
        ]);
        let (read, asked) = with_vars(values, || {
            (
                var("A_SET"),
                var("A_BLANK"),
                var("PATH"), // in the process environment, but not given
                var_os("A_PATHS"),
            )
        });
        assert_eq!(
            read,
            (Some("7".into()), None, None, Some(OsString::from("/x:/y")))
        );
        assert_eq!(
            asked.into_iter().collect::<Vec<_>>(),
            ["A_BLANK", "A_PATHS", "A_SET", "PATH"]
        );
        assert!(
            var_os("PATH").is_some(),
            "the environment again after with_vars"
        );
    }
}

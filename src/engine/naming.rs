//! Names for the requests a caller left unnamed.

use std::collections::HashMap;

use super::message::OpKind;

/// Names for unnamed requests: a count per process set and kind, which every rank
/// advances alike as long as they submit alike. While a rank is joined the others may
/// submit more, so a completed join starts the set's counts again under a new prefix:
/// after it, the ranks' names agree again.
#[derive(Default)]
pub(super) struct Unnamed {
    counts: HashMap<(u32, OpKind), u64>,
    /// Joins completed per process set.
    joins: HashMap<u32, u64>,
}

impl Unnamed {
    /// The next name for an unnamed `kind` request on `ps`.
    pub(super) fn next(&mut self, ps: u32, kind: OpKind) -> String {
        let k = self.counts.entry((ps, kind)).or_default();
        *k += 1;
        let k = *k;
        let stem = if kind.has_data() {
            format!("{}.noname", kind.name())
        } else {
            kind.name().to_string()
        };
        match self.joins.get(&ps) {
            Some(j) => format!("{stem}.j{j}.{k}"),
            None => format!("{stem}.{k}"),
        }
    }

    /// A join on `ps` completed on this rank, as on every other.
    pub(super) fn joined(&mut self, ps: u32) {
        self.counts.retain(|(p, _), _| *p != ps);
        *self.joins.entry(ps).or_default() += 1;
    }
}

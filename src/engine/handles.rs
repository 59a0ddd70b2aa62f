//! Completion of asynchronous operations: a table of handles, each pending or
//! done, and a condition variable that waiters block on (no spinning).

use super::tensor::OwnedTensor;
use crate::error::{PerseusError, Result};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// What a finished operation hands back.
#[derive(Default)]
pub struct Output {
    /// A tensor the engine allocated, if the operation makes one.
    pub tensor: Option<OwnedTensor>,
    /// Allgather / alltoall: rows received from each rank.
    pub splits: Vec<i64>,
    /// Join: the last rank to join.
    pub value: i64,
}

enum Slot {
    Pending,
    Done(Result<Output>),
}

/// The table behind the lock.
#[derive(Default)]
struct Table {
    /// The last id handed out.
    last: u64,
    slots: HashMap<u64, Slot>,
    /// Waiters blocked on the condition variable: completions skip the
    /// wake-up system call while there are none.
    sleepers: usize,
}

/// All handles of one engine.
#[derive(Default)]
pub struct Handles {
    table: Mutex<Table>,
    changed: Condvar,
}

impl Handles {
    /// The table, even after a panic elsewhere poisoned the lock (its data
    /// stays consistent: every change is one assignment).
    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Finishes every pending handle with `err` (the engine thread died).
    pub fn fail_pending(&self, err: &PerseusError) {
        let mut g = self.table();
        for s in g.slots.values_mut() {
            if matches!(s, Slot::Pending) {
                *s = Slot::Done(Err(err.clone()));
            }
        }
        self.changed.notify_all();
    }

    /// A new pending handle.
    pub fn create(&self) -> u64 {
        let mut g = self.table();
        g.last += 1;
        let id = g.last;
        g.slots.insert(id, Slot::Pending);
        id
    }

    /// Marks `id` finished and wakes waiters.
    pub fn complete(&self, id: u64, result: Result<Output>) {
        let mut g = self.table();
        if let Some(s) = g.slots.get_mut(&id) {
            *s = Slot::Done(result);
        }
        if g.sleepers > 0 {
            self.changed.notify_all();
        }
    }

    /// True once `id` finished (or if it is unknown).
    pub fn poll(&self, id: u64) -> bool {
        !matches!(self.table().slots.get(&id), Some(Slot::Pending))
    }

    /// Blocks until `id` finishes, waking every `tick` to let `interrupted`
    /// cancel the wait, after yielding the core for up to `spin`; removes the
    /// handle and returns its result.
    pub fn wait(
        &self,
        id: u64,
        tick: Duration,
        spin: Duration,
        mut interrupted: impl FnMut() -> Option<PerseusError>,
    ) -> Result<Output> {
        // Small operations finish within microseconds: yield the core for a
        // while before parking, since a parked thread on an idle virtual CPU
        // takes tens of microseconds to wake.
        let start = Instant::now();
        while start.elapsed() < spin && matches!(self.table().slots.get(&id), Some(Slot::Pending)) {
            std::thread::yield_now();
        }
        let mut g = self.table();
        loop {
            match g.slots.get(&id) {
                None => {
                    return Err(PerseusError::InvalidArgument(format!(
                        "handle {id} is unknown or was already synchronized"
                    )))
                }
                Some(Slot::Done(_)) => match g.slots.remove(&id) {
                    Some(Slot::Done(r)) => return r,
                    _ => unreachable!(),
                },
                Some(Slot::Pending) => {
                    g.sleepers += 1;
                    g = self
                        .changed
                        .wait_timeout(g, tick)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                    g.sleepers -= 1;
                    if let Some(e) = interrupted() {
                        return Err(e);
                    }
                }
            }
        }
    }
}

//! Completion of asynchronous operations: a table of handles, each pending or
//! done, and a condition variable that waiters block on (no spinning).

use super::tensor::OwnedTensor;
use crate::error::{PerseusError, Result};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a waiter stays awake before it parks.
const SPIN: Duration = Duration::from_micros(100);

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

/// All handles of one engine.
#[derive(Default)]
pub struct Handles {
    slots: Mutex<(u64, HashMap<u64, Slot>)>,
    changed: Condvar,
}

impl Handles {
    /// A new pending handle.
    pub fn create(&self) -> u64 {
        let mut g = self.slots.lock().unwrap();
        g.0 += 1;
        let id = g.0;
        g.1.insert(id, Slot::Pending);
        id
    }

    /// Marks `id` finished and wakes waiters.
    pub fn complete(&self, id: u64, result: Result<Output>) {
        let mut g = self.slots.lock().unwrap();
        if let Some(s) = g.1.get_mut(&id) {
            *s = Slot::Done(result);
        }
        self.changed.notify_all();
    }

    /// True once `id` finished (or if it is unknown).
    pub fn poll(&self, id: u64) -> bool {
        !matches!(self.slots.lock().unwrap().1.get(&id), Some(Slot::Pending))
    }

    /// Blocks until `id` finishes, waking every `tick` to let `interrupted`
    /// cancel the wait; removes the handle and returns its result.
    pub fn wait(
        &self,
        id: u64,
        tick: Duration,
        mut interrupted: impl FnMut() -> Option<PerseusError>,
    ) -> Result<Output> {
        // Small operations finish within microseconds: yield the core for a
        // while before parking, since a parked thread on an idle virtual CPU
        // takes tens of microseconds to wake.
        let start = Instant::now();
        while start.elapsed() < SPIN
            && matches!(self.slots.lock().unwrap().1.get(&id), Some(Slot::Pending))
        {
            std::thread::yield_now();
        }
        let mut g = self.slots.lock().unwrap();
        loop {
            match g.1.get(&id) {
                None => {
                    return Err(PerseusError::InvalidArgument(format!(
                        "handle {id} is unknown or was already synchronized"
                    )))
                }
                Some(Slot::Done(_)) => match g.1.remove(&id) {
                    Some(Slot::Done(r)) => return r,
                    _ => unreachable!(),
                },
                Some(Slot::Pending) => {
                    g = self.changed.wait_timeout(g, tick).unwrap().0;
                    if let Some(e) = interrupted() {
                        return Err(e);
                    }
                }
            }
        }
    }
}

//! Completion of asynchronous operations: a table of handles, each pending or
//! done, and a condition variable that waiters block on (no spinning).

use crate::device::OwnedTensor;
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

    /// A new id with no slot: for an operation done before anyone could wait on it,
    /// which [`Handles::insert_done`] may give a slot.
    pub fn reserve(&self) -> u64 {
        let mut g = self.table();
        g.last += 1;
        g.last
    }

    /// Gives reserved `id` a slot that is already done.
    pub fn insert_done(&self, id: u64, result: Result<Output>) {
        self.table().slots.insert(id, Slot::Done(result));
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
                    if !matches!(g.slots.get(&id), Some(Slot::Pending)) {
                        continue;
                    }
                    // Ask without the lock: `interrupted` may block (Python's lock, held
                    // by a thread that is creating a handle and so waits for this one).
                    drop(g);
                    if let Some(e) = interrupted() {
                        return Err(e);
                    }
                    g = self.table();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::sync::Arc;
    use std::thread;

    #[test]
    fn a_waiters_interrupt_check_does_not_hold_the_table() {
        // The Python front-end's check takes the GIL; the thread holding the GIL may be
        // creating a handle at that moment. Here a plain lock stands in for the GIL.
        let handles = Arc::new(Handles::default());
        let gil = Arc::new(Mutex::new(()));
        let id = handles.create();
        let held = gil.lock().unwrap();
        let waiter = {
            let (handles, gil) = (handles.clone(), gil.clone());
            thread::spawn(move || {
                handles.wait(id, Duration::from_millis(5), Duration::ZERO, || {
                    drop(gil.lock().unwrap());
                    None
                })
            })
        };
        thread::sleep(Duration::from_millis(50)); // the waiter now blocks on `gil`
        let (tx, rx) = mpsc::channel();
        let creator = {
            let handles = handles.clone();
            thread::spawn(move || tx.send(handles.create()).unwrap())
        };
        let created = rx.recv_timeout(Duration::from_secs(5));
        drop(held);
        assert!(
            created.is_ok(),
            "create() blocked behind a waiter's interrupt check"
        );
        handles.complete(
            id,
            Ok(Output {
                value: 7,
                ..Output::default()
            }),
        );
        assert_eq!(waiter.join().unwrap().unwrap().value, 7);
        creator.join().unwrap();
    }

    #[test]
    fn an_interrupt_ends_the_wait_and_a_completion_ends_it_without_asking() {
        let handles = Handles::default();
        let id = handles.create();
        let err = handles
            .wait(id, Duration::from_millis(1), Duration::ZERO, || {
                Some(PerseusError::Aborted("interrupted".into()))
            })
            .err()
            .unwrap();
        assert!(err.to_string().contains("interrupted"), "{err}");
        handles.complete(id, Ok(Output::default()));
        let asked = std::cell::Cell::new(0);
        handles
            .wait(id, Duration::from_millis(1), Duration::ZERO, || {
                asked.set(asked.get() + 1);
                None
            })
            .unwrap();
        assert_eq!(asked.get(), 0);
    }
}

//! The flight recorder: each rank's last [`CAPACITY`] operations (name, kind,
//! bytes, process set, when each was submitted, negotiated and finished, and how
//! it ended), kept in a bounded ring, so that a job that stops moving can say
//! what every rank was doing (`_core.flight_record()`, written out by
//! `perseus.common.flight_recorder`).

use super::message::{shape_bytes, OpKind, Request};
use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

/// How many operations a rank remembers.
pub const CAPACITY: usize = 1024;

/// Where an operation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Submitted on this rank; the coordinator has not scheduled it yet (some
    /// rank has not submitted it).
    Submitted,
    /// Negotiated: every rank submitted it, and its collective runs.
    Running,
    /// Finished with its result.
    Done,
    /// Finished with an error.
    Failed,
}

impl Stage {
    /// The stage's name, as the recorder's files write it.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Submitted => "submitted",
            Stage::Running => "running",
            Stage::Done => "done",
            Stage::Failed => "failed",
        }
    }
}

/// One operation, as the recorder keeps it; times are seconds since the Unix epoch.
#[derive(Clone, Debug)]
pub struct Record {
    /// Its name (the automatic one for unnamed operations).
    pub name: String,
    /// Its kind.
    pub kind: OpKind,
    /// Its process set.
    pub process_set: u32,
    /// Bytes of its input on this rank.
    pub bytes: usize,
    /// When this rank submitted it.
    pub submitted: f64,
    /// When it was negotiated and its collective began.
    pub started: Option<f64>,
    /// When it finished.
    pub finished: Option<f64>,
    /// Where it is.
    pub stage: Stage,
}

/// The ring. Operations are found by their handle while they are live.
#[derive(Default)]
pub struct Recorder {
    ring: Vec<(u64, Record)>,
    /// The slot the next record takes once the ring is full.
    next: usize,
    /// Handle to slot, for operations not finished yet.
    live: HashMap<u64, usize>,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Recorder {
    /// `req` was submitted under `handle`.
    pub fn submitted(&mut self, handle: u64, req: &Request) {
        let record = Record {
            name: req.name.clone(),
            kind: req.kind,
            process_set: req.process_set,
            bytes: shape_bytes(&req.shape, req.dtype),
            submitted: now(),
            started: None,
            finished: None,
            stage: Stage::Submitted,
        };
        let slot = if self.ring.len() < CAPACITY {
            self.ring.push((handle, record));
            self.ring.len() - 1
        } else {
            let slot = self.next;
            self.next = (self.next + 1) % CAPACITY;
            let (old, _) = std::mem::replace(&mut self.ring[slot], (handle, record));
            if self.live.get(&old) == Some(&slot) {
                self.live.remove(&old);
            }
            slot
        };
        self.live.insert(handle, slot);
    }

    /// The operations of `handles` were negotiated and begin.
    pub fn started(&mut self, handles: impl IntoIterator<Item = u64>) {
        let t = now();
        for h in handles {
            if let Some(&slot) = self.live.get(&h) {
                let r = &mut self.ring[slot].1;
                r.started = Some(t);
                r.stage = Stage::Running;
            }
        }
    }

    /// The operation of `handle` finished, with its result (`ok`) or an error.
    pub fn finished(&mut self, handle: u64, ok: bool) {
        if let Some(slot) = self.live.remove(&handle) {
            let r = &mut self.ring[slot].1;
            r.finished = Some(now());
            r.stage = if ok { Stage::Done } else { Stage::Failed };
        }
    }

    /// Every record, oldest first.
    pub fn snapshot(&self) -> Vec<Record> {
        let (newer, older) = self.ring.split_at(self.next.min(self.ring.len()));
        older.iter().chain(newer).map(|(_, r)| r.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_operations_with_their_stages() {
        let mut rec = Recorder::default();
        let req = |n: usize| {
            let mut r = Request::new(OpKind::Allreduce, format!("t{n}"), 0);
            r.dtype = crate::DataType::F32;
            r.shape = vec![4];
            r
        };
        for h in 0..CAPACITY as u64 + 3 {
            rec.submitted(h, &req(h as usize));
        }
        rec.started([5, 6]);
        rec.finished(5, true);
        rec.finished(CAPACITY as u64 + 2, false);
        let all = rec.snapshot();
        assert_eq!(all.len(), CAPACITY);
        assert_eq!(all[0].name, "t3", "the three oldest were dropped");
        assert_eq!(all.last().unwrap().name, format!("t{}", CAPACITY + 2));
        assert_eq!(all.last().unwrap().stage, Stage::Failed);
        let of = |n: &str| all.iter().find(|r| r.name == n).unwrap().clone();
        assert_eq!(of("t5").stage, Stage::Done);
        assert!(of("t5").started.is_some() && of("t5").finished.is_some());
        assert_eq!(of("t6").stage, Stage::Running);
        assert_eq!(of("t7").stage, Stage::Submitted);
        assert_eq!(of("t7").bytes, 16);
        // A handle whose slot was reused is forgotten, not confused with the new one.
        rec.finished(0, true);
        assert_eq!(rec.snapshot()[CAPACITY - 3].stage, Stage::Submitted);
    }

    /// What the recorder costs an operation, under the engine's locks: run with
    /// `cargo test --release --lib cost_per_operation -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn cost_per_operation() {
        let (mut rec, lock) = (Recorder::default(), std::sync::Mutex::new(()));
        let mut r = Request::new(OpKind::Allreduce, "grad.layer4.weight", 0);
        r.dtype = crate::DataType::F32;
        r.shape = vec![1024];
        let n = 1_000_000u64;
        let t = std::time::Instant::now();
        for h in 0..n {
            drop(lock.lock().unwrap());
            rec.submitted(h, &r);
            drop(lock.lock().unwrap());
            rec.started([h]);
            drop(lock.lock().unwrap());
            rec.finished(h, true);
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        eprintln!("flight recorder: {ns:.0} ns per operation");
    }
}

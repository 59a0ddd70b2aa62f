//! Time the reduction kernels run on this thread, for the timeline's REDUCE
//! phase: inside a collective they run segment by segment as data arrives,
//! so only their total can be told apart from the transfer.

use std::cell::Cell;
use std::time::{Duration, Instant};

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
    static NANOS: Cell<u64> = const { Cell::new(0) };
}

/// Starts counting on this thread from zero.
pub fn start() {
    ON.with(|c| c.set(true));
    NANOS.with(|c| c.set(0));
}

/// Stops counting; returns the time counted since [`start`].
pub fn stop() -> Duration {
    ON.with(|c| c.set(false));
    Duration::from_nanos(NANOS.with(Cell::get))
}

/// Runs `f`, adding its time to the count while counting is on.
pub(crate) fn timed<R>(f: impl FnOnce() -> R) -> R {
    if !ON.with(Cell::get) {
        return f();
    }
    let t = Instant::now();
    let r = f();
    let ns = t.elapsed().as_nanos() as u64;
    NANOS.with(|c| c.set(c.get() + ns));
    r
}

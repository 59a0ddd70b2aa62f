//! Output buffers kept in memory between operations.
//!
//! An out-of-place collective hands the framework a new tensor each call. A fresh
//! allocation of many megabytes is mapped anew, and touching it faults in every page,
//! which on a virtual machine costs more than the collective itself. Buffers of at
//! least [`POOL_MIN_BYTES`] therefore come from here ([`take`]) and, once the
//! framework frees the tensor made from them, come back ([`give`]) with their pages
//! still in place. At most [`POOL_KEEP_BYTES`] wait idle; the oldest go first.

use super::AlignedBuf;
use std::sync::Mutex;

/// Smallest buffer worth keeping: below it, a fresh allocation is cheap.
pub const POOL_MIN_BYTES: usize = 1 << 20;

/// Most bytes of idle buffers kept; beyond it the oldest are freed.
pub const POOL_KEEP_BYTES: usize = 512 << 20;

/// A kept buffer may exceed the request by at most this fraction of it (1/4).
const SLACK_SHIFT: u32 = 2;

struct Idle {
    /// Oldest first.
    bufs: Vec<AlignedBuf>,
    bytes: usize,
}

static IDLE: Mutex<Idle> = Mutex::new(Idle {
    bufs: Vec::new(),
    bytes: 0,
});

fn idle() -> std::sync::MutexGuard<'static, Idle> {
    // A panic while holding the lock leaves the list itself consistent.
    IDLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A buffer of `len` bytes. Its contents are unspecified when it was kept: the
/// caller overwrites all of it. A small or unmatched request gets a zeroed new one.
pub fn take(len: usize) -> AlignedBuf {
    if len >= POOL_MIN_BYTES {
        let most = len + (len >> SLACK_SHIFT);
        let mut idle = idle();
        // The smallest that fits, the most recently returned of those: its
        // lines are the likeliest to be in cache still.
        let best = idle
            .bufs
            .iter()
            .enumerate()
            .rev()
            .filter(|(_, b)| (len..=most).contains(&b.capacity()))
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        if let Some(i) = best {
            let mut b = idle.bufs.remove(i);
            idle.bytes -= b.capacity();
            drop(idle);
            b.resize(len);
            return b;
        }
    }
    AlignedBuf::zeroed(len)
}

/// Returns a buffer from [`take`] (or any other) for later calls.
pub fn give(buf: AlignedBuf) {
    let cap = buf.capacity();
    if !(POOL_MIN_BYTES..=POOL_KEEP_BYTES).contains(&cap) {
        return;
    }
    let mut idle = idle();
    idle.bytes += cap;
    idle.bufs.push(buf);
    let mut freed = Vec::new();
    while idle.bytes > POOL_KEEP_BYTES {
        let old = idle.bufs.remove(0);
        idle.bytes -= old.capacity();
        freed.push(old);
    }
    drop(idle);
    // Unmapping happens outside the lock.
    drop(freed);
}

/// Bytes of idle buffers kept now.
pub fn idle_bytes() -> usize {
    idle().bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: the pool is process-wide, and tests of one binary run in parallel.
    #[test]
    fn buffers_come_back_in_place_and_the_idle_bytes_stay_bounded() {
        let small = take(1000);
        assert_eq!(small.as_slice(), &[0u8; 1000][..]);
        give(small);

        let mut a = take(POOL_MIN_BYTES * 2);
        a.as_mut_slice()[0] = 7;
        let at = a.as_mut_ptr();
        give(a);
        // A little smaller fits the kept buffer; the same memory comes back.
        let mut b = take(POOL_MIN_BYTES * 2 - 4096);
        assert_eq!(b.as_mut_ptr(), at);
        assert_eq!(b.len(), POOL_MIN_BYTES * 2 - 4096);
        // Far smaller does not take it: it would waste most of it.
        give(b);
        let mut c = take(POOL_MIN_BYTES);
        assert_ne!(c.as_mut_ptr(), at);
        give(c);

        // Many returned buffers: only POOL_KEEP_BYTES of them stay.
        let many: Vec<AlignedBuf> = (0..(POOL_KEEP_BYTES / (8 << 20)) + 4)
            .map(|_| AlignedBuf::zeroed(8 << 20))
            .collect();
        for m in many {
            give(m);
        }
        assert!(idle_bytes() <= POOL_KEEP_BYTES);
        assert!(idle_bytes() >= POOL_KEEP_BYTES - (8 << 20));
        give(AlignedBuf::zeroed(POOL_KEEP_BYTES + 64));
        assert!(idle_bytes() <= POOL_KEEP_BYTES);
    }
}

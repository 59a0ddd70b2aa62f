//! The lane: a small exchange among every rank of a host that the callers run
//! themselves, through the host's shared segment, with no thread woken and no
//! byte on a socket. It serves blocking small allreduces of one-host jobs (see
//! `engine::lane`), where waking the engine thread costs more than the data.
//!
//! Each rank makes its attempts in the same order as the others (the decision
//! to try is a function of the operation alone, the same on every rank), so a
//! rank's attempt `j` meets the others' attempt `j`. Attempts alternate
//! between two slots. For attempt `j` a rank waits until every member finished
//! attempt `j - 2` (whose slot it reuses), writes its operation's identity and
//! its bytes into its part of the slot, and sets its bit in the slot's word.
//! The word holds the attempt's number, the members' bits and an abort bit,
//! and every change to it is one compare-and-swap, so it settles each attempt
//! one way for all: once every bit is in, the attempt is committed and no rank
//! can abort it; once the abort bit is in, no rank can join it. A rank that
//! waited its patience out sets the abort bit; a rank that finds it set, or
//! finds that another member already finished this attempt without it, gives
//! up at once. A committed attempt whose members' identities differ is given
//! up by all (they all read the same identities). A rank that gives up runs
//! the operation on the engine instead, and so does every other: the lane
//! never loses an operation and never waits past its patience, so it cannot
//! hang a job, whatever the ranks do. Ranks whose decisions differed once (a
//! setting that differs, say) are out of step; the one behind catches up at its
//! next attempt, skipping to the one ahead ([`Lane::catch_up`]).

use super::shm::{Layout, Segment, LINE};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Bytes of data in each member's part of a slot: the largest exchange (the largest
/// PERSEUS_LANE_BYTES).
pub const DATA_BYTES: usize = crate::params::LANE_MAX_BYTES as usize;

/// Most members a lane serves (one bit each in a slot's word).
pub const MAX_MEMBERS: usize = 31;

/// Bytes before the data in each member's part, for a header of up to one u64 a
/// member (an alltoall's row counts), rounded to whole cache lines.
pub const HEAD_BYTES: usize = (MAX_MEMBERS * 8).div_ceil(LINE) * LINE;

/// Bytes of each member's part of a slot: the most one exchange carries.
pub const SLOT_BYTES: usize = HEAD_BYTES + DATA_BYTES;

const ABORTED: u64 = 1 << 31;
const BITS: u64 = (1 << 31) - 1;

/// Bytes of the lane in a segment of `members` (none above [`MAX_MEMBERS`]):
/// two slot words, one line per member (its progress, its CPU, whether it is away), and
/// per member two parts of
/// [`SLOT_BYTES`], each after a line holding its identity.
pub fn bytes(members: usize) -> usize {
    if members > MAX_MEMBERS {
        return 0;
    }
    (2 + members) * LINE + 2 * members * (LINE + SLOT_BYTES)
}

/// The layout of a segment for `members` ranks, with their rings and a lane.
pub fn layout(members: usize) -> Layout {
    Layout {
        members,
        cap: super::shm::ring_cap_for(members),
        slots: super::shm::slots_for(members),
        extra: bytes(members),
    }
}

/// One member's side of an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    /// Two hashes of whatever identifies the operation: equal on every member, or
    /// the attempt is given up.
    pub hashes: [u64; 2],
    /// Bytes this member contributes (members may differ, where the hashes allow).
    pub len: usize,
}

/// One rank's end of its host's lane.
pub struct Lane {
    seg: Arc<Segment>,
    /// Offset of the lane in the segment.
    base: usize,
    me: usize,
    members: usize,
    /// The number of this rank's next attempt; its lock keeps a rank's attempts
    /// one at a time, in one order.
    next: Mutex<u64>,
    /// The joins this member has been through (entered, and is back from).
    joins_done: AtomicU64,
}

impl Lane {
    /// Member `me`'s end of the segment's lane; None where it has none.
    pub fn new(seg: Arc<Segment>, me: usize) -> Option<Lane> {
        let (base, members) = (seg.extra_offset(), seg.members());
        (bytes(members) > 0 && me < members).then(|| Lane {
            seg,
            base,
            me,
            members,
            next: Mutex::new(0),
            joins_done: AtomicU64::new(0),
        })
    }

    /// Members of the lane.
    pub fn members(&self) -> usize {
        self.members
    }

    /// This rank's place among the members.
    pub fn me(&self) -> usize {
        self.me
    }

    fn slot_word(&self, parity: usize) -> &AtomicU64 {
        self.seg.word64(self.base + parity * LINE)
    }

    /// The number of attempts `member` has finished.
    fn passed(&self, member: usize) -> &AtomicU64 {
        self.seg.word64(self.base + (2 + member) * LINE)
    }

    /// The CPU `member` ran on when it last came to the lane, plus one (0: unknown).
    fn cpu(&self, member: usize) -> &AtomicU64 {
        self.seg.word64(self.base + (2 + member) * LINE + 8)
    }

    /// The number of joins `member` entered ([`Lane::step_away`]).
    fn away(&self, member: usize) -> &AtomicU64 {
        self.seg.word64(self.base + (2 + member) * LINE + 16)
    }

    /// Says which CPU this member runs on now, and that it is here; returns the
    /// attempt to make when its next is `next`: past every attempt the others made
    /// while it was away (none of them was its own), else as [`Lane::catch_up`] says.
    fn arrive(&self, next: u64) -> u64 {
        self.cpu(self.me).store(current_cpu(), Ordering::Relaxed);
        let entered = self.away(self.me).load(Ordering::Relaxed);
        if entered > self.joins_done.swap(entered, Ordering::Relaxed) {
            // Back from a join, which every member has entered, so is over for all.
            return next.max(self.furthest_other());
        }
        self.catch_up(next)
    }

    /// Says that this member makes no attempt until its next one: it waits in a join,
    /// which only the engine serves. Members that wait in an attempt for it give the
    /// attempt up at once, rather than after their patience, and it skips every
    /// attempt they made meanwhile when it is back.
    pub fn step_away(&self) {
        let entered = self.away(self.me).load(Ordering::Relaxed);
        self.away(self.me).store(entered + 1, Ordering::Release);
    }

    /// True when a member that `waited_for` says this member still waits for is in a
    /// join this member has not been through.
    fn left(&self, waited_for: impl Fn(usize) -> bool) -> bool {
        let done = self.joins_done.load(Ordering::Relaxed);
        (0..self.members)
            .any(|m| m != self.me && waited_for(m) && self.away(m).load(Ordering::Acquire) > done)
    }

    /// True when a member that `waited_for` says this member still waits for last came
    /// from the CPU this member runs on: spinning would keep it from running.
    fn crowded(&self, waited_for: impl Fn(usize) -> bool) -> bool {
        let here = current_cpu();
        here != 0
            && (0..self.members).any(|m| {
                m != self.me && waited_for(m) && self.cpu(m).load(Ordering::Relaxed) == here
            })
    }

    fn part_offset(&self, member: usize, parity: usize) -> usize {
        self.base + (2 + self.members) * LINE + (member * 2 + parity) * (LINE + SLOT_BYTES)
    }

    fn identity_words(&self, member: usize, parity: usize) -> [&AtomicU64; 3] {
        let off = self.part_offset(member, parity);
        [0, 8, 16].map(|d| self.seg.word64(off + d))
    }

    fn part(&self, member: usize, parity: usize) -> *mut u8 {
        self.seg
            .at(self.part_offset(member, parity) + LINE, SLOT_BYTES)
    }

    /// One attempt: writes this rank's `len` bytes with `fill`, waits up to
    /// `patience` for every member's, and, when all came with the same hashes,
    /// returns what `then` makes of every member's bytes (in member order, each of
    /// its own length). None: the attempt was given up, by every member alike.
    /// `yielding`: give the core away while waiting (more ranks than cores); a member
    /// also gives it away while a member it waits for last came from its CPU, since
    /// spinning there would keep that one from coming (two ranks the scheduler put on
    /// one core, between busy processes, took a time slice each operation).
    pub fn exchange<R>(
        &self,
        identity: Identity,
        fill: impl FnOnce(&mut [u8]),
        patience: Duration,
        yielding: bool,
        then: impl FnOnce(&[&[u8]]) -> R,
    ) -> Option<R> {
        assert!(
            identity.len <= SLOT_BYTES,
            "a lane carries {SLOT_BYTES} bytes at most"
        );
        let mut next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
        let j = self.arrive(*next);
        if j > *next {
            self.passed(self.me).store(j, Ordering::Release);
        }
        *next = j + 1;
        let deadline = Instant::now() + patience;
        let out = self.attempt(j, identity, fill, deadline, yielding, then);
        self.passed(self.me).store(j + 1, Ordering::Release);
        out
    }

    /// Passes this member's next attempt without joining it: for an operation the
    /// others may try in the lane but this member runs on the engine (an allgather
    /// whose rows pass this member's limit, a timeline recorded here only). The
    /// members waiting in that attempt see it passed and give it up at once, rather
    /// than after their patience, and the attempts stay in step.
    pub fn decline(&self) {
        let mut next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
        let j = self.arrive(*next);
        *next = j + 1;
        self.passed(self.me).store(j + 1, Ordering::Release);
    }

    /// The attempt to make when this member's next is `next`: a member that made
    /// attempts this one did not (their decisions differed once) is joined where it
    /// is, the attempts between skipped, rather than met by no one from then on. It
    /// is two attempts or more ahead, or one ahead and waiting in it while no one
    /// waits in `next` (one ahead and not waiting is a member that gave up the last
    /// attempt first, and now waits for this one on the engine).
    fn catch_up(&self, next: u64) -> u64 {
        let ahead = self.furthest_other();
        let waiting = |j: u64| {
            let w = self.slot_word((j % 2) as usize).load(Ordering::Acquire);
            w & !(ABORTED | BITS) == u64::from(j as u32) << 32 && w & BITS != 0 && w & ABORTED == 0
        };
        if ahead >= next + 2 || (ahead == next + 1 && waiting(next + 1) && !waiting(next)) {
            ahead
        } else {
            next
        }
    }

    /// The most attempts any other member has finished.
    fn furthest_other(&self) -> u64 {
        (0..self.members)
            .filter(|&m| m != self.me)
            .map(|m| self.passed(m).load(Ordering::Acquire))
            .max()
            .unwrap_or(0)
    }

    /// True when another member finished attempt `j` (so it was given up).
    fn passed_by_other(&self, j: u64) -> bool {
        (0..self.members).any(|m| m != self.me && self.passed(m).load(Ordering::Acquire) > j)
    }

    fn attempt<R>(
        &self,
        j: u64,
        identity: Identity,
        fill: impl FnOnce(&mut [u8]),
        deadline: Instant,
        yielding: bool,
        then: impl FnOnce(&[&[u8]]) -> R,
    ) -> Option<R> {
        if self.passed_by_other(j) {
            return None;
        }
        let parity = (j % 2) as usize;
        // The slot's previous attempt (j - 2) must be over on every member.
        if j >= 2 {
            let behind = |m: usize| self.passed(m).load(Ordering::Acquire) + 1 < j;
            let free = || !(0..self.members).any(behind);
            let give_up = || Instant::now() >= deadline || self.left(behind);
            if !wait_until(free, give_up, || yielding || self.crowded(behind)) {
                return None;
            }
        }
        let word = self.slot_word(parity);
        let tag = u64::from(j as u32) << 32;
        loop {
            let cur = word.load(Ordering::Acquire);
            if cur & !(ABORTED | BITS) == tag {
                break;
            }
            // Another number is a finished attempt's: no member is in it any more.
            let _ = word.compare_exchange(cur, tag, Ordering::AcqRel, Ordering::Acquire);
        }
        let [h0, h1, len] = self.identity_words(self.me, parity);
        h0.store(identity.hashes[0], Ordering::Relaxed);
        h1.store(identity.hashes[1], Ordering::Relaxed);
        len.store(identity.len as u64, Ordering::Relaxed);
        // SAFETY: this member's part of the slot, which no member reads before
        // this member's bit is in the word.
        fill(unsafe { std::slice::from_raw_parts_mut(self.part(self.me, parity), identity.len) });
        let mine = 1u64 << self.me;
        loop {
            let cur = word.load(Ordering::Acquire);
            if cur & ABORTED != 0 {
                return None;
            }
            if word
                .compare_exchange(cur, cur | mine, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                break;
            }
        }
        let all = (1u64 << self.members) - 1;
        let mut turns = 0u32;
        let mut give_way = yielding;
        loop {
            let cur = word.load(Ordering::Acquire);
            if cur & BITS == all {
                break;
            }
            if cur & ABORTED != 0 {
                return None;
            }
            turns = turns.wrapping_add(1);
            if turns % 64 == 0 {
                let missing = |m: usize| cur & (1 << m) == 0;
                if Instant::now() >= deadline || self.passed_by_other(j) || self.left(missing) {
                    if word
                        .compare_exchange(cur, cur | ABORTED, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        return None;
                    }
                    continue;
                }
                give_way = yielding || self.crowded(missing);
            }
            pause(give_way);
        }
        let mut lens = Vec::with_capacity(self.members);
        for m in 0..self.members {
            let [h0, h1, len] = self.identity_words(m, parity);
            if [h0, h1].map(|w| w.load(Ordering::Relaxed)) != identity.hashes {
                return None;
            }
            lens.push((len.load(Ordering::Relaxed) as usize).min(SLOT_BYTES));
        }
        let parts: Vec<&[u8]> = (0..self.members)
            .zip(lens)
            // SAFETY: every member wrote its part before its bit (seen above with
            // Acquire); none writes it again before this member passes attempt j.
            .map(|(m, len)| unsafe { std::slice::from_raw_parts(self.part(m, parity), len) })
            .collect();
        Some(then(&parts))
    }
}

fn pause(yielding: bool) {
    if yielding {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// Spins until `ready` or `give_up`, yielding the core while `give_way` says so (both
/// asked every 64 turns); true when ready.
fn wait_until(
    ready: impl Fn() -> bool,
    give_up: impl Fn() -> bool,
    give_way: impl Fn() -> bool,
) -> bool {
    let mut turns = 0u32;
    let mut yielding = false;
    loop {
        if ready() {
            return true;
        }
        turns = turns.wrapping_add(1);
        if turns % 64 == 0 {
            if give_up() {
                return false;
            }
            yielding = give_way();
        }
        pause(yielding);
    }
}

/// The CPU this thread runs on now, plus one (0: unknown).
fn current_cpu() -> u64 {
    // SAFETY: sched_getcpu takes nothing and only reads the caller's CPU.
    let cpu = unsafe { libc::sched_getcpu() };
    u64::try_from(cpu).map_or(0, |c| c + 1)
}

#[cfg(test)]
mod tests;

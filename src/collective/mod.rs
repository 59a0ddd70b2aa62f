//! Collective algorithms over a communicator, on byte buffers. Each
//! collective is one plain function; the engine picks and calls them. Ranks
//! here are ranks *within the communicator* (a process set), numbered 0..n.
//!
//! Vocabulary: a *chunk* is the part of a buffer one rank owns in a ring
//! (buffers are split into `n` chunks of whole elements, the first
//! `count % n` one element larger); a *segment* is the piece of a chunk that
//! is reduced as soon as it has arrived, while the rest is still in flight.

mod alltoall;
mod barrier;
mod broadcast;
mod doubling;
mod hierarchical;
pub mod offer;
mod reading;
mod ring;
mod stripe;
mod vote;

#[cfg(test)]
pub(crate) mod tests;

pub use alltoall::alltoallv;
pub use barrier::barrier;
pub use broadcast::broadcast;
pub use doubling::{latency_bound, ONE_ROUND_MAX};
pub use hierarchical::{
    allgatherv_hierarchical, allreduce_hierarchical, fits, host_and_peers, hosts_of,
};
pub use ring::{allgatherv, allreduce, allreduce_from, allreduce_half_links, reduce_scatter};
pub use stripe::{striped, stripes, MIN_STRIPE};
pub use vote::patient_max;

use crate::error::Result;
use crate::transport::{Channel, Mesh, Recv, Send};
use std::ops::Range;

/// A group of ranks that exchange messages. Shared between the threads of
/// a striped collective (see [`striped`]), hence `Sync`.
pub trait Comm: Sync {
    /// This rank within the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// Runs the sends and receives (peers as group ranks) to completion.
    fn transfer(&self, sends: &mut [Send<'_>], recvs: &mut [Recv<'_>]) -> Result<()>;
    /// An index naming the host of group rank `rank` (equal indices share a host).
    fn host(&self, _rank: usize) -> usize {
        0
    }
    /// Parallel streams between ranks of different hosts (and between all
    /// ranks when [`Comm::shares_memory`] is false).
    fn streams(&self) -> usize {
        1
    }
    /// True when ranks on one host talk through shared memory, over one
    /// stream only.
    fn shares_memory(&self) -> bool {
        false
    }
    /// The same group on stream `s` (`0 < s < streams()`).
    fn channel(&self, _s: usize) -> Option<Box<dyn Comm + '_>> {
        None
    }
    /// The group ranks whose processes have ended, as far as the connections tell
    /// (never blocks; none where the transport cannot tell).
    fn ended(&self) -> Vec<usize> {
        Vec::new()
    }
    /// True when group rank `rank` lets the ranks sharing its host and memory read
    /// its buffers, and can read theirs (the same answer on every rank).
    fn readable(&self, _rank: usize) -> bool {
        false
    }
    /// Copies `buf.len()` bytes at address `addr` of group rank `from` (on this
    /// host) into `buf`; false, with `buf` in any state, when that failed. An
    /// empty `buf` only checks that `from`'s memory can be read.
    fn read_direct(&self, _from: usize, _addr: u64, _buf: &mut [u8]) -> bool {
        false
    }
    /// True once a direct read between this rank and `peer` failed (both know:
    /// the reader tells the other).
    fn direct_refused(&self, _peer: usize) -> bool {
        false
    }
    /// Records that a direct read between this rank and `peer` failed.
    fn refuse_direct(&self, _peer: usize) {}
    /// The error for a read of `peer`'s memory that failed after one worked: its
    /// process has most likely ended, which the transport confirms and names.
    fn lost(&self, peer: usize) -> crate::error::PerseusError {
        crate::error::PerseusError::Peer(format!(
            "rank {peer}: its memory could not be read though it could before"
        ))
    }
}

/// A subgroup of a parent group: group rank `i` is parent rank `members[i]`.
pub struct SubComm<'a> {
    parent: Parent<'a>,
    members: Vec<usize>,
    rank: usize,
}

/// A [`SubComm`]'s parent: borrowed, or (one stream of a parent) owned.
enum Parent<'a> {
    Borrowed(&'a dyn Comm),
    Owned(Box<dyn Comm + 'a>),
}

impl<'a> SubComm<'a> {
    /// The subgroup of `members` (parent ranks, including the caller's).
    pub fn new(parent: &'a dyn Comm, members: Vec<usize>) -> Self {
        Self::with_parent(Parent::Borrowed(parent), members)
    }

    fn with_parent(parent: Parent<'a>, members: Vec<usize>) -> Self {
        let p = match &parent {
            Parent::Borrowed(p) => *p,
            Parent::Owned(b) => &**b,
        };
        let rank = members
            .iter()
            .position(|&m| m == p.rank())
            .expect("caller not in its subgroup");
        SubComm {
            parent,
            members,
            rank,
        }
    }

    fn parent(&self) -> &dyn Comm {
        match &self.parent {
            Parent::Borrowed(p) => *p,
            Parent::Owned(b) => &**b,
        }
    }

    /// The parent rank of each group rank.
    pub fn members(&self) -> &[usize] {
        &self.members
    }
}

impl Comm for SubComm<'_> {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.members.len()
    }
    fn transfer(&self, sends: &mut [Send<'_>], recvs: &mut [Recv<'_>]) -> Result<()> {
        sends
            .iter_mut()
            .for_each(|s| s.map_peer(|p| self.members[p]));
        recvs
            .iter_mut()
            .for_each(|r| r.map_peer(|p| self.members[p]));
        self.parent().transfer(sends, recvs)
    }
    fn host(&self, rank: usize) -> usize {
        self.parent().host(self.members[rank])
    }
    fn streams(&self) -> usize {
        self.parent().streams()
    }
    fn shares_memory(&self) -> bool {
        self.parent().shares_memory()
    }
    fn channel(&self, s: usize) -> Option<Box<dyn Comm + '_>> {
        let parent = self.parent().channel(s)?;
        Some(Box::new(SubComm::with_parent(
            Parent::Owned(parent),
            self.members.clone(),
        )))
    }
    fn ended(&self) -> Vec<usize> {
        let gone = self.parent().ended();
        (0..self.members.len())
            .filter(|&i| gone.contains(&self.members[i]))
            .collect()
    }
    fn readable(&self, rank: usize) -> bool {
        self.parent().readable(self.members[rank])
    }
    fn read_direct(&self, from: usize, addr: u64, buf: &mut [u8]) -> bool {
        self.parent().read_direct(self.members[from], addr, buf)
    }
    fn direct_refused(&self, peer: usize) -> bool {
        self.parent().direct_refused(self.members[peer])
    }
    fn refuse_direct(&self, peer: usize) {
        self.parent().refuse_direct(self.members[peer])
    }
    fn lost(&self, peer: usize) -> crate::error::PerseusError {
        self.parent().lost(self.members[peer])
    }
}

/// The whole mesh is the group of all ranks; process sets are [`SubComm`]s of it.
impl Comm for Mesh {
    fn rank(&self) -> usize {
        Mesh::rank(self)
    }
    fn size(&self) -> usize {
        Mesh::size(self)
    }
    fn transfer(&self, sends: &mut [Send<'_>], recvs: &mut [Recv<'_>]) -> Result<()> {
        Mesh::transfer(self, sends, recvs)
    }
    fn host(&self, rank: usize) -> usize {
        self.host_of(rank)
    }
    fn streams(&self) -> usize {
        Mesh::streams(self)
    }
    fn shares_memory(&self) -> bool {
        Mesh::shares_memory(self)
    }
    fn channel(&self, s: usize) -> Option<Box<dyn Comm + '_>> {
        (s < Mesh::streams(self)).then(|| Box::new(Mesh::channel(self, s)) as Box<dyn Comm>)
    }
    fn ended(&self) -> Vec<usize> {
        Mesh::ended(self)
    }
    fn readable(&self, rank: usize) -> bool {
        Mesh::readable(self, rank)
    }
    fn read_direct(&self, from: usize, addr: u64, buf: &mut [u8]) -> bool {
        Mesh::read_direct(self, from, addr, buf)
    }
    fn direct_refused(&self, peer: usize) -> bool {
        Mesh::direct_refused(self, peer)
    }
    fn refuse_direct(&self, peer: usize) {
        Mesh::refuse_direct(self, peer)
    }
    fn lost(&self, peer: usize) -> crate::error::PerseusError {
        Mesh::lost(self, peer)
    }
}

/// One stream of the mesh: the same ranks, its own connections.
impl Comm for Channel<'_> {
    fn rank(&self) -> usize {
        self.mesh().rank()
    }
    fn size(&self) -> usize {
        self.mesh().size()
    }
    fn transfer(&self, sends: &mut [Send<'_>], recvs: &mut [Recv<'_>]) -> Result<()> {
        Channel::transfer(self, sends, recvs)
    }
    fn host(&self, rank: usize) -> usize {
        self.mesh().host_of(rank)
    }
}

/// Consecutive ranges of the given lengths, from 0 (blocks laid out one after another).
pub fn consecutive(lens: impl Iterator<Item = usize>) -> Vec<Range<usize>> {
    let mut start = 0;
    lens.map(|n| {
        let r = start..start + n;
        start += n;
        r
    })
    .collect()
}

/// Splits `count` elements into `n` parts as evenly as possible, the first
/// `count % n` parts one larger; returns element ranges.
pub fn partition(count: usize, n: usize) -> Vec<Range<usize>> {
    let (base, extra) = (count / n, count % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

/// Borrows non-overlapping `ranges` of one buffer, each mutably, in the order of
/// `ranges` (which may leave gaps and come in any order). Panics where two overlap
/// or one runs past the buffer.
pub(crate) fn split_mut<'a, T>(buf: &'a mut [T], ranges: &[Range<usize>]) -> Vec<&'a mut [T]> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| ranges[i].start);
    let mut out: Vec<Option<&'a mut [T]>> = (0..ranges.len()).map(|_| None).collect();
    let (mut rest, mut at) = (buf, 0);
    for i in order {
        let r = &ranges[i];
        assert!(r.start >= at, "ranges overlap");
        let (_, after) = std::mem::take(&mut rest).split_at_mut(r.start - at);
        let (part, after) = after.split_at_mut(r.len());
        (out[i], rest, at) = (Some(part), after, r.end);
    }
    out.into_iter()
        .map(|p| p.expect("every range placed"))
        .collect()
}

/// Borrows two non-overlapping ranges of one buffer, one shared, one mutable.
pub(crate) fn split2(
    buf: &mut [u8],
    shared: Range<usize>,
    excl: Range<usize>,
) -> (&[u8], &mut [u8]) {
    assert!(
        shared.end <= excl.start || excl.end <= shared.start,
        "ranges overlap"
    );
    if shared.end <= excl.start {
        let (a, b) = buf.split_at_mut(excl.start);
        (&a[shared], &mut b[..excl.end - excl.start])
    } else {
        let (a, b) = buf.split_at_mut(shared.start);
        (&b[..shared.end - shared.start], &mut a[excl])
    }
}

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
mod hierarchical;
mod ring;

#[cfg(test)]
mod tests;

pub use alltoall::alltoallv;
pub use barrier::barrier;
pub use broadcast::broadcast;
pub use hierarchical::{allreduce_hierarchical, fits, hosts_of};
pub use ring::{allgatherv, allreduce, allreduce_half_links, reduce_scatter};

use crate::error::Result;
use crate::transport::{Mesh, Recv, Send};
use std::ops::Range;

/// A group of ranks that exchange messages.
pub trait Comm {
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
}

/// A subgroup of a parent group: group rank `i` is parent rank `members[i]`.
pub struct SubComm<'a> {
    parent: &'a dyn Comm,
    members: Vec<usize>,
    rank: usize,
}

impl<'a> SubComm<'a> {
    /// The subgroup of `members` (parent ranks, including the caller's).
    pub fn new(parent: &'a dyn Comm, members: Vec<usize>) -> Self {
        let rank = members
            .iter()
            .position(|&m| m == parent.rank())
            .expect("caller not in its subgroup");
        SubComm {
            parent,
            members,
            rank,
        }
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
        self.parent.transfer(sends, recvs)
    }
    fn host(&self, rank: usize) -> usize {
        self.parent.host(self.members[rank])
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

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
mod ring;

#[cfg(test)]
mod tests;

pub use alltoall::alltoallv;
pub use barrier::barrier;
pub use broadcast::broadcast;
pub use ring::{allgatherv, allreduce, reduce_scatter};

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
}

/// A process set's view of the mesh: group rank `i` is global rank `members[i]`.
pub struct MeshComm<'a> {
    mesh: &'a Mesh,
    members: &'a [usize],
    rank: usize,
}

impl<'a> MeshComm<'a> {
    /// The group of `members` (sorted global ranks, including this one).
    pub fn new(mesh: &'a Mesh, members: &'a [usize]) -> Self {
        let rank = members
            .iter()
            .position(|&m| m == mesh.rank())
            .expect("rank not in its set");
        MeshComm {
            mesh,
            members,
            rank,
        }
    }
}

impl Comm for MeshComm<'_> {
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
        self.mesh.transfer(sends, recvs)
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

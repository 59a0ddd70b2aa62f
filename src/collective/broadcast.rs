//! Broadcast from any root. Small buffers go straight from the root to every
//! rank of a small group, down a binomial tree in a larger one. Larger ones, when every rank shares the root's host and memory and
//! can read its peers' ([`Comm::readable`]), are read by each rank straight
//! out of the root's buffer ([`offer`]; among [`DIRECT_RANKS`] or more);
//! otherwise they flow down a chain (root, root+1,
//! ...) in segments, each rank forwarding segment `k` while it receives
//! segment `k+1`.

use super::{offer, split2, Comm};
use crate::error::Result;
use crate::transport::{Recv, Send};

/// Buffers up to this size are sent by the root to each rank directly.
const STAR_MAX: usize = 64 << 10;
/// Segment of the chain.
const SEGMENT: usize = 1 << 20;
/// The fewest ranks whose large broadcasts are read from the root's memory. Between
/// two, the ring, where the root's core writes while the other's reads, matched or
/// beat one core's read at every size but 256 MiB; among three or more, the chain's
/// hops cost more than the reads (measured: benchmarks/NOTES.md).
pub(super) const DIRECT_RANKS: usize = 3;

/// Copies the root's `buf` into every rank's `buf`.
pub fn broadcast(comm: &dyn Comm, buf: &mut [u8], root: usize) -> Result<()> {
    let (n, r) = (comm.size(), comm.rank());
    if n == 1 {
        return Ok(());
    }
    if buf.len() <= STAR_MAX && n > super::doubling::ONE_ROUND_MAX {
        return super::doubling::broadcast_tree(comm, buf, root);
    }
    if buf.len() <= STAR_MAX {
        return if r == root {
            let mut sends: Vec<Send<'_>> = (0..n)
                .filter(|&p| p != root)
                .map(|p| Send::new(p, &*buf))
                .collect();
            comm.transfer(&mut sends, &mut [])
        } else {
            comm.transfer(&mut [], &mut [Recv::new(root, buf)])
        };
    }
    if n >= DIRECT_RANKS && offer::all_readable(comm) {
        return if r == root {
            let gives: Vec<(usize, &[u8])> =
                (0..n).filter(|&p| p != root).map(|p| (p, &*buf)).collect();
            offer::exchange(comm, &gives, &mut [], buf.len())
        } else {
            let len = buf.len();
            offer::exchange(comm, &[], &mut [(root, buf)], len)
        };
    }
    let len = buf.len();
    let v = (r + n - root) % n;
    let prev = (v > 0).then(|| (r + n - 1) % n);
    let next = (v + 1 < n).then(|| (r + 1) % n);
    let segs: Vec<std::ops::Range<usize>> = (0..buf.len())
        .step_by(SEGMENT)
        .map(|s| s..(s + SEGMENT).min(buf.len()))
        .collect();
    // Step k receives segment k (unless root) and forwards segment k-1.
    for k in 0..=segs.len() {
        let fwd = next.filter(|_| k > 0).map(|p| (p, segs[k - 1].clone()));
        let get = prev
            .filter(|_| k < segs.len())
            .map(|p| (p, segs[k].clone()));
        match (fwd, get) {
            (Some((to, a)), Some((from, b))) => {
                let (out, inp) = split2(buf, a, b);
                let recv = Recv::new(from, inp).of_result(len);
                comm.transfer(&mut [Send::new(to, out)], &mut [recv])?
            }
            (Some((to, a)), None) => comm.transfer(&mut [Send::new(to, &buf[a])], &mut [])?,
            (None, Some((from, b))) => {
                let recv = Recv::new(from, &mut buf[b]).of_result(len);
                comm.transfer(&mut [], &mut [recv])?
            }
            (None, None) => {}
        }
    }
    Ok(())
}

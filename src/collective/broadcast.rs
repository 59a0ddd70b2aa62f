//! Broadcast from any root. Small buffers go straight from the root to every
//! rank; large ones flow down a chain (root, root+1, ...) in segments, each
//! rank forwarding segment `k` while it receives segment `k+1`.

use super::{split2, Comm};
use crate::error::Result;
use crate::transport::{Recv, Send};

/// Buffers up to this size are sent by the root to each rank directly.
const STAR_MAX: usize = 64 << 10;
/// Segment of the chain.
const SEGMENT: usize = 1 << 20;

/// Copies the root's `buf` into every rank's `buf`.
pub fn broadcast(comm: &dyn Comm, buf: &mut [u8], root: usize) -> Result<()> {
    let (n, r) = (comm.size(), comm.rank());
    if n == 1 {
        return Ok(());
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

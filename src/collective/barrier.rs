//! Dissemination barrier: in round `k` each rank signals rank `r + 2^k` and
//! waits for rank `r - 2^k`; after `ceil(log2 n)` rounds everyone has
//! (transitively) heard from everyone.

use super::Comm;
use crate::error::Result;
use crate::transport::{Recv, Send};

/// Returns once every rank of the group has entered.
pub fn barrier(comm: &dyn Comm) -> Result<()> {
    let (n, r) = (comm.size(), comm.rank());
    let mut dist = 1;
    while dist < n {
        let (to, from) = ((r + dist) % n, (r + n - dist) % n);
        comm.transfer(&mut [Send::new(to, &[])], &mut [Recv::new(from, &mut [])])?;
        dist *= 2;
    }
    Ok(())
}

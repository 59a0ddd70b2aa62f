//! All-to-all with per-pair sizes: every block travels at once, the
//! transport interleaving them, so no ordering between pairs can deadlock.
//! Large blocks between ranks of one host are read from the sender's memory
//! ([`offer`]).

use super::{offer, Comm};
use crate::error::Result;
use std::ops::Range;

/// Sends `input[send[i]]` to rank `i` and receives rank `i`'s block into
/// `output[recv[i]]`; this rank's own block is copied locally.
pub fn alltoallv(
    comm: &dyn Comm,
    input: &[u8],
    send: &[Range<usize>],
    output: &mut [u8],
    recv: &[Range<usize>],
) -> Result<()> {
    let r = comm.rank();
    output[recv[r].clone()].copy_from_slice(&input[send[r].clone()]);
    let gives: Vec<(usize, &[u8])> = (0..comm.size())
        .filter(|&p| p != r)
        .map(|p| (p, &input[send[p].clone()]))
        .collect();
    let mut rest: Vec<(usize, &mut [u8])> = super::split_mut(output, recv)
        .into_iter()
        .enumerate()
        .filter(|&(p, _)| p != r)
        .collect();
    let result = recv.iter().map(|r| r.end).max().unwrap_or(0);
    offer::exchange(comm, &gives, &mut rest, result)
}

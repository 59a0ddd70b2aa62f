//! The reduce-scatter among ranks of one host that read one another's memory
//! ([`Comm::read_direct`]): rank `r` reads chunk `r` of every other rank's
//! input, a piece at a time into a scratch that stays in cache, and reduces it
//! into its own chunk. One round of small messages replaces the ring's `n-1`
//! steps, and each byte is copied once instead of into a ring and out again.
//!
//! The reduction runs in the ring's order (chunk `k`: rank `k+1`'s elements, then
//! `k+2`'s reduced onto them, and so on, rank `k`'s last), so the bytes are those
//! of the ring's reduce-scatter ([`super::ring`]).
//!
//! Each rank first sends every other an offer: where its chunk for that rank
//! lies, and whether it will read the other's chunk or needs it sent (its
//! probe of the other's memory failed). A rank must not change a chunk it offered
//! until its reader is done: the allgather that follows writes chunk `p` only
//! after rank `p` has sent it, that is, after `p` has read everything it needed.

use super::{offer, Comm};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{PerseusError, Result};
use crate::kernels::{reduce_into, scale, AlignedBuf};
// Bytes of a chunk read and reduced at once (two such pieces of scratch stay in
// cache): the pieces the pace check at init reads too.
use crate::transport::cma::PIECE;
use crate::transport::{Recv, Send};
use std::ops::Range;

/// An offer: the chunk's address and length, then whether its sender will read.
const OFFER: usize = 17;
/// In an offer: its sender will read the receiver's chunk itself.
const WILL_READ: u8 = 1;
/// In an offer: its sender needs the receiver's chunk sent.
const SEND_IT: u8 = 0;

/// Allreduces of at least this many bytes read; smaller ones take the ring. At
/// 2 MiB the two were even on 2 ranks, and reading was ahead on 3 and 4; at 1 MiB
/// the ring was ahead on 2 and 3 (benchmarks/NOTES.md).
pub const FROM: usize = 2 << 20;
/// Between two ranks, allreduces of this many bytes or more take the ring again:
/// reading led at 4-16 MiB, but trailed slightly at 64 and 256 MiB, where the
/// ring's two cores each copy half of every step.
pub const PAIR_UNTIL: usize = 32 << 20;

/// True when the reduce-scatter of `parts` (the chunks, one after another over
/// the buffer) reads: every rank shares this host and can read the others, and the
/// buffer has [`FROM`] bytes or more (and, between two ranks, fewer than
/// [`PAIR_UNTIL`]). The same answer on every rank.
pub fn applies(comm: &dyn Comm, parts: &[Range<usize>]) -> bool {
    let len = parts.last().map_or(0, |p| p.end);
    len >= FROM && (comm.size() > 2 || len < PAIR_UNTIL) && offer::all_readable(comm)
}

/// Reduces chunk `r` (this rank's) of every rank's input into `buf[parts[r]]`,
/// then multiplies it by `factor`. The input is `src` where given (the same
/// length as `buf`), else `buf` itself. Returns when this rank's chunk is done,
/// while the others may still be reading this rank's input: it must stay as it
/// is until each other rank's chunk has come (the allgather that follows, which
/// each rank starts only once its own reduction is done).
#[allow(clippy::too_many_arguments)]
pub fn reduce_scatter(
    comm: &dyn Comm,
    src: Option<&[u8]>,
    buf: &mut [u8],
    parts: &[Range<usize>],
    dtype: DataType,
    op: ReduceOp,
    factor: f64,
    scratch: &mut AlignedBuf,
) -> Result<()> {
    let (n, r) = (comm.size(), comm.rank());
    let peers: Vec<usize> = (0..n).filter(|&p| p != r).collect();
    // This rank's chunk (written) and the others (offered), apart.
    let mut blocks = super::split_mut(buf, parts);
    let own: &mut [u8] = std::mem::take(&mut blocks[r]);
    let given: Vec<&[u8]> = match src {
        Some(s) => parts.iter().map(|p| &s[p.clone()]).collect(),
        None => blocks.into_iter().map(|b| &*b).collect(),
    };
    // 1. The offers, each with whether its sender reads (its probe worked) or not.
    let reads: Vec<bool> = peers
        .iter()
        .map(|&p| !comm.direct_refused(p) && comm.read_direct(p, 0, &mut []))
        .collect();
    let offers: Vec<[u8; OFFER]> = peers
        .iter()
        .zip(&reads)
        .map(|(&p, &rd)| {
            let b = given[p];
            let mut o = [0u8; OFFER];
            o[..8].copy_from_slice(&(b.as_ptr() as u64).to_le_bytes());
            o[8..16].copy_from_slice(&(b.len() as u64).to_le_bytes());
            o[16] = if rd { WILL_READ } else { SEND_IT };
            o
        })
        .collect();
    let mut heard = vec![[0u8; OFFER]; peers.len()];
    {
        let mut sends: Vec<Send<'_>> = peers
            .iter()
            .zip(&offers)
            .map(|(&p, o)| Send::new(p, o))
            .collect();
        let mut recvs: Vec<Recv<'_>> = peers
            .iter()
            .zip(heard.iter_mut())
            .map(|(&p, h)| Recv::new(p, h))
            .collect();
        comm.transfer(&mut sends, &mut recvs)?;
    }
    let want = parts[r].len();
    let mut addrs = vec![0u64; n];
    for (i, &p) in peers.iter().enumerate() {
        let word = |k: usize| u64::from_le_bytes(heard[i][k..k + 8].try_into().expect("8 bytes"));
        if word(8) != want as u64 {
            return Err(PerseusError::Protocol(format!(
                "rank {p} offered a chunk of {} bytes where {want} were agreed",
                word(8)
            )));
        }
        addrs[p] = word(0);
        match heard[i][16] {
            WILL_READ | SEND_IT => {}
            other => {
                return Err(PerseusError::Protocol(format!(
                    "rank {p} sent an offer marked {other}"
                )))
            }
        }
    }
    // 2. The chunks that travel as bytes: this rank's to those that cannot read it,
    //    the others' to this rank where it cannot read them.
    let mut sent: Vec<Vec<u8>> = vec![Vec::new(); n];
    let asks: Vec<bool> = (0..peers.len()).map(|i| heard[i][16] == SEND_IT).collect();
    if asks.iter().any(|&a| a) || reads.iter().any(|&rd| !rd) {
        for (i, &p) in peers.iter().enumerate() {
            if !reads[i] {
                comm.refuse_direct(p);
                sent[p] = vec![0u8; want];
            }
            if asks[i] {
                comm.refuse_direct(p);
            }
        }
        let mut sends: Vec<Send<'_>> = peers
            .iter()
            .zip(&asks)
            .filter(|(_, &a)| a)
            .map(|(&p, _)| Send::new(p, given[p]))
            .collect();
        let mut recvs: Vec<Recv<'_>> = sent
            .iter_mut()
            .enumerate()
            .filter(|(_, b)| !b.is_empty())
            .map(|(p, b)| Recv::new(p, b))
            .collect();
        comm.transfer(&mut sends, &mut recvs)?;
    }
    // 3. The reduction, a piece at a time, in the ring's order.
    let es = dtype.size();
    let piece = (PIECE / es).max(1) * es;
    scratch.resize(2 * piece);
    let (mut acc, mut next) = scratch.as_mut_slice().split_at_mut(piece);
    let mut at = 0;
    while at < want {
        let len = piece.min(want - at);
        for s in 1..n {
            let p = (r + s) % n;
            let dst: &mut [u8] = if s == 1 {
                &mut acc[..len]
            } else {
                &mut next[..len]
            };
            if sent[p].is_empty() {
                if !comm.read_direct(p, addrs[p] + at as u64, dst) {
                    return Err(comm.lost(p));
                }
            } else {
                dst.copy_from_slice(&sent[p][at..at + len]);
            }
            if s > 1 {
                reduce_into(&mut next[..len], &acc[..len], dtype, op);
                std::mem::swap(&mut acc, &mut next);
            }
        }
        let mine = &mut own[at..at + len];
        if let Some(s) = src {
            let from = parts[r].start + at;
            mine.copy_from_slice(&s[from..from + len]);
        }
        reduce_into(mine, &acc[..len], dtype, op);
        scale(mine, dtype, factor);
        at += len;
    }
    Ok(())
}

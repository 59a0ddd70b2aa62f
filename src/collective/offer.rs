//! Blocks read straight out of the sender's memory ([`Comm::read_direct`]):
//! the sender offers a block (its address and length), the receiver copies it
//! in one pass and answers, and the sender returns only once every receiver
//! of its blocks has answered. A receiver that could not read says so and is
//! sent the bytes; both then remember, and that pair's blocks travel as bytes
//! from then on.

use super::Comm;
use crate::error::{PerseusError, Result};
use crate::kernels::{copy_streaming, STREAM_FROM};
use crate::transport::cma::READ_MAX_RANKS;
use crate::transport::{Recv, Send};

/// Blocks smaller than this travel as bytes: an offer and its answer cost two
/// trips, which a small block's copies through shared memory do not.
pub const DIRECT_FROM: usize = 64 << 10;

/// Bytes read at once into a bounce buffer that stays in cache, when a block
/// lands in a result written past the cache ([`STREAM_FROM`]).
const BOUNCE: usize = 512 << 10;

/// An offer: the block's address, then its length.
const OFFER: usize = 16;
/// An answer: the block was read.
const READ: u8 = 1;
/// An answer: it could not be, send the bytes.
const UNREAD: u8 = 0;

/// True when a block of `len` bytes between this rank and `peer` can be read
/// directly: the same answer on both ranks of the pair.
pub fn direct(comm: &dyn Comm, peer: usize, len: usize) -> bool {
    let me = comm.rank();
    len >= DIRECT_FROM
        && comm.shares_memory()
        && comm.host(peer) == comm.host(me)
        && comm.readable(peer)
        && comm.readable(me)
        && !comm.direct_refused(peer)
}

/// True when every rank of `comm` (two to [`READ_MAX_RANKS`]) shares this host's
/// memory and can be read by the others ([`Comm::readable`]): where a collective may
/// read its blocks instead of passing them on. The same answer on every rank.
pub fn all_readable(comm: &dyn Comm) -> bool {
    let (n, host) = (comm.size(), comm.host(comm.rank()));
    (2..=READ_MAX_RANKS).contains(&n)
        && comm.shares_memory()
        && (0..n).all(|p| comm.host(p) == host && comm.readable(p))
}

/// Moves blocks between ranks: each `(peer, block)` of `gives` to that peer, each
/// `(peer, block)` of `takes` from it (a peer appears at most once in each list,
/// and the lengths agree pairwise). Pairs [`direct`] for the length are read
/// from the giver's memory; the others are sent as bytes. `result`: the bytes of
/// the result the taken blocks land in; from [`STREAM_FROM`] they are written past
/// the cache, as the rings do.
pub fn exchange(
    comm: &dyn Comm,
    gives: &[(usize, &[u8])],
    takes: &mut [(usize, &mut [u8])],
    result: usize,
) -> Result<()> {
    let offers: Vec<[u8; OFFER]> = gives
        .iter()
        .map(|(_, b)| {
            let mut o = [0u8; OFFER];
            o[..8].copy_from_slice(&(b.as_ptr() as u64).to_le_bytes());
            o[8..].copy_from_slice(&(b.len() as u64).to_le_bytes());
            o
        })
        .collect();
    let gives_direct: Vec<bool> = gives
        .iter()
        .map(|(p, b)| direct(comm, *p, b.len()))
        .collect();
    let takes_direct: Vec<bool> = takes
        .iter()
        .map(|(p, b)| direct(comm, *p, b.len()))
        .collect();
    // 1. Offers, and the bytes of the pairs that are not direct.
    let mut got = vec![[0u8; OFFER]; takes.len()];
    {
        let mut sends: Vec<Send<'_>> = gives
            .iter()
            .zip(&offers)
            .zip(&gives_direct)
            .map(|(((p, b), o), &d)| {
                if d {
                    Send::new(*p, o)
                } else {
                    Send::new(*p, b)
                }
            })
            .collect();
        let mut recvs: Vec<Recv<'_>> = takes
            .iter_mut()
            .zip(got.iter_mut())
            .zip(&takes_direct)
            .map(|(((p, b), o), &d)| {
                if d {
                    Recv::new(*p, o)
                } else {
                    Recv::new(*p, b)
                }
            })
            .collect();
        comm.transfer(&mut sends, &mut recvs)?;
    }
    // 2. The reads.
    let mut answers = vec![[UNREAD]; takes.len()];
    for (i, (p, b)) in takes.iter_mut().enumerate() {
        if !takes_direct[i] {
            continue;
        }
        let word = |k: usize| u64::from_le_bytes(got[i][k..k + 8].try_into().expect("8 bytes"));
        let (addr, offered) = (word(0), word(8));
        if offered != b.len() as u64 {
            return Err(PerseusError::Protocol(format!(
                "rank {p} offered a block of {offered} bytes where {} were agreed",
                b.len()
            )));
        }
        if read(comm, *p, addr, b, result >= STREAM_FROM) {
            answers[i] = [READ];
        } else {
            comm.refuse_direct(*p);
        }
    }
    // 3. The answers.
    let mut heard = vec![[UNREAD]; gives.len()];
    {
        let mut sends: Vec<Send<'_>> = takes
            .iter()
            .zip(&answers)
            .zip(&takes_direct)
            .filter(|(_, &d)| d)
            .map(|(((p, _), a), _)| Send::new(*p, a))
            .collect();
        let mut recvs: Vec<Recv<'_>> = gives
            .iter()
            .zip(heard.iter_mut())
            .zip(&gives_direct)
            .filter(|(_, &d)| d)
            .map(|(((p, _), h), _)| Recv::new(*p, h))
            .collect();
        comm.transfer(&mut sends, &mut recvs)?;
    }
    // 4. The bytes of the blocks that could not be read.
    let mut sends: Vec<Send<'_>> = Vec::new();
    for (((p, b), h), &d) in gives.iter().zip(&heard).zip(&gives_direct) {
        match (d, h[0]) {
            (false, _) | (true, READ) => {}
            (true, UNREAD) => {
                comm.refuse_direct(*p);
                sends.push(Send::new(*p, b));
            }
            (true, other) => {
                return Err(PerseusError::Protocol(format!(
                    "rank {p} answered an offered block with {other}"
                )))
            }
        }
    }
    let mut recvs: Vec<Recv<'_>> = takes
        .iter_mut()
        .zip(&answers)
        .zip(&takes_direct)
        .filter(|((_, a), &d)| d && a[0] == UNREAD)
        .map(|(((p, b), _), _)| Recv::new(*p, b))
        .collect();
    if sends.is_empty() && recvs.is_empty() {
        return Ok(());
    }
    comm.transfer(&mut sends, &mut recvs)
}

/// Reads `dst.len()` bytes at `addr` of `from` into `dst`; `stream`: through a
/// bounce buffer in cache, then written past the cache (the kernel's own copy
/// would read every line of `dst` first).
fn read(comm: &dyn Comm, from: usize, addr: u64, dst: &mut [u8], stream: bool) -> bool {
    if !stream {
        return comm.read_direct(from, addr, dst);
    }
    let mut bounce = vec![0u8; BOUNCE.min(dst.len())];
    for (i, piece) in dst.chunks_mut(BOUNCE).enumerate() {
        let b = &mut bounce[..piece.len()];
        if !comm.read_direct(from, addr + (i * BOUNCE) as u64, b) {
            return false;
        }
        copy_streaming(piece, b);
    }
    true
}

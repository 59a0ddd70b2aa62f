//! Collectives in O(log n) steps, for groups too large for one round of messages to
//! every rank and buffers too small for the ring's 2(n-1) steps to pay
//! ([`latency_bound`] decides):
//!
//! - [`allreduce_doubling`]: recursive doubling. In step `k` each rank swaps its whole
//!   buffer with the rank whose index differs in bit `k` and both reduce: log2(n)
//!   steps for small buffers.
//! - [`allreduce_halving`]: Rabenseifner's. A reduce-scatter by recursive halving (step
//!   `k` swaps half of what the last step kept), then an allgather by recursive
//!   doubling: 2 log2(n) steps that move about twice the buffer in all, as the ring
//!   does, for buffers of a few rank-sized blocks.
//! - [`broadcast_tree`]: a binomial tree from the root, ceil(log2 n) steps.
//! - [`allgatherv_bruck`]: Bruck's allgather, ceil(log2 n) steps, each doubling the
//!   blocks a rank holds.
//!
//! With a number of ranks that is not a power of two, the first `2·rem` ranks
//! (`rem = n - p`, `p` the largest power of two below) fold in pairs before the
//! exchange and the even one gets the result after: two steps more ([`Fold`]).
//!
//! Every rank ends with identical bits: where two ranks combine, both compute
//! `lower op upper` (the operand of the lower-indexed half first), so each element of
//! the result is the same expression, evaluated in the same order, on every rank; in
//! the halving, each block is reduced by one rank and copied to the others. The
//! partners of a rank are `r ± 2^k` (mod n): about 2·log2(n) peers, whatever the root.

use super::{partition, Comm};
use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::kernels::{reduce_into, scale, AlignedBuf};
use crate::transport::{Recv, Send};
use std::ops::Range;

/// Groups of at most this many ranks exchange small buffers in one round with every
/// other rank (and broadcast them from the root to each); larger ones take the steps
/// of this module.
pub const ONE_ROUND_MAX: usize = 8;

/// Buffers up to this size are latency-bound: exchanged in one round among at most
/// [`ONE_ROUND_MAX`] ranks, by [`allreduce_doubling`] among more.
pub const SMALL_MAX: usize = 64 << 10;

/// Buffers up to this size take [`allreduce_halving`] in a group of more than
/// [`ONE_ROUND_MAX`]; larger ones the ring (or the host hierarchy), whose steps each
/// move a rank's share of the buffer.
pub const HALVING_MAX: usize = 8 << 20;

/// Allgathers of up to this many bytes in all take [`allgatherv_bruck`] in a group
/// of more than [`ONE_ROUND_MAX`].
pub const BRUCK_MAX: usize = 1 << 20;

/// How an allreduce runs on one stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Steps {
    /// Every rank sends its buffer to every other and reduces in rank order.
    OneRound,
    /// [`allreduce_doubling`].
    Doubling,
    /// [`allreduce_halving`].
    Halving,
    /// The ring (or reading, among the ranks of one host).
    Ring,
}

/// How an allreduce of `len` bytes of elements of `es` bytes among `n` ranks runs.
/// The same answer on every rank.
pub fn allreduce_steps(n: usize, len: usize, es: usize) -> Steps {
    let small = len <= SMALL_MAX || len < n * es;
    match (small, n <= ONE_ROUND_MAX) {
        (true, true) => Steps::OneRound,
        (true, false) => Steps::Doubling,
        (false, false) if len <= HALVING_MAX => Steps::Halving,
        _ => Steps::Ring,
    }
}

/// True when an allreduce of `len` bytes among `n` ranks takes this module's steps
/// rather than the ring or the host hierarchy. The same answer on every rank.
pub fn latency_bound(n: usize, len: usize) -> bool {
    n > ONE_ROUND_MAX && len <= HALVING_MAX
}

/// The pairing of `n` ranks into a power of two `p` of them.
struct Fold {
    p: usize,
    rem: usize,
}

impl Fold {
    fn new(n: usize) -> Fold {
        let p = if n.is_power_of_two() {
            n
        } else {
            n.next_power_of_two() / 2
        };
        Fold { p, rem: n - p }
    }

    /// Rank `r`'s index among the `p`, or None when it folds into rank `r + 1`.
    fn virtual_of(&self, r: usize) -> Option<usize> {
        match r < 2 * self.rem {
            true if r % 2 == 0 => None,
            true => Some(r / 2),
            false => Some(r - self.rem),
        }
    }

    /// The rank with index `v` among the `p`.
    fn real_of(&self, v: usize) -> usize {
        if v < self.rem {
            2 * v + 1
        } else {
            v + self.rem
        }
    }
}

/// Swaps `mine` with `peer`'s and reduces: afterwards `mine` holds `lower op upper`,
/// where this rank's operand is the lower when `lower` holds (the same bits on both).
fn swap_reduce(
    comm: &dyn Comm,
    peer: usize,
    mine: &mut [u8],
    theirs: &mut [u8],
    lower: bool,
    dtype: DataType,
    op: ReduceOp,
) -> Result<()> {
    comm.transfer(&mut [Send::new(peer, mine)], &mut [Recv::new(peer, theirs)])?;
    if lower {
        reduce_into(mine, theirs, dtype, op);
    } else {
        reduce_into(theirs, mine, dtype, op);
        mine.copy_from_slice(theirs);
    }
    Ok(())
}

/// Folds in: the even rank of each of the first `rem` pairs sends its buffer to the
/// odd one, which reduces it in (`even op odd`). Returns this rank's index among the
/// `p`, or None for a rank that folded and waits for the result.
fn fold_in(
    comm: &dyn Comm,
    f: &Fold,
    buf: &mut [u8],
    scratch: &mut AlignedBuf,
    dtype: DataType,
    op: ReduceOp,
) -> Result<Option<usize>> {
    let r = comm.rank();
    match f.virtual_of(r) {
        None => {
            comm.transfer(&mut [Send::new(r + 1, buf)], &mut [])?;
            Ok(None)
        }
        Some(v) if r < 2 * f.rem => {
            scratch.resize(buf.len());
            let theirs = scratch.as_mut_slice();
            comm.transfer(&mut [], &mut [Recv::new(r - 1, theirs)])?;
            reduce_into(theirs, buf, dtype, op);
            buf.copy_from_slice(theirs);
            Ok(Some(v))
        }
        v => Ok(v),
    }
}

/// Folds out: the odd rank of each of the first `rem` pairs sends the result to the
/// even one.
fn fold_out(comm: &dyn Comm, f: &Fold, buf: &mut [u8], folded: bool) -> Result<()> {
    let r = comm.rank();
    if folded {
        comm.transfer(&mut [], &mut [Recv::new(r + 1, buf)])
    } else if r < 2 * f.rem {
        comm.transfer(&mut [Send::new(r - 1, buf)], &mut [])
    } else {
        Ok(())
    }
}

/// Recursive-doubling allreduce of `buf` in place (no scaling): ceil(log2 n) steps of
/// the whole buffer, two more when `n` is not a power of two.
pub fn allreduce_doubling(
    comm: &dyn Comm,
    buf: &mut [u8],
    dtype: DataType,
    op: ReduceOp,
    scratch: &mut AlignedBuf,
) -> Result<()> {
    let f = Fold::new(comm.size());
    let Some(v) = fold_in(comm, &f, buf, scratch, dtype, op)? else {
        return fold_out(comm, &f, buf, true);
    };
    scratch.resize(buf.len());
    let mut mask = 1;
    while mask < f.p {
        let pv = v ^ mask;
        swap_reduce(
            comm,
            f.real_of(pv),
            buf,
            scratch.as_mut_slice(),
            v < pv,
            dtype,
            op,
        )?;
        mask <<= 1;
    }
    fold_out(comm, &f, buf, false)
}

/// Rabenseifner's allreduce of `buf` in place, then multiplies every element by
/// `factor` (each block once, by the rank that reduced it): a reduce-scatter by
/// recursive halving and an allgather by recursive doubling over `p` blocks of whole
/// elements. The buffer must hold at least as many elements as the group has ranks.
pub fn allreduce_halving(
    comm: &dyn Comm,
    buf: &mut [u8],
    dtype: DataType,
    op: ReduceOp,
    factor: f64,
    scratch: &mut AlignedBuf,
) -> Result<()> {
    let f = Fold::new(comm.size());
    let Some(v) = fold_in(comm, &f, buf, scratch, dtype, op)? else {
        return fold_out(comm, &f, buf, true);
    };
    let es = dtype.size();
    let blocks: Vec<Range<usize>> = partition(buf.len() / es, f.p)
        .into_iter()
        .map(|b| b.start * es..b.end * es)
        .collect();
    let bytes = |lo: usize, hi: usize| blocks[lo].start..blocks[hi - 1].end;
    scratch.resize(buf.len());
    // Reduce-scatter: keep the half holding block v, send the other.
    let (mut lo, mut hi) = (0, f.p);
    let mut mask = f.p / 2;
    while mask >= 1 {
        let pv = v ^ mask;
        let mid = lo + (hi - lo) / 2;
        let (keep, give) = if v & mask == 0 {
            ((lo, mid), (mid, hi))
        } else {
            ((mid, hi), (lo, mid))
        };
        let (kr, gr) = (bytes(keep.0, keep.1), bytes(give.0, give.1));
        let (out, mine) = super::split2(buf, gr, kr.clone());
        let theirs = &mut scratch.as_mut_slice()[kr];
        comm.transfer(
            &mut [Send::new(f.real_of(pv), out)],
            &mut [Recv::new(f.real_of(pv), theirs)],
        )?;
        if v < pv {
            reduce_into(mine, theirs, dtype, op);
        } else {
            reduce_into(theirs, mine, dtype, op);
            mine.copy_from_slice(theirs);
        }
        (lo, hi) = keep;
        mask /= 2;
    }
    debug_assert_eq!((lo, hi), (v, v + 1));
    scale(&mut buf[blocks[v].clone()], dtype, factor);
    // Allgather: each step swaps the blocks held for the partner's as many.
    let mut mask = 1;
    while mask < f.p {
        let pv = v ^ mask;
        let theirs = (pv & !(mask - 1), (pv & !(mask - 1)) + mask);
        let (out, into) = super::split2(buf, bytes(lo, hi), bytes(theirs.0, theirs.1));
        comm.transfer(
            &mut [Send::new(f.real_of(pv), out)],
            &mut [Recv::new(f.real_of(pv), into)],
        )?;
        (lo, hi) = (lo.min(theirs.0), hi.max(theirs.1));
        mask <<= 1;
    }
    fold_out(comm, &f, buf, false)
}

/// Broadcast of the root's `buf` down a binomial tree: ranks numbered from the root,
/// a rank receives from the one its highest bit set less, then sends to those it
/// gives bits below that to, the farthest first.
pub fn broadcast_tree(comm: &dyn Comm, buf: &mut [u8], root: usize) -> Result<()> {
    let n = comm.size();
    let v = (comm.rank() + n - root) % n;
    let real = |v: usize| (v + root) % n;
    let mut mask = 1;
    while mask < n {
        if v & mask != 0 {
            comm.transfer(&mut [], &mut [Recv::new(real(v - mask), buf)])?;
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while mask > 0 {
        if v + mask < n {
            comm.transfer(&mut [Send::new(real(v + mask), buf)], &mut [])?;
        }
        mask >>= 1;
    }
    Ok(())
}

/// Bruck's allgather of blocks of `sizes[i]` bytes from rank `i`, laid out in rank
/// order in `buf` (this rank's in place): in step `k` a rank sends the blocks it holds
/// (its own and the next ones, up to 2^k) to rank `r - 2^k` and receives as many from
/// rank `r + 2^k`, through a scratch in the order `r, r+1, ...`.
pub fn allgatherv_bruck(comm: &dyn Comm, buf: &mut [u8], sizes: &[usize]) -> Result<()> {
    let (n, r) = (comm.size(), comm.rank());
    let parts = super::consecutive(sizes.iter().copied());
    let rotated = |i: usize| (r + i) % n;
    let at = super::consecutive((0..n).map(|i| sizes[rotated(i)]));
    let mut stage = AlignedBuf::zeroed(buf.len());
    let stage = stage.as_mut_slice();
    stage[at[0].clone()].copy_from_slice(&buf[parts[r].clone()]);
    let mut have = 1;
    while have < n {
        let count = have.min(n - have);
        let (to, from) = ((r + n - have) % n, (r + have) % n);
        // The sender's first `count` blocks are this rank's blocks `have..have + count`.
        let send_len = (0..count).map(|i| sizes[rotated(i)]).sum::<usize>();
        let recv = at[have].start..at[have + count - 1].end;
        let (out, into) = super::split2(stage, 0..send_len, recv);
        comm.transfer(&mut [Send::new(to, out)], &mut [Recv::new(from, into)])?;
        have += count;
    }
    for i in 1..n {
        buf[parts[rotated(i)].clone()].copy_from_slice(&stage[at[i].clone()]);
    }
    Ok(())
}

#[cfg(test)]
mod tests;

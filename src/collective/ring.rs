//! Ring algorithms: reduce-scatter, allgather, and allreduce as the two in
//! sequence. In step `s` of the reduce-scatter, rank `r` sends chunk
//! `r-s-1` to its right neighbour and receives chunk `r-s-2` from its left,
//! reducing it segment by segment as it arrives; after `n-1` steps rank `r`
//! owns the fully reduced chunk `r`. The allgather then circulates the owned
//! chunks for another `n-1` steps. Small buffers, and medium ones in large groups,
//! skip the ring ([`doubling::allreduce_steps`]): among few ranks every rank sends
//! its whole buffer to every other and reduces in rank order, one round trip
//! instead of `2(n-1)`; among more, the steps of [`doubling`].

use super::doubling::{self, Steps};
use super::{partition, reading, split2, striped, Comm};
use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::kernels::{reduce_into, round_through_half, scale, to_half, AlignedBuf};
use crate::transport::{Recv, Send};
use std::ops::Range;

/// The fewest ranks whose allgather ([`allgatherv`]) reads the others' blocks. Between
/// two, the ring, where one core writes into the segment while the other reads,
/// took 0.55-0.75 times the read's time from 256 KiB to 64 MiB a rank (measured:
/// benchmarks/NOTES.md); among three or more, reading led.
pub(super) const GATHER_READ_RANKS: usize = 3;

/// Reduces `buf` across the group in place, then multiplies every element
/// by `factor` (1: none; an Average's division, a postscale). Every rank
/// ends with identical bytes. The ring folds the multiplication into its
/// last reduction step, so each rank scales only the chunk it owns, while it
/// is in cache, and the allgather spreads the scaled bytes: no extra pass
/// over the buffer, and the same bytes as reducing and then scaling. A
/// large buffer between hosts is striped over the streams.
pub fn allreduce(
    comm: &dyn Comm,
    buf: &mut [u8],
    dtype: DataType,
    op: ReduceOp,
    factor: f64,
    scratch: &mut AlignedBuf,
) -> Result<()> {
    striped(comm, buf, dtype.size(), scratch, |c, b, s| {
        allreduce_one(c, b, dtype, op, factor, s)
    })
}

/// [`allreduce`] of `src` into `buf` (same length, apart): where the ring runs on
/// one stream, the reduce-scatter reads this rank's operand from `src` as each
/// chunk arrives, and every byte of `buf` is written once. Elsewhere (small
/// buffers, stripes) `src` is copied into `buf` first.
pub fn allreduce_from(
    comm: &dyn Comm,
    src: &[u8],
    buf: &mut [u8],
    dtype: DataType,
    op: ReduceOp,
    factor: f64,
    scratch: &mut AlignedBuf,
) -> Result<()> {
    assert_eq!(src.len(), buf.len(), "allreduce_from: lengths differ");
    let n = comm.size();
    if n == 1
        || doubling::allreduce_steps(n, buf.len(), dtype.size()) != Steps::Ring
        || super::stripe::stripes(comm, buf.len()) > 1
    {
        buf.copy_from_slice(src);
        return allreduce(comm, buf, dtype, op, factor, scratch);
    }
    let parts = byte_parts(buf.len(), dtype.size(), n);
    if reading::applies(comm, &parts) {
        reading::reduce_scatter(comm, Some(src), buf, &parts, dtype, op, factor, scratch)?;
        return allgather_ranges(comm, buf, &parts);
    }
    let (r, right, left) = (
        comm.rank(),
        (comm.rank() + 1) % n,
        (comm.rank() + n - 1) % n,
    );
    // Rank r first receives chunk r-s-2 in step s, so each is reduced from `src`
    // into `buf` once; from step 1 on, what it sends is a chunk it received.
    for s in 0..n - 1 {
        let sc = (r + 2 * n - s - 1) % n;
        let rc = (r + 2 * n - s - 2) % n;
        let f = if s == n - 2 { factor } else { 1.0 };
        let base = &src[parts[rc].clone()];
        if s == 0 {
            let dst = &mut buf[parts[rc].clone()];
            comm.transfer(
                &mut [Send::new(right, &src[parts[sc].clone()])],
                &mut [Recv::reducing_onto(left, dst, base, dtype, op, f)],
            )?;
        } else {
            let (out, dst) = split2(buf, parts[sc].clone(), parts[rc].clone());
            comm.transfer(
                &mut [Send::new(right, out)],
                &mut [Recv::reducing_onto(left, dst, base, dtype, op, f)],
            )?;
        }
    }
    ring_allgather(comm, buf, &parts)
}

/// [`allreduce`] on one stream.
fn allreduce_one(
    comm: &dyn Comm,
    buf: &mut [u8],
    dtype: DataType,
    op: ReduceOp,
    factor: f64,
    scratch: &mut AlignedBuf,
) -> Result<()> {
    let n = comm.size();
    if n == 1 || buf.is_empty() {
        scale(buf, dtype, factor);
        return Ok(());
    }
    match doubling::allreduce_steps(n, buf.len(), dtype.size()) {
        Steps::OneRound => {
            allreduce_direct(comm, buf, dtype, op, scratch)?;
            scale(buf, dtype, factor);
            return Ok(());
        }
        Steps::Doubling => {
            doubling::allreduce_doubling(comm, buf, dtype, op, scratch)?;
            scale(buf, dtype, factor);
            return Ok(());
        }
        Steps::Halving => {
            return doubling::allreduce_halving(comm, buf, dtype, op, factor, scratch);
        }
        Steps::Ring => {}
    }
    let parts = byte_parts(buf.len(), dtype.size(), n);
    if reading::applies(comm, &parts) {
        reading::reduce_scatter(comm, None, buf, &parts, dtype, op, factor, scratch)?;
        return allgather_ranges(comm, buf, &parts);
    }
    reduce_scatter_scaled(comm, buf, &parts, dtype, op, factor)?;
    ring_allgather(comm, buf, &parts)
}

/// Element ranges of `buf` (elements of `es` bytes) split into `n` chunks, as byte ranges.
pub(super) fn byte_parts(len: usize, es: usize, n: usize) -> Vec<Range<usize>> {
    partition(len / es, n)
        .into_iter()
        .map(|p| p.start * es..p.end * es)
        .collect()
}

/// Ring allreduce of a float32 buffer whose hops carry float16: every hop
/// (`everywhere`, PERSEUS_ALLREDUCE_DTYPE=0) or only those between two hosts
/// (PERSEUS_ALLREDUCE_DTYPE=2; hops within a host carry float32). Partial
/// sums stay float32: a receiver widens each float16 segment as it arrives
/// and adds it in. The owner of each reduced chunk rounds it through float16
/// before the allgather, so the chunk travels on without further loss and
/// every rank ends with the same bytes. Striped like [`allreduce`].
pub fn allreduce_half_links(
    comm: &dyn Comm,
    buf: &mut [u8],
    op: ReduceOp,
    everywhere: bool,
    scratch: &mut AlignedBuf,
) -> Result<()> {
    striped(comm, buf, 4, scratch, |c, b, s| {
        half_links_one(c, b, op, everywhere, s)
    })
}

/// [`allreduce_half_links`] on one stream.
fn half_links_one(
    comm: &dyn Comm,
    buf: &mut [u8],
    op: ReduceOp,
    everywhere: bool,
    scratch: &mut AlignedBuf,
) -> Result<()> {
    let n = comm.size();
    if n == 1 || buf.is_empty() {
        return Ok(());
    }
    let r = comm.rank();
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    let hop = Hop {
        right,
        left,
        send_half: everywhere || comm.host(right) != comm.host(r),
        recv_half: everywhere || comm.host(left) != comm.host(r),
    };
    let any_half = everywhere || (0..n).any(|p| comm.host(p) != comm.host(r));
    let parts = byte_parts(buf.len(), 4, n);
    scratch.resize(parts[0].len() / 2);
    let out16 = scratch.as_mut_slice();
    for s in 0..n - 1 {
        let sc = (r + 2 * n - s - 1) % n;
        let rc = (r + 2 * n - s - 2) % n;
        let (out, dst) = split2(buf, parts[sc].clone(), parts[rc].clone());
        hop.run(comm, out, dst, out16, Some(op))?;
    }
    if any_half {
        round_through_half(&mut buf[parts[r].clone()]);
    }
    for s in 0..n - 1 {
        let sc = (r + n - s) % n;
        let rc = (r + 2 * n - s - 1) % n;
        let (out, dst) = split2(buf, parts[sc].clone(), parts[rc].clone());
        hop.run(comm, out, dst, out16, None)?;
    }
    Ok(())
}

/// One step of [`allreduce_half_links`]: float32 chunks, float16 on its links.
struct Hop {
    right: usize,
    left: usize,
    send_half: bool,
    recv_half: bool,
}

impl Hop {
    /// Sends `out` right and receives the left neighbour's chunk into `dst`,
    /// reduced with `op` or (`None`) copied; `out16` stages outgoing float16.
    fn run(
        &self,
        comm: &dyn Comm,
        out: &[u8],
        dst: &mut [u8],
        out16: &mut [u8],
        op: Option<ReduceOp>,
    ) -> Result<()> {
        let out = if self.send_half {
            let staged = &mut out16[..out.len() / 2];
            to_half(staged, out, 1.0);
            &*staged
        } else {
            out
        };
        let recv = match (self.recv_half, op) {
            (true, op) => Recv::widening(self.left, dst, op),
            (false, Some(op)) => Recv::reducing(self.left, dst, DataType::F32, op),
            (false, None) => Recv::new(self.left, dst),
        };
        comm.transfer(&mut [Send::new(self.right, out)], &mut [recv])
    }
}

/// Every rank sends its buffer to every other, then reduces in rank order.
fn allreduce_direct(
    comm: &dyn Comm,
    buf: &mut [u8],
    dtype: DataType,
    op: ReduceOp,
    scratch: &mut AlignedBuf,
) -> Result<()> {
    let (n, r, len) = (comm.size(), comm.rank(), buf.len());
    scratch.resize(n * len);
    let blocks = scratch.as_mut_slice();
    blocks[r * len..(r + 1) * len].copy_from_slice(buf);
    {
        let mut sends: Vec<Send<'_>> = (0..n)
            .filter(|&p| p != r)
            .map(|p| Send::new(p, &*buf))
            .collect();
        let mut recvs: Vec<Recv<'_>> = blocks
            .chunks_mut(len)
            .enumerate()
            .filter(|(p, _)| *p != r)
            .map(|(p, b)| Recv::new(p, b))
            .collect();
        comm.transfer(&mut sends, &mut recvs)?;
    }
    let (first, rest) = blocks.split_at_mut(len);
    for other in rest.chunks(len) {
        reduce_into(first, other, dtype, op);
    }
    buf.copy_from_slice(first);
    Ok(())
}

/// Ring reduce-scatter over `counts` elements per rank (in rank order, summing
/// to the buffer); returns the byte range of `buf` this rank now owns, reduced.
pub fn reduce_scatter(
    comm: &dyn Comm,
    buf: &mut [u8],
    counts: &[usize],
    dtype: DataType,
    op: ReduceOp,
) -> Result<Range<usize>> {
    let es = dtype.size();
    let mut start = 0;
    let parts: Vec<Range<usize>> = counts
        .iter()
        .map(|c| {
            let r = start..start + c * es;
            start += c * es;
            r
        })
        .collect();
    assert_eq!(
        start,
        buf.len(),
        "reduce_scatter: counts do not cover the buffer"
    );
    if comm.size() > 1 {
        reduce_scatter_ranges(comm, buf, &parts, dtype, op)?;
    }
    Ok(parts[comm.rank()].clone())
}

pub(super) fn reduce_scatter_ranges(
    comm: &dyn Comm,
    buf: &mut [u8],
    parts: &[Range<usize>],
    dtype: DataType,
    op: ReduceOp,
) -> Result<()> {
    reduce_scatter_scaled(comm, buf, parts, dtype, op, 1.0)
}

/// The ring reduce-scatter; the last step, which completes this rank's own
/// chunk, multiplies each reduced segment by `factor` as it lands.
fn reduce_scatter_scaled(
    comm: &dyn Comm,
    buf: &mut [u8],
    parts: &[Range<usize>],
    dtype: DataType,
    op: ReduceOp,
    factor: f64,
) -> Result<()> {
    let (n, r) = (comm.size(), comm.rank());
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    for s in 0..n - 1 {
        let sc = (r + 2 * n - s - 1) % n;
        let rc = (r + 2 * n - s - 2) % n;
        let f = if s == n - 2 { factor } else { 1.0 };
        let (out, dst) = split2(buf, parts[sc].clone(), parts[rc].clone());
        let mut sends = [Send::new(right, out)];
        let mut recvs = [Recv::reducing_scaled(left, dst, dtype, op, f)];
        comm.transfer(&mut sends, &mut recvs)?;
    }
    Ok(())
}

/// The allgather of `parts` of `buf` (this rank's part in place): each rank reads
/// the others' parts out of their memory when every rank shares this host and can
/// ([`Comm::readable`]), the parts lie one after another over the whole buffer and
/// one is large ([`super::offer`]); otherwise the ring.
pub(super) fn allgather_ranges(
    comm: &dyn Comm,
    buf: &mut [u8],
    parts: &[Range<usize>],
) -> Result<()> {
    let (n, r, len) = (comm.size(), comm.rank(), buf.len());
    let tiled = parts
        .iter()
        .try_fold(0, |at, p| (p.start == at).then_some(p.end))
        == Some(buf.len());
    let direct = tiled
        && super::offer::all_readable(comm)
        && parts.iter().any(|p| p.len() >= super::offer::DIRECT_FROM);
    if !direct {
        return ring_allgather(comm, buf, parts);
    }
    let mut blocks = super::split_mut(buf, parts);
    let mine: &[u8] = std::mem::take::<&mut [u8]>(&mut blocks[r]);
    let gives: Vec<(usize, &[u8])> = (0..n).filter(|&p| p != r).map(|p| (p, mine)).collect();
    let mut takes: Vec<(usize, &mut [u8])> = blocks
        .into_iter()
        .enumerate()
        .filter(|&(p, _)| p != r)
        .collect();
    super::offer::exchange(comm, &gives, &mut takes, len)
}

/// The ring allgather: in step `s`, rank `r` passes part `r-s` to its right.
fn ring_allgather(comm: &dyn Comm, buf: &mut [u8], parts: &[Range<usize>]) -> Result<()> {
    let (n, r, len) = (comm.size(), comm.rank(), buf.len());
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    for s in 0..n - 1 {
        let sc = (r + n - s) % n;
        let rc = (r + 2 * n - s - 1) % n;
        let (out, dst) = split2(buf, parts[sc].clone(), parts[rc].clone());
        let recv = Recv::new(left, dst).of_result(len);
        comm.transfer(&mut [Send::new(right, out)], &mut [recv])?;
    }
    Ok(())
}

/// Allgather of blocks of `sizes[i]` bytes from rank `i`, laid out in rank order
/// in `buf`; this rank's block must already be in place. Among
/// [`GATHER_READ_RANKS`] or more, as [`allgather_ranges`]; between two, the ring.
pub fn allgatherv(comm: &dyn Comm, buf: &mut [u8], sizes: &[usize]) -> Result<()> {
    let parts = super::consecutive(sizes.iter().copied());
    assert_eq!(
        parts.last().map_or(0, |p| p.end),
        buf.len(),
        "allgatherv: sizes do not cover the buffer"
    );
    match comm.size() {
        1 => Ok(()),
        n if n > doubling::ONE_ROUND_MAX && buf.len() <= doubling::BRUCK_MAX => {
            doubling::allgatherv_bruck(comm, buf, sizes)
        }
        n if n < GATHER_READ_RANKS => ring_allgather(comm, buf, &parts),
        _ => allgather_ranges(comm, buf, &parts),
    }
}

//! Ring algorithms: reduce-scatter, allgather, and allreduce as the two in
//! sequence. In step `s` of the reduce-scatter, rank `r` sends chunk
//! `r-s-1` to its right neighbour and receives chunk `r-s-2` from its left,
//! reducing it segment by segment as it arrives; after `n-1` steps rank `r`
//! owns the fully reduced chunk `r`. The allgather then circulates the owned
//! chunks for another `n-1` steps. Small buffers skip the ring: every rank
//! sends its whole buffer to every other and reduces in rank order, one
//! round trip instead of `2(n-1)`.

use super::{partition, split2, Comm};
use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::kernels::{reduce_into, AlignedBuf};
use crate::transport::{Recv, Send};
use std::ops::Range;

/// Buffers up to this size use the direct exchange instead of the ring.
const DIRECT_MAX: usize = 64 << 10;

/// Reduces `buf` across the group in place. Every rank ends with identical bytes.
pub fn allreduce(
    comm: &dyn Comm,
    buf: &mut [u8],
    dtype: DataType,
    op: ReduceOp,
    scratch: &mut AlignedBuf,
) -> Result<()> {
    let n = comm.size();
    if n == 1 || buf.is_empty() {
        return Ok(());
    }
    if buf.len() <= DIRECT_MAX {
        return allreduce_direct(comm, buf, dtype, op, scratch);
    }
    let es = dtype.size();
    let parts: Vec<Range<usize>> = partition(buf.len() / es, n)
        .into_iter()
        .map(|p| p.start * es..p.end * es)
        .collect();
    reduce_scatter_ranges(comm, buf, &parts, dtype, op)?;
    allgather_ranges(comm, buf, &parts)
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

fn reduce_scatter_ranges(
    comm: &dyn Comm,
    buf: &mut [u8],
    parts: &[Range<usize>],
    dtype: DataType,
    op: ReduceOp,
) -> Result<()> {
    let (n, r) = (comm.size(), comm.rank());
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    for s in 0..n - 1 {
        let sc = (r + 2 * n - s - 1) % n;
        let rc = (r + 2 * n - s - 2) % n;
        let (out, dst) = split2(buf, parts[sc].clone(), parts[rc].clone());
        let mut sends = [Send::new(right, out)];
        let mut recvs = [Recv::reducing(left, dst, dtype, op)];
        comm.transfer(&mut sends, &mut recvs)?;
    }
    Ok(())
}

fn allgather_ranges(comm: &dyn Comm, buf: &mut [u8], parts: &[Range<usize>]) -> Result<()> {
    let (n, r) = (comm.size(), comm.rank());
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    for s in 0..n - 1 {
        let sc = (r + n - s) % n;
        let rc = (r + 2 * n - s - 1) % n;
        let (out, dst) = split2(buf, parts[sc].clone(), parts[rc].clone());
        comm.transfer(&mut [Send::new(right, out)], &mut [Recv::new(left, dst)])?;
    }
    Ok(())
}

/// Ring allgather of blocks of `sizes[i]` bytes from rank `i`, laid out in
/// rank order in `buf`; this rank's block must already be in place.
pub fn allgatherv(comm: &dyn Comm, buf: &mut [u8], sizes: &[usize]) -> Result<()> {
    let mut start = 0;
    let parts: Vec<Range<usize>> = sizes
        .iter()
        .map(|s| {
            let r = start..start + s;
            start += s;
            r
        })
        .collect();
    assert_eq!(
        start,
        buf.len(),
        "allgatherv: sizes do not cover the buffer"
    );
    if comm.size() == 1 {
        return Ok(());
    }
    allgather_ranges(comm, buf, &parts)
}

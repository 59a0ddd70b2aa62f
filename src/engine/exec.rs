//! Running one response on this rank: gather the local tensors (or zeros for
//! a joined rank), fuse, scale, call the collective, scatter the results and
//! complete the handles.

use super::handles::Output;
use super::message::{OpKind, Response};
use super::tensor::{OwnedTensor, TensorView};
use crate::collective::{self, Comm};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{PerseusError, Result};
use crate::kernels::{scale, AlignedBuf};

/// A local operation waiting for its response.
pub struct Entry {
    /// Handle to complete.
    pub handle: u64,
    /// Input tensor (absent for negotiation-only kinds).
    pub input: Option<TensorView>,
    /// Output tensor written in place (allreduce, broadcast).
    pub output: Option<TensorView>,
}

/// Reusable buffers of the engine thread.
#[derive(Default)]
pub struct Buffers {
    /// Fusion buffer.
    pub fusion: AlignedBuf,
    /// Scratch for the algorithms.
    pub scratch: AlignedBuf,
}

fn elems(shape: &[i64]) -> usize {
    shape.iter().product::<i64>().max(0) as usize
}

/// Executes a data-moving `Op` response. `entries[i]` belongs to `names[i]`
/// (`None` where this rank has joined). Returns one result per name.
pub fn run_op(
    comm: &dyn Comm,
    resp: &Response,
    entries: &[Option<Entry>],
    bufs: &mut Buffers,
) -> Vec<Result<Output>> {
    let Response::Op {
        kind,
        shapes,
        dtype,
        op,
        root,
        prescale,
        postscale,
        sizes,
        ..
    } = resp
    else {
        unreachable!("run_op takes Op responses");
    };
    let n = comm.size();
    let post = if *op == ReduceOp::Average {
        postscale / n as f64
    } else {
        *postscale
    };
    let one = |r: Result<Output>| vec![r];
    match kind {
        OpKind::Allreduce => allreduce(comm, shapes, *dtype, *op, *prescale, post, entries, bufs),
        OpKind::Broadcast => one((|| {
            let e = entries[0].as_ref().expect("broadcast entry");
            // SAFETY: the front-end keeps the tensor alive until completion.
            let buf = unsafe { e.output.as_ref().expect("broadcast buffer").bytes_mut() };
            collective::broadcast(comm, buf, *root as usize)?;
            Ok(Output::default())
        })()),
        OpKind::Allgather => one(allgather(comm, &shapes[0], *dtype, sizes, entries)),
        OpKind::Alltoall => one(alltoall(comm, &shapes[0], *dtype, sizes, entries)),
        OpKind::Reducescatter => one(reducescatter(
            comm, &shapes[0], *dtype, *op, *prescale, post, entries,
        )),
        _ => unreachable!("not a data-moving kind"),
    }
}

#[allow(clippy::too_many_arguments)]
fn allreduce(
    comm: &dyn Comm,
    shapes: &[Vec<i64>],
    dtype: DataType,
    op: ReduceOp,
    pre: f64,
    post: f64,
    entries: &[Option<Entry>],
    bufs: &mut Buffers,
) -> Vec<Result<Output>> {
    let sizes: Vec<usize> = shapes.iter().map(|s| elems(s) * dtype.size()).collect();
    let result = (|| -> Result<()> {
        if let [Some(Entry {
            input: Some(i),
            output: Some(o),
            ..
        })] = entries
        {
            // One tensor: reduce in the output's own memory.
            // SAFETY: the front-end keeps both tensors alive until completion.
            let out = unsafe { o.bytes_mut() };
            if i.ptr != o.ptr {
                out.copy_from_slice(unsafe { i.bytes() });
            }
            scale(out, dtype, pre);
            collective::allreduce(comm, out, dtype, op, &mut bufs.scratch)?;
            scale(out, dtype, post);
            return Ok(());
        }
        let total: usize = sizes.iter().sum();
        bufs.fusion.resize(total);
        let fused = bufs.fusion.as_mut_slice();
        let mut off = 0;
        for (e, &len) in entries.iter().zip(&sizes) {
            let dst = &mut fused[off..off + len];
            match e.as_ref().and_then(|e| e.input.as_ref()) {
                // SAFETY: as above.
                Some(i) => dst.copy_from_slice(unsafe { i.bytes() }),
                None => dst.fill(0),
            }
            off += len;
        }
        scale(fused, dtype, pre);
        collective::allreduce(comm, fused, dtype, op, &mut bufs.scratch)?;
        scale(fused, dtype, post);
        let mut off = 0;
        for (e, &len) in entries.iter().zip(&sizes) {
            if let Some(o) = e.as_ref().and_then(|e| e.output.as_ref()) {
                // SAFETY: as above.
                unsafe { o.bytes_mut() }.copy_from_slice(&fused[off..off + len]);
            }
            off += len;
        }
        Ok(())
    })();
    entries
        .iter()
        .map(|_| result.clone().map(|_| Output::default()))
        .collect()
}

fn input_of(entries: &[Option<Entry>]) -> Result<&TensorView> {
    entries[0]
        .as_ref()
        .and_then(|e| e.input.as_ref())
        .ok_or_else(|| PerseusError::Protocol("response names a tensor this rank lacks".into()))
}

fn allgather(
    comm: &dyn Comm,
    shape: &[i64],
    dtype: DataType,
    dims: &[i64],
    entries: &[Option<Entry>],
) -> Result<Output> {
    let input = input_of(entries)?;
    let row = elems(&shape[1..]) * dtype.size();
    let block: Vec<usize> = dims.iter().map(|&d| d as usize * row).collect();
    let mut out = AlignedBuf::zeroed(block.iter().sum());
    let off: usize = block[..comm.rank()].iter().sum();
    // SAFETY: the front-end keeps the input alive until completion.
    out.as_mut_slice()[off..off + block[comm.rank()]].copy_from_slice(unsafe { input.bytes() });
    collective::allgatherv(comm, out.as_mut_slice(), &block)?;
    let mut oshape = shape.to_vec();
    oshape[0] = dims.iter().sum();
    Ok(Output {
        tensor: Some(OwnedTensor {
            buf: out,
            dtype,
            shape: oshape,
        }),
        splits: dims.to_vec(),
        value: 0,
    })
}

fn ranges(sizes: impl Iterator<Item = usize>) -> Vec<std::ops::Range<usize>> {
    let mut start = 0;
    sizes
        .map(|s| {
            let r = start..start + s;
            start += s;
            r
        })
        .collect()
}

fn alltoall(
    comm: &dyn Comm,
    shape: &[i64],
    dtype: DataType,
    matrix: &[i64],
    entries: &[Option<Entry>],
) -> Result<Output> {
    let input = input_of(entries)?;
    let (n, r) = (comm.size(), comm.rank());
    let row = elems(&shape[1..]) * dtype.size();
    // SAFETY: the front-end keeps the input alive until completion.
    let inp = unsafe { input.bytes() };
    let send = ranges((0..n).map(|d| matrix[r * n + d] as usize * row));
    let got: Vec<i64> = (0..n).map(|s| matrix[s * n + r]).collect();
    let recv = ranges(got.iter().map(|&g| g as usize * row));
    let mut out = AlignedBuf::zeroed(recv.last().map_or(0, |x| x.end));
    collective::alltoallv(comm, inp, &send, out.as_mut_slice(), &recv)?;
    let mut oshape = shape.to_vec();
    oshape[0] = got.iter().sum();
    Ok(Output {
        tensor: Some(OwnedTensor {
            buf: out,
            dtype,
            shape: oshape,
        }),
        splits: got,
        value: 0,
    })
}

fn reducescatter(
    comm: &dyn Comm,
    shape: &[i64],
    dtype: DataType,
    op: ReduceOp,
    pre: f64,
    post: f64,
    entries: &[Option<Entry>],
) -> Result<Output> {
    let input = input_of(entries)?;
    let n = comm.size();
    let d0 = shape.first().copied().unwrap_or(1).max(0) as usize;
    let row_elems = elems(shape.get(1..).unwrap_or(&[]));
    let rows: Vec<usize> = collective::partition(d0, n)
        .iter()
        .map(|p| p.len())
        .collect();
    let counts: Vec<usize> = rows.iter().map(|r| r * row_elems).collect();
    // SAFETY: the front-end keeps the input alive until completion.
    let mut work = AlignedBuf::from_slice(unsafe { input.bytes() });
    scale(work.as_mut_slice(), dtype, pre);
    let own = collective::reduce_scatter(comm, work.as_mut_slice(), &counts, dtype, op)?;
    let mut out = AlignedBuf::from_slice(&work.as_slice()[own]);
    scale(out.as_mut_slice(), dtype, post);
    let mut oshape = if shape.is_empty() {
        vec![1]
    } else {
        shape.to_vec()
    };
    oshape[0] = rows[comm.rank()] as i64;
    Ok(Output {
        tensor: Some(OwnedTensor {
            buf: out,
            dtype,
            shape: oshape,
        }),
        splits: vec![],
        value: 0,
    })
}

//! Small blocking collectives run by the callers themselves: in a job whose ranks all
//! share one host, a caller about to wait for an allreduce, allgather, broadcast,
//! reduce-scatter or alltoall of a few KiB first tries it through the host's lane
//! ([`crate::transport::lane`]), reducing every rank's bytes in rank order (the same
//! result on every rank, or each rank's block of it), concatenating them (or each
//! rank's block for this one), or copying the root's. The engine thread
//! is never woken and the coordinator never asked, which is most of a lone small
//! operation's time. When the others do not come with the same operation within
//! the patience (PERSEUS_LANE_PATIENCE_US), every rank hands it to the engine as
//! usual, with its checks and errors (PERSEUS_LANE_BYTES).

use super::exec::{post_factor, result_buffer, scatter_rows, scattered};
use super::handles::Output;
use super::message::{shape_bytes, OpKind, Request};
use crate::collective::consecutive;
use crate::config::Config;
use crate::device::{Device, OwnedTensor, TensorView};
use crate::dtype::ReduceOp;
use crate::kernels::{copy_scaled, reduce_into, scale};
use crate::transport::lane::{Identity, Lane, DATA_BYTES, HEAD_BYTES};
use std::time::Duration;

/// Where an operation stands with the lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// Not an operation of the lane, on any rank.
    Never,
    /// Tried in the lane.
    Fits,
    /// An operation of the lane that this rank runs on the engine.
    Declined,
}

/// This rank's use of its host's lane.
pub struct CallerLane {
    lane: Lane,
    /// The largest allreduce tried, in bytes.
    limit: usize,
    /// How long to wait for the others.
    patience: Duration,
    /// More ranks than cores: waits give the core away.
    yielding: bool,
}

impl CallerLane {
    /// The lane for a job of `size` ranks, where every one of them shares it. With
    /// PERSEUS_LANE_BYTES 0 it takes nothing, but still declines its attempts, so
    /// that ranks whose settings differ never wait for this one.
    pub fn new(lane: Option<Lane>, config: &Config, size: usize) -> Option<CallerLane> {
        let lane = lane.filter(|l| l.members() == size && size > 1)?;
        Some(CallerLane {
            lane,
            limit: config.lane_bytes.min(DATA_BYTES),
            patience: config.lane_patience,
            yielding: config.oversubscribed(),
        })
    }

    /// Whether `req` is tried in the lane: an allreduce (not Adasum, its output the
    /// input's size), an allgather or alltoall (rows of one byte or more), a
    /// broadcast (of one byte or more) or a reduce-scatter (not Adasum, not of a
    /// scalar) of the global set, of host tensors, is an attempt of the lane on every
    /// rank alike (a function of the request only), so ranks stay in step.
    /// [`Fit::Fits`] when its bytes are within this rank's limit too; else this rank
    /// declines the attempt ([`CallerLane::decline`]): the others, whose rows may fit
    /// (an allgather's or alltoall's), give it up at once.
    pub fn fit(
        &self,
        req: &Request,
        input: Option<&TensorView>,
        output: Option<&TensorView>,
    ) -> Fit {
        // A broadcast has its buffer only, as output; the others an input.
        let Some(data) = input.or(output) else {
            return Fit::Never;
        };
        let host = [input, output]
            .into_iter()
            .flatten()
            .all(|t| t.device == Device::Cpu);
        let fits = data.nbytes <= self.limit;
        let kind = match (req.kind, input) {
            (OpKind::Allreduce, Some(input)) => {
                req.op != ReduceOp::Adasum
                    && input.nbytes > 0
                    && output.is_some_and(|o| o.nbytes == input.nbytes)
            }
            (OpKind::Allgather, Some(input)) => !input.shape.is_empty() && row_bytes(input) > 0,
            (OpKind::Broadcast, None) => data.nbytes > 0,
            (OpKind::Reducescatter, Some(input)) => {
                req.op != ReduceOp::Adasum && !input.shape.is_empty() && input.nbytes > 0
            }
            (OpKind::Alltoall, Some(input)) => !input.shape.is_empty() && row_bytes(input) > 0,
            _ => false,
        };
        match (req.process_set == 0 && host && kind, fits) {
            (false, _) => Fit::Never,
            (true, true) => Fit::Fits,
            (true, false) => Fit::Declined,
        }
    }

    /// Passes this rank's attempt for an operation of the lane that it runs on the
    /// engine.
    pub fn decline(&self) {
        self.lane.decline();
    }

    /// Says that this rank waits in a join: the others stop waiting for it.
    pub fn step_away(&self) {
        self.lane.step_away();
    }

    /// Runs the operation in the lane; its result, or None when every rank gave it
    /// up (nothing written).
    pub fn run(
        &self,
        req: &Request,
        input: Option<&TensorView>,
        output: Option<&TensorView>,
    ) -> Option<Output> {
        match req.kind {
            OpKind::Allreduce => self.allreduce(req, input?, output?).then(Output::default),
            OpKind::Broadcast => self.broadcast(req, output?).then(Output::default),
            OpKind::Reducescatter => self.reducescatter(req, input?, output),
            OpKind::Alltoall => self.alltoall(req, input?, output),
            _ => self.allgather(req, input?, output),
        }
    }

    fn allreduce(&self, req: &Request, input: &TensorView, output: &TensorView) -> bool {
        let post = post_factor(req.op, req.postscale, self.lane.members());
        // SAFETY: the caller holds the output alive and unused until the operation
        // completes (Horovod's contract); the input, which may be the same memory, was
        // read into this rank's part before.
        let reduce = |parts: &[&[u8]]| {
            let out = unsafe { output.bytes_mut() };
            reduce_in_order(out, parts.iter().copied(), req, post);
        };
        self.exchange_scaled(req, input, reduce).is_some()
    }

    /// Exchanges every rank's whole input, times the prescale factor: what a
    /// reduction's `then` reduces.
    fn exchange_scaled<R>(
        &self,
        req: &Request,
        input: &TensorView,
        then: impl FnOnce(&[&[u8]]) -> R,
    ) -> Option<R> {
        // The request's shape is in the hashes: every part has this length.
        let identity = Identity {
            hashes: req.fingerprint(),
            len: input.nbytes,
        };
        // SAFETY: the caller holds the input alive and unchanged until the operation
        // completes (Horovod's contract).
        let fill =
            |part: &mut [u8]| copy_scaled(part, unsafe { input.bytes() }, req.dtype, req.prescale);
        self.lane
            .exchange(identity, fill, self.patience, self.yielding, then)
    }

    /// Overwrites `buf` with the root's bytes on every other rank; the root's own is
    /// only read (it may be the caller's input, as the engine's broadcast allows).
    fn broadcast(&self, req: &Request, buf: &TensorView) -> bool {
        // The global set: the root's place in the lane is its rank.
        let root = usize::try_from(req.root).unwrap_or(usize::MAX);
        let mine = self.lane.me() == root;
        // The shape and the root are in the hashes; only the root sends bytes.
        let identity = Identity {
            hashes: req.fingerprint(),
            len: if mine { buf.nbytes } else { 0 },
        };
        // SAFETY (both): as in `exchange_scaled`; no rank writes the root's buffer.
        let fill = |part: &mut [u8]| {
            if mine {
                part.copy_from_slice(unsafe { buf.bytes() });
            }
        };
        let copy = |parts: &[&[u8]]| {
            if !mine {
                unsafe { buf.bytes_mut() }.copy_from_slice(parts[root]);
            }
        };
        self.lane
            .exchange(identity, fill, self.patience, self.yielding, copy)
            .is_some()
    }

    /// Reduces this rank's block of rows of every rank's input, in rank order, into
    /// `output` where it has the block's size, else into a tensor of the core's own.
    fn reducescatter(
        &self,
        req: &Request,
        input: &TensorView,
        output: Option<&TensorView>,
    ) -> Option<Output> {
        let (n, me) = (self.lane.members(), self.lane.me());
        let post = post_factor(req.op, req.postscale, n);
        let (rows, row_elems) = scatter_rows(&input.shape, n);
        let row = row_elems * req.dtype.size();
        let mine = consecutive(rows.iter().map(|r| r * row))[me].clone();
        let reduce = |parts: &[&[u8]]| {
            let mut own = None;
            let out = result_buffer(output, mine.len(), &mut own);
            reduce_in_order(out, parts.iter().map(|p| &p[mine.clone()]), req, post);
            scattered(own, req.dtype, &input.shape, rows[me])
        };
        self.exchange_scaled(req, input, reduce)
    }

    /// Sends `req.ints[d]` rows of `input` to each rank `d`: every rank's part is its
    /// row counts (one u64 for each rank) and its whole input; each takes its block of
    /// each part, in rank order, into `output` where it has the result's size, else into
    /// a tensor of the core's own (as the engine's alltoall does).
    fn alltoall(
        &self,
        req: &Request,
        input: &TensorView,
        output: Option<&TensorView>,
    ) -> Option<Output> {
        let (n, me) = (self.lane.members(), self.lane.me());
        let (row, head) = (row_bytes(input), counts_bytes(n));
        // Ranks send different numbers of rows, split differently.
        let mut like = req.clone();
        like.shape[0] = 0;
        like.ints.clear();
        let identity = Identity {
            hashes: like.fingerprint(),
            len: head + input.nbytes,
        };
        // SAFETY: as in `exchange_scaled`.
        let fill = |part: &mut [u8]| {
            for (slot, &rows) in part[..head].chunks_exact_mut(8).zip(&req.ints) {
                slot.copy_from_slice(&(rows as u64).to_le_bytes());
            }
            part[head..].copy_from_slice(unsafe { input.bytes() });
        };
        let gather = |parts: &[&[u8]]| {
            // Each sender's counts were checked on its own rank (they sum to its rows).
            let counts = |p: &[u8]| -> Vec<usize> {
                p[..head]
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
                    .collect()
            };
            let blocks: Vec<&[u8]> = parts
                .iter()
                .map(|p| {
                    let block = consecutive(counts(p).into_iter().map(|k| k * row))[me].clone();
                    &p[head + block.start..head + block.end]
                })
                .collect();
            concatenated(&blocks, input, output)
        };
        self.lane
            .exchange(identity, fill, self.patience, self.yielding, gather)
    }

    /// Concatenates every rank's rows into `output` where it has the result's size,
    /// else into a tensor of the core's own (as the engine's allgather does).
    fn allgather(
        &self,
        req: &Request,
        input: &TensorView,
        output: Option<&TensorView>,
    ) -> Option<Output> {
        // Ranks may send different numbers of rows (unless the result stacks them).
        let mut like = req.clone();
        if !req.stack {
            like.shape[0] = 0;
        }
        let identity = Identity {
            hashes: like.fingerprint(),
            len: input.nbytes,
        };
        // SAFETY: as in `exchange_scaled`.
        let fill = |part: &mut [u8]| part.copy_from_slice(unsafe { input.bytes() });
        let gather = |parts: &[&[u8]]| concatenated(parts, input, output);
        self.lane
            .exchange(identity, fill, self.patience, self.yielding, gather)
    }
}

/// Writes into `out` the first of `parts` reduced with the others by `req`'s op, in
/// their order, then scaled by `post`: the same bytes on every rank given the same parts.
fn reduce_in_order<'a>(
    out: &mut [u8],
    mut parts: impl Iterator<Item = &'a [u8]>,
    req: &Request,
    post: f64,
) {
    out.copy_from_slice(parts.next().expect("a lane has members"));
    for p in parts {
        reduce_into(out, p, req.dtype, req.op);
    }
    scale(out, req.dtype, post);
}

/// `blocks` (whole rows of `input`'s shape) one after the other in `output` where it has
/// their size, else in a tensor of the core's own; the splits are each block's rows.
fn concatenated(blocks: &[&[u8]], input: &TensorView, output: Option<&TensorView>) -> Output {
    let row = row_bytes(input);
    let total = blocks.iter().map(|b| b.len()).sum();
    let mut own = None;
    let out = result_buffer(output, total, &mut own);
    let mut at = 0;
    for b in blocks {
        out[at..at + b.len()].copy_from_slice(b);
        at += b.len();
    }
    let splits: Vec<i64> = blocks.iter().map(|b| (b.len() / row) as i64).collect();
    let mut shape = input.shape.clone();
    shape[0] = splits.iter().sum();
    Output {
        tensor: own.map(|buf| OwnedTensor {
            buf,
            dtype: input.dtype,
            shape,
        }),
        splits,
        value: 0,
    }
}

/// Bytes of an alltoall's row counts in its part of the lane, for `n` ranks (within
/// the part's header).
fn counts_bytes(n: usize) -> usize {
    debug_assert!(n * 8 <= HEAD_BYTES);
    n * 8
}

/// Bytes of one row (dimension 0) of `t`.
fn row_bytes(t: &TensorView) -> usize {
    shape_bytes(&t.shape[1..], t.dtype)
}

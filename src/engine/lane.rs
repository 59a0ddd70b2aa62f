//! Small blocking allreduces run by the callers themselves: in a job whose ranks
//! all share one host, a caller about to wait for an allreduce of a few KiB first
//! tries it through the host's lane ([`crate::transport::lane`]), reducing every
//! rank's bytes in rank order (the same result on every rank). The engine thread
//! is never woken and the coordinator never asked, which is most of a lone small
//! operation's time. When the others do not come with the same operation within
//! the patience (PERSEUS_LANE_PATIENCE_US), every rank hands it to the engine as
//! usual, with its checks and errors (PERSEUS_LANE_BYTES).

use super::message::{OpKind, Request};
use crate::config::Config;
use crate::device::{Device, TensorView};
use crate::dtype::ReduceOp;
use crate::kernels::{copy_scaled, reduce_into, scale};
use crate::transport::lane::{Identity, Lane, SLOT_BYTES};
use std::time::Duration;

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
    /// The lane for a job of `size` ranks, where every one of them shares it and
    /// PERSEUS_LANE_BYTES allows.
    pub fn new(lane: Option<Lane>, config: &Config, size: usize) -> Option<CallerLane> {
        let lane = lane.filter(|l| l.members() == size && size > 1)?;
        (config.lane_bytes > 0).then(|| CallerLane {
            lane,
            limit: config.lane_bytes.min(SLOT_BYTES),
            patience: config.lane_patience,
            yielding: config.oversubscribed(),
        })
    }

    /// True when `req` is tried in the lane: an allreduce of the global set of
    /// host tensors, within the limit, not Adasum. A function of the request and
    /// the job's settings only, so every rank decides alike.
    pub fn takes(&self, req: &Request, input: &TensorView, output: &TensorView) -> bool {
        req.kind == OpKind::Allreduce
            && req.process_set == 0
            && req.op != ReduceOp::Adasum
            && input.device == Device::Cpu
            && output.device == Device::Cpu
            && (1..=self.limit).contains(&input.nbytes)
            && output.nbytes == input.nbytes
    }

    /// Runs the allreduce in the lane; true when `output` holds the result, false
    /// when every rank gave it up (nothing written).
    pub fn allreduce(&self, req: &Request, input: &TensorView, output: &TensorView) -> bool {
        let n = self.lane.members();
        let (dtype, op) = (req.dtype, req.op);
        let post = match op {
            ReduceOp::Average => req.postscale / n as f64,
            _ => req.postscale,
        };
        let identity = Identity {
            hashes: req.fingerprint(),
            len: input.nbytes,
        };
        // SAFETY (both): the caller holds the tensors alive and unused until the
        // operation completes (Horovod's contract); the input is read before the
        // output, which may be the same memory, is written.
        let fill =
            |part: &mut [u8]| copy_scaled(part, unsafe { input.bytes() }, dtype, req.prescale);
        let reduce = |parts: &[&[u8]]| {
            let out = unsafe { output.bytes_mut() };
            out.copy_from_slice(parts[0]);
            for p in &parts[1..] {
                reduce_into(out, p, dtype, op);
            }
            scale(out, dtype, post);
        };
        self.lane
            .exchange(identity, fill, self.patience, self.yielding, reduce)
            .is_some()
    }
}

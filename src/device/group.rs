//! Collectives among the ranks' devices ([`DeviceGroup`]), and how ranks form one:
//! each offers its device's identity, every rank learns every offer ([`agree`]), and
//! an [`Opener`] forms the group where all can take part. NCCL's live in `crate::gpu`;
//! the engine's tests use host memory in their place.

use std::sync::Arc;

use super::memory::{pageable, HostRegion};
use super::tensor::Device;
use super::watch::Watch;
use crate::collective::{allgatherv, Comm};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{PerseusError, Result};

/// Collectives among the ranks' devices, and the device work around them. Work is
/// queued in order and complete once [`DeviceGroup::finish`] returns.
pub trait DeviceGroup: Send + Sync {
    /// This rank within the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// Independent communicators a buffer may be split across (at least 1).
    fn channels(&self) -> usize;
    /// A device buffer of at least `bytes`, reused from call to call.
    fn fusion(&self, bytes: usize) -> Result<*mut u8>;
    /// Queues a copy of `bytes` from `src` to `dst`.
    ///
    /// # Safety
    /// For this and every other method taking pointers: they are device memory of
    /// this group's device, alive and used by no one else until
    /// [`DeviceGroup::finish`] returns.
    unsafe fn copy(&self, src: *const u8, dst: *mut u8, bytes: usize) -> Result<()>;
    /// Queues `x *= factor` on `count` elements of floating `dtype`.
    ///
    /// # Safety
    /// As for [`DeviceGroup::copy`].
    unsafe fn scale(&self, buf: *mut u8, count: usize, dtype: DataType, factor: f64) -> Result<()>;
    /// Queues a cast of `count` float32 values at `src`, times `factor`, to float16 at
    /// `dst`.
    ///
    /// # Safety
    /// As for [`DeviceGroup::copy`].
    unsafe fn cast_down(
        &self,
        src: *const u8,
        dst: *mut u8,
        count: usize,
        factor: f32,
    ) -> Result<()>;
    /// Queues a cast of `count` float16 values at `src` to float32 at `dst`, times
    /// `factor`.
    ///
    /// # Safety
    /// As for [`DeviceGroup::copy`].
    unsafe fn cast_up(&self, src: *const u8, dst: *mut u8, count: usize, factor: f32)
        -> Result<()>;
    /// Which of `parts` (each `count` values of `dtype` at a pointer) hold a value
    /// that is not finite, once the work queued so far has run: their positions in
    /// `parts`. One check for them all, with one wait (as `watch` allows).
    ///
    /// # Safety
    /// As for [`DeviceGroup::copy`].
    unsafe fn nonfinite(
        &self,
        parts: &[(*const u8, usize)],
        dtype: DataType,
        watch: &Watch<'_>,
    ) -> Result<Vec<usize>>;
    /// Queues an in-place allreduce of `count` elements on channel `channel`
    /// (`op` is never Average or Adasum). Queueing may wait for the library (a
    /// non-blocking NCCL communicator launches each collective from a thread of its
    /// own), as `watch` allows; a wait that gives up abandons the group, as in
    /// [`DeviceGroup::finish`].
    ///
    /// # Safety
    /// As for [`DeviceGroup::copy`].
    unsafe fn allreduce(
        &self,
        channel: usize,
        buf: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        watch: &Watch<'_>,
    ) -> Result<()>;
    /// Queues an in-place broadcast of `bytes` from group rank `root` (queueing waits
    /// as in [`DeviceGroup::allreduce`]).
    ///
    /// # Safety
    /// As for [`DeviceGroup::copy`].
    unsafe fn broadcast(
        &self,
        buf: *mut u8,
        bytes: usize,
        root: usize,
        watch: &Watch<'_>,
    ) -> Result<()>;
    /// Queues an in-place reduce-scatter: `buf` holds `size() * chunk` elements, and
    /// this rank's chunk (at `rank() * chunk`) ends reduced (queueing waits as in
    /// [`DeviceGroup::allreduce`]).
    ///
    /// # Safety
    /// As for [`DeviceGroup::copy`].
    unsafe fn reduce_scatter(
        &self,
        buf: *mut u8,
        chunk: usize,
        dtype: DataType,
        op: ReduceOp,
        watch: &Watch<'_>,
    ) -> Result<()>;
    /// Queues an in-place allgather of chunks of `chunk` elements, this rank's at
    /// `rank() * chunk` (queueing waits as in [`DeviceGroup::allreduce`]).
    ///
    /// # Safety
    /// As for [`DeviceGroup::copy`].
    unsafe fn allgather(
        &self,
        buf: *mut u8,
        chunk: usize,
        dtype: DataType,
        watch: &Watch<'_>,
    ) -> Result<()>;
    /// Copies device memory at `src` into `dst`, once the work queued so far has run
    /// (waits for it, as `watch` allows). `pinned`: `dst` is page-locked memory of
    /// [`DeviceGroup::host_region`], which the copy fills without the host waiting on
    /// it, so only its end is waited for.
    ///
    /// # Safety
    /// As for [`DeviceGroup::copy`].
    unsafe fn download(
        &self,
        src: *const u8,
        dst: &mut [u8],
        pinned: bool,
        watch: &Watch<'_>,
    ) -> Result<()>;
    /// Copies `src` into device memory at `dst`, after the work queued so far; `src`
    /// must stay alive until [`DeviceGroup::finish`] returns.
    ///
    /// # Safety
    /// As for [`DeviceGroup::copy`].
    unsafe fn upload(&self, src: &[u8], dst: *mut u8) -> Result<()>;
    /// Waits until all queued work has run, as `watch` allows: a wait that gives up
    /// (a device error, a peer that ended, the peer timeout) aborts the group as
    /// [`DeviceGroup::abandon`] does and returns the error.
    fn finish(&self, watch: &Watch<'_>) -> Result<()>;
    /// After a failed collective: stops this rank's part in the work queued (the
    /// communicators are aborted, so no peer waits for it forever) and waits until the
    /// device no longer touches any tensor. Every later call fails, naming `why`.
    fn abandon(&self, why: &str);
    /// Host memory of `bytes` for copies to and from the device: page-locked where the
    /// device can pin it, ordinary memory otherwise.
    fn host_region(&self, bytes: usize) -> Box<dyn HostRegion> {
        pageable(bytes)
    }
}

/// Why the direct path is not taken for a process set, or that it is.
#[derive(Debug, Clone, PartialEq)]
pub enum Agreement {
    /// Every rank can, each on its own device.
    Direct,
    /// Not taken, and why (the same words on every rank).
    Staged(String),
}

/// Decides, with every member of `comm`, whether the set takes the direct path.
/// `offer` is this rank's device identity (its UUID), or why it cannot take part.
pub fn agree(comm: &dyn Comm, offer: std::result::Result<[u8; 16], String>) -> Result<Agreement> {
    let n = comm.size();
    let mine: Vec<u8> = match &offer {
        Ok(id) => std::iter::once(1).chain(id.iter().copied()).collect(),
        Err(why) => std::iter::once(0).chain(why.bytes()).collect(),
    };
    // Lengths first, then the offers themselves.
    let mut lens = vec![0u8; 8 * n];
    lens[8 * comm.rank()..8 * comm.rank() + 8].copy_from_slice(&(mine.len() as u64).to_le_bytes());
    allgatherv(comm, &mut lens, &vec![8; n])?;
    let sizes: Vec<usize> = lens
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
        .collect();
    if sizes.iter().any(|&s| s == 0 || s > 1 << 16) {
        return Err(PerseusError::Protocol(format!(
            "a device offer of an impossible length: {sizes:?}"
        )));
    }
    let starts = starts(sizes.iter().copied());
    let mut all = vec![0u8; sizes.iter().sum()];
    let me = starts[comm.rank()];
    all[me..me + mine.len()].copy_from_slice(&mine);
    allgatherv(comm, &mut all, &sizes)?;
    let offers: Vec<&[u8]> = starts
        .iter()
        .zip(&sizes)
        .map(|(&s, &l)| &all[s..s + l])
        .collect();
    let refused: Vec<String> = offers
        .iter()
        .enumerate()
        .filter(|(_, o)| o[0] == 0)
        .map(|(r, o)| format!("rank {r}: {}", String::from_utf8_lossy(&o[1..])))
        .collect();
    if !refused.is_empty() {
        return Ok(Agreement::Staged(refused.join("; ")));
    }
    for a in 0..n {
        for b in a + 1..n {
            if comm.host(a) == comm.host(b) && offers[a] == offers[b] {
                return Ok(Agreement::Staged(format!(
                    "ranks {a} and {b} share one GPU (NCCL needs a GPU per rank)"
                )));
            }
        }
    }
    Ok(Agreement::Direct)
}

/// Where each of consecutive parts of these lengths starts.
pub fn starts(lens: impl Iterator<Item = usize>) -> Vec<usize> {
    lens.scan(0, |at, len| {
        let here = *at;
        *at += len;
        Some(here)
    })
    .collect()
}

/// A group formed, or why not.
pub type Formed = std::result::Result<Arc<dyn DeviceGroup>, String>;

/// How a rank takes part in forming a group: NCCL on CUDA devices in builds with the
/// `cuda` feature; stand-ins in the tests.
pub trait Opener: Send {
    /// This rank's identity of `device` (its UUID), or why it cannot take part.
    fn offer(&self, device: Device) -> std::result::Result<[u8; 16], String>;
    /// Forms this rank's group: the ranks `members` of `comm` (every member of
    /// `comm` calls it together, each with its own group's members, after [`agree`]
    /// answered [`Agreement::Direct`]), waiting for the device's library as `watch`
    /// allows; `Ok(Err(why))` when it could not be formed, the same on every rank.
    fn open(
        &self,
        comm: &dyn Comm,
        device: Device,
        channels: usize,
        members: &[usize],
        watch: &Watch<'_>,
    ) -> Result<Formed>;
}

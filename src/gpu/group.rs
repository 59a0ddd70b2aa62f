//! The device-direct path on CUDA ([`DeviceGroup`]): NCCL communicators among the
//! ranks of a process set, each rank on its own GPU.
//!
//! Streams: copies, casts and scales run on the device's Perseus stream (the one the
//! front-end exports tensors with, so the framework's work is already ordered before
//! them). Each channel (`PERSEUS_ALLREDUCE_STREAMS`) is one communicator with its own
//! stream; a collective on it waits for the Perseus stream's work with an event, and
//! the Perseus stream waits for the channels' events before its next copy, so the
//! channels of one split buffer run side by side. Nothing waits on the whole device.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{result, sys};

use super::nccl::{Communicator, Progress};
use super::runtime::{driver, lock, CudaDevice, NONFINITE, SCALE};
use crate::device::{wait_for, DeviceGroup, DeviceMemory, HostRegion, Waited, Watch};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{PerseusError, Result};

/// One channel: a communicator, its stream, and the event marking its last work.
pub(super) struct Channel {
    pub(super) comm: Communicator,
    pub(super) stream: sys::CUstream,
    pub(super) done: sys::CUevent,
}

/// Stream bookkeeping and buffers, behind the group's mutex.
struct State {
    /// Recorded on the Perseus stream: channels wait on it, and waits poll it.
    ready: sys::CUevent,
    /// Channels with work the Perseus stream has not waited for yet.
    pending: Vec<usize>,
    fusion: sys::CUdeviceptr,
    fusion_len: usize,
    /// The finiteness flags, four bytes each.
    flags: sys::CUdeviceptr,
    /// Flags `flags` has room for.
    flags_len: usize,
    /// Their copy in pinned host memory (so that the copy is queued, not blocking),
    /// and the flags it has room for.
    host_flags: *mut i32,
    host_flags_len: usize,
    /// Why the group was abandoned (its communicators aborted), once it was.
    broken: Option<String>,
}

/// How long an abandoned group waits for its streams to drain once its communicators
/// are aborted (NCCL ends their kernels at once; this bounds a driver that does not).
const DRAIN: Duration = Duration::from_secs(10);

/// The ranks of one process set, each on its own GPU, joined by NCCL.
pub struct NcclGroup {
    dev: Arc<CudaDevice>,
    channels: Vec<Channel>,
    rank: usize,
    size: usize,
    state: Mutex<State>,
}

// SAFETY: the raw handles are driver handles, usable from any thread once the
// device's context is current there (every method binds it); the mutable state is
// behind the mutex.
unsafe impl Send for NcclGroup {}
unsafe impl Sync for NcclGroup {}

/// Every kernel the direct path launches, by source: the scales (prescale, postscale,
/// Average's 1/n), the float16 casts and the finiteness checks of
/// `PERSEUS_ALLREDUCE_DTYPE=0` and the hierarchical mode.
pub(crate) const DIRECT_KERNELS: &[(&str, &[&str])] = &[
    ("scale", &SCALE),
    ("cast", &[CAST_DOWN, CAST_UP]),
    ("nancheck", &NONFINITE),
];

/// The casts of the float16 paths: float32 to float16 times a factor, and back.
const CAST_DOWN: &str = "f32_to_f16_scaled";
const CAST_UP: &str = "f16_to_f32_scaled";

impl NcclGroup {
    pub(super) fn new(
        dev: Arc<CudaDevice>,
        channels: Vec<Channel>,
        ready: sys::CUevent,
        flag: sys::CUdeviceptr,
        rank: usize,
        size: usize,
    ) -> NcclGroup {
        NcclGroup {
            dev,
            channels,
            rank,
            size,
            state: Mutex::new(State {
                ready,
                pending: Vec::new(),
                fusion: 0,
                fusion_len: 0,
                flags: flag,
                flags_len: 1,
                host_flags: std::ptr::null_mut(),
                host_flags_len: 0,
                broken: None,
            }),
        }
    }

    /// Binds the device and makes the Perseus stream wait for every channel's work;
    /// returns the state, ready for work on the Perseus stream.
    fn main(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        self.dev.bind()?;
        let mut st = lock(&self.state);
        usable(&st)?;
        for c in std::mem::take(&mut st.pending) {
            // SAFETY: the stream and the event live as long as the group.
            unsafe {
                result::stream::wait_event(
                    self.dev.stream,
                    self.channels[c].done,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(driver("cuStreamWaitEvent"))?;
        }
        Ok(st)
    }

    /// Queues cast kernel `name` of `count` values on the Perseus stream.
    fn cast(
        &self,
        name: &'static str,
        src: *const u8,
        dst: *mut u8,
        count: usize,
        factor: f32,
    ) -> Result<()> {
        let _st = self.main()?;
        let f = self.dev.kernel("cast", name)?;
        self.dev
            .cast(f, src as u64, dst as u64, factor, count as u64)
    }

    /// Queues `call` on channel `c`'s stream, after the Perseus stream's work so far.
    /// A call that NCCL finishes in the background (every collective of a non-blocking
    /// communicator) is waited for as `watch` allows before anything else is queued on
    /// the channel: NCCL's thread queues the kernel only then.
    fn on_channel(
        &self,
        c: usize,
        watch: &Watch<'_>,
        call: impl FnOnce(&Channel) -> Result<Progress>,
    ) -> Result<()> {
        self.dev.bind()?;
        let mut st = lock(&self.state);
        usable(&st)?;
        let ch = &self.channels[c];
        // SAFETY: the streams and events live as long as the group.
        unsafe {
            // Recorded for every call (cheap), so `ready` always covers all the work
            // queued on the Perseus stream so far, even after an earlier error.
            result::event::record(st.ready, self.dev.stream).map_err(driver("cuEventRecord"))?;
            result::stream::wait_event(
                ch.stream,
                st.ready,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(driver("cuStreamWaitEvent"))?;
            if call(ch)? == Progress::Pending {
                let others = || self.trouble(Some(c));
                if let Waited::Stopped(why) = ch.comm.settle(watch, others)? {
                    return Err(self.give_up(&mut st, &why, Some(c)));
                }
            }
            result::event::record(ch.done, ch.stream).map_err(driver("cuEventRecord"))?;
        }
        if !st.pending.contains(&c) {
            st.pending.push(c);
        }
        Ok(())
    }

    /// Waits for the work queued on the Perseus stream (after [`NcclGroup::main`] made
    /// it wait for the channels), polling as `watch` allows. A wait that gives up (an
    /// NCCL error, a peer that ended, the peer timeout) abandons the group and says
    /// why.
    fn wait(&self, st: &mut State, watch: &Watch<'_>) -> Result<()> {
        // SAFETY: the event and the stream live as long as the group.
        unsafe { result::event::record(st.ready, self.dev.stream) }
            .map_err(driver("cuEventRecord"))?;
        let ready = st.ready;
        let done = || {
            // SAFETY: as above.
            match unsafe { result::event::query(ready) } {
                Ok(()) => Ok(true),
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
                Err(e) => Err(driver("cuEventQuery")(e)),
            }
        };
        match wait_for(watch, done, || self.trouble(None))? {
            Waited::Done => Ok(()),
            Waited::Stopped(why) => Err(self.give_up(st, &why, None)),
        }
    }

    /// The first NCCL error among the channels (but `skip`), naming its channel.
    fn trouble(&self, skip: Option<usize>) -> Option<String> {
        self.channels
            .iter()
            .enumerate()
            .filter(|&(c, _)| Some(c) != skip)
            .find_map(|(c, ch)| ch.comm.async_error().map(|e| format!("channel {c}: {e}")))
    }

    /// Abandons the group after a wait gave up for `why` (on channel `pending`'s
    /// background work, if any); the error to report.
    fn give_up(&self, st: &mut State, why: &str, pending: Option<usize>) -> PerseusError {
        let msg = format!(
            "{why}; this rank aborted the NCCL communicators of its process set, whose \
             device collectives fail from now on"
        );
        self.abort(st, &msg, pending);
        PerseusError::Device(msg)
    }

    /// Aborts every channel's communicator, so that their queued collectives end on
    /// this rank without waiting for the peers, and waits (up to [`DRAIN`]) until the
    /// streams are idle, so that nothing touches the tensors after this returns. The
    /// group is broken from then on.
    fn abort(&self, st: &mut State, why: &str, pending: Option<usize>) {
        if st.broken.is_some() {
            return;
        }
        st.broken = Some(why.to_string());
        abort_all(&self.channels, pending);
        let streams: Vec<sys::CUstream> = std::iter::once(self.dev.stream)
            .chain(self.channels.iter().map(|ch| ch.stream))
            .collect();
        let idle = || {
            Ok(streams.iter().all(|&s| {
                // SAFETY: the streams live as long as the group; a query only reads.
                let r = unsafe { sys::cuStreamQuery(s) };
                r != sys::CUresult::CUDA_ERROR_NOT_READY
            }))
        };
        if let Ok(Waited::Stopped(_)) = wait_for(&Watch::alone(DRAIN), idle, || None) {
            crate::log!(
                crate::log::Level::Warning,
                "the device streams were still busy {} s after NCCL's \
                 abort; a tensor of the failed collective may still change",
                DRAIN.as_secs()
            );
        }
    }

    /// The finiteness flags, room for `n`, on the device (grown on the Perseus stream)
    /// and in pinned host memory.
    fn flags(&self, st: &mut State, n: usize) -> Result<(sys::CUdeviceptr, *mut i32)> {
        if n > st.host_flags_len {
            let want = n.next_power_of_two();
            // SAFETY: every earlier copy into the old buffer was waited for (a group
            // whose wait gave up is broken, and never comes here again).
            unsafe {
                if !st.host_flags.is_null() {
                    result::free_host(st.host_flags.cast()).map_err(driver("cuMemFreeHost"))?;
                    st.host_flags = std::ptr::null_mut();
                    st.host_flags_len = 0;
                }
                st.host_flags = result::malloc_host(want * 4, 0)
                    .map_err(driver("cuMemHostAlloc"))?
                    .cast();
            }
            st.host_flags_len = want;
        }
        if n > st.flags_len {
            let want = n.next_power_of_two();
            // SAFETY: the old flags' users are ordered before this point of the Perseus
            // stream, which frees them and makes the new ones.
            unsafe {
                result::free_async(st.flags, self.dev.stream).map_err(driver("cuMemFreeAsync"))?;
                st.flags_len = 0;
                st.flags = result::malloc_async(self.dev.stream, want * 4)
                    .map_err(driver("cuMemAllocAsync"))?;
            }
            st.flags_len = want;
        }
        Ok((st.flags, st.host_flags))
    }
}

/// Aborts every channel's communicator at once, each from a thread of its own: an
/// abort frees memory, which waits for the kernels of the device, and a channel's kernel
/// spinning on a lost peer ends only once its own communicator is aborted, so aborting
/// them one after another could wait forever (NCCL 2.19 and later allow aborts from
/// several threads). Channel `pending`, whose background work this thread started, is
/// aborted on this thread: an abort joins that work, which older NCCL tracks per thread.
fn abort_all(channels: &[Channel], pending: Option<usize>) {
    match channels {
        [one] => one.comm.abort(),
        _ => std::thread::scope(|s| {
            for (c, ch) in channels.iter().enumerate() {
                if Some(c) != pending {
                    let comm = &ch.comm;
                    s.spawn(move || comm.abort());
                }
            }
            if let Some(c) = pending {
                channels[c].comm.abort();
            }
        }),
    }
}

/// An error naming why the group was abandoned, once it was.
fn usable(st: &State) -> Result<()> {
    match &st.broken {
        None => Ok(()),
        Some(why) => Err(PerseusError::Device(format!(
            "this process set's NCCL group was abandoned after an earlier error: {why}"
        ))),
    }
}

impl DeviceGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn channels(&self) -> usize {
        self.channels.len()
    }

    fn fusion(&self, bytes: usize) -> Result<*mut u8> {
        let mut st = self.main()?;
        if bytes > st.fusion_len {
            // SAFETY: the old buffer's users are all ordered before this point of the
            // Perseus stream (`main` joined the channels).
            unsafe {
                if st.fusion_len > 0 {
                    result::free_async(st.fusion, self.dev.stream)
                        .map_err(driver("cuMemFreeAsync"))?;
                    st.fusion_len = 0;
                }
                let want = bytes.next_power_of_two().max(1 << 20);
                st.fusion = result::malloc_async(self.dev.stream, want)
                    .map_err(driver("cuMemAllocAsync"))?;
                st.fusion_len = want;
            }
        }
        Ok(st.fusion as *mut u8)
    }

    unsafe fn copy(&self, src: *const u8, dst: *mut u8, bytes: usize) -> Result<()> {
        let _st = self.main()?;
        if bytes == 0 {
            return Ok(());
        }
        result::memcpy_dtod_async(dst as u64, src as u64, bytes, self.dev.stream)
            .map_err(driver("cuMemcpyDtoDAsync"))
    }

    unsafe fn scale(&self, buf: *mut u8, count: usize, dtype: DataType, factor: f64) -> Result<()> {
        let _st = self.main()?;
        self.dev.scale(buf as u64, count, dtype, factor)
    }

    unsafe fn cast_down(
        &self,
        src: *const u8,
        dst: *mut u8,
        count: usize,
        factor: f32,
    ) -> Result<()> {
        self.cast(CAST_DOWN, src, dst, count, factor)
    }

    unsafe fn cast_up(
        &self,
        src: *const u8,
        dst: *mut u8,
        count: usize,
        factor: f32,
    ) -> Result<()> {
        self.cast(CAST_UP, src, dst, count, factor)
    }

    unsafe fn nonfinite(
        &self,
        parts: &[(*const u8, usize)],
        dtype: DataType,
        watch: &Watch<'_>,
    ) -> Result<Vec<usize>> {
        if !matches!(dtype, DataType::F32 | DataType::F16) || parts.is_empty() {
            return Ok(Vec::new());
        }
        let mut st = self.main()?;
        let (flags, host) = self.flags(&mut st, parts.len())?;
        result::memset_d8_async(flags, 0, parts.len() * 4, self.dev.stream)
            .map_err(driver("cuMemsetD8Async"))?;
        for (i, &(buf, count)) in parts.iter().enumerate() {
            self.dev
                .nonfinite(buf as u64, count, dtype, flags + 4 * i as u64)?;
        }
        // Pinned memory: the copy is queued behind the checks, and one watched wait
        // covers both.
        let host = std::slice::from_raw_parts_mut(host, parts.len());
        result::memcpy_dtoh_async(host, flags, self.dev.stream)
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        self.wait(&mut st, watch)?;
        Ok((0..parts.len()).filter(|&i| host[i] != 0).collect())
    }

    unsafe fn allreduce(
        &self,
        channel: usize,
        buf: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        watch: &Watch<'_>,
    ) -> Result<()> {
        self.on_channel(channel, watch, |ch| {
            ch.comm
                .allreduce(buf as u64, buf as u64, count, dtype, op, ch.stream as u64)
        })
    }

    unsafe fn broadcast(
        &self,
        buf: *mut u8,
        bytes: usize,
        root: usize,
        watch: &Watch<'_>,
    ) -> Result<()> {
        self.on_channel(0, watch, |ch| {
            ch.comm.broadcast(buf as u64, bytes, root, ch.stream as u64)
        })
    }

    unsafe fn reduce_scatter(
        &self,
        buf: *mut u8,
        chunk: usize,
        dtype: DataType,
        op: ReduceOp,
        watch: &Watch<'_>,
    ) -> Result<()> {
        self.on_channel(0, watch, |ch| {
            ch.comm
                .reduce_scatter(buf as u64, self.rank, chunk, dtype, op, ch.stream as u64)
        })
    }

    unsafe fn allgather(
        &self,
        buf: *mut u8,
        chunk: usize,
        dtype: DataType,
        watch: &Watch<'_>,
    ) -> Result<()> {
        self.on_channel(0, watch, |ch| {
            ch.comm
                .allgather(buf as u64, self.rank, chunk, dtype, ch.stream as u64)
        })
    }

    unsafe fn download(
        &self,
        src: *const u8,
        dst: &mut [u8],
        pinned: bool,
        watch: &Watch<'_>,
    ) -> Result<()> {
        let mut st = self.main()?;
        // A copy into pageable memory may block until it is done: waiting for the work
        // before it (NCCL's, which a lost peer can hold forever) is the watched wait.
        // One into page-locked memory is queued at once, and the wait below covers it.
        if !pinned {
            self.wait(&mut st, watch)?;
        }
        if !dst.is_empty() {
            result::memcpy_dtoh_async(dst, src as u64, self.dev.stream)
                .map_err(driver("cuMemcpyDtoHAsync"))?;
        }
        self.wait(&mut st, watch)
    }

    unsafe fn upload(&self, src: &[u8], dst: *mut u8) -> Result<()> {
        let _st = self.main()?;
        if src.is_empty() {
            return Ok(());
        }
        result::memcpy_htod_async(dst as u64, src, self.dev.stream)
            .map_err(driver("cuMemcpyHtoDAsync"))
    }

    fn finish(&self, watch: &Watch<'_>) -> Result<()> {
        let mut st = self.main()?;
        self.wait(&mut st, watch)
    }

    fn host_region(&self, bytes: usize) -> Box<dyn HostRegion> {
        self.dev.host_region(bytes)
    }

    fn abandon(&self, why: &str) {
        let _ = self.dev.bind();
        let mut st = lock(&self.state);
        self.abort(&mut st, why, None);
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        // An abandoned group's streams were drained when it was abandoned.
        if self.finish(&Watch::alone(DRAIN)).is_err() && lock(&self.state).broken.is_none() {
            return;
        }
        let st = lock(&self.state);
        // The communicators first, all at once: an abort needs no peer, where
        // ncclCommDestroy waits for every rank of the host to destroy its own, and a
        // peer that died never does. (Drop then finds them aborted.)
        if st.broken.is_none() {
            abort_all(&self.channels, None);
        }
        // SAFETY: all work is done; each handle is released once.
        unsafe {
            if !st.host_flags.is_null() {
                let _ = result::free_host(st.host_flags.cast());
            }
            if st.fusion_len > 0 {
                let _ = result::free_async(st.fusion, self.dev.stream);
            }
            if st.flags_len > 0 {
                let _ = result::free_async(st.flags, self.dev.stream);
            }
            let _ = result::event::destroy(st.ready);
            for ch in &self.channels {
                let _ = result::event::destroy(ch.done);
                let _ = result::stream::destroy(ch.stream);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::DIRECT_KERNELS;
    use crate::gpu::kernels::{kernel_names, SOURCES};

    #[test]
    fn the_kernels_loaded_at_the_offer_are_the_direct_paths_and_exist() {
        for (source, names) in DIRECT_KERNELS {
            let body = SOURCES
                .iter()
                .find(|(n, _)| n == source)
                .map(|(_, b)| *b)
                .unwrap_or_else(|| panic!("no kernel source {source}"));
            let defined = kernel_names(body);
            for name in *names {
                assert!(defined.iter().any(|d| d == name), "{source}: {name}");
            }
        }
        let all: Vec<&str> = DIRECT_KERNELS
            .iter()
            .flat_map(|(_, n)| n.iter())
            .copied()
            .collect();
        for k in [
            "scale_f32",
            "scale_bf16",
            "f32_to_f16_scaled",
            "f16_to_f32_scaled",
        ] {
            assert!(all.contains(&k), "{k}: {all:?}");
        }
        assert!(all.contains(&"nonfinite_f16") && all.contains(&"nonfinite_f32"));
    }
}

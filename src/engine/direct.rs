//! The device-direct path: when every rank's tensors are in its own GPU, allreduce
//! and broadcast run between the devices (NCCL) and never touch host memory.
//!
//! Several tensors of a fused allreduce are packed into one device buffer; the
//! prescale, the postscale and the 1/n of an Average are kernels on that buffer; a
//! float32 gradient under `PERSEUS_ALLREDUCE_DTYPE=0` is cast to float16 on the device
//! and summed as float16, and a sum that overflowed is redone exactly, as on the other
//! paths. A large buffer is split across the group's channels (one communicator and
//! stream each, `PERSEUS_ALLREDUCE_STREAMS`).
//!
//! Whether a process set takes this path is decided once, by every member together
//! ([`agree`]), so that all ranks always run the same algorithm: each offers its
//! device, or says why it cannot, and the path is taken only when all can and no two
//! ranks of a host share a device.
//!
//! The device side is a [`DeviceGroup`]: the installed device library's, and the tests
//! use host memory and the CPU ring in its place, which is how CI checks this logic
//! without a GPU.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::exec::{Buffers, Entry, Outcome};
use super::message::{OpKind, Response};
use crate::collective::{partition, Comm};
use crate::compress::{self, HalfReduce, Resent, Wire};
use crate::config::NcclUse;
use crate::device::group::starts;
use crate::device::{agree, Agreement, Device, DeviceGroup, Formed, Opener, Watch};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{PerseusError, Result};
use crate::kernels::AlignedBuf;

/// Fewest bytes worth a channel of their own when a buffer is split.
pub const MIN_CHANNEL_BYTES: usize = 1 << 20;

/// Byte alignment of each tensor in the fusion buffer.
const ALIGN: usize = 256;

/// True when a response may run on the device-direct path: every rank's tensors are
/// on a device and the operation is one the devices do (a function of the response
/// alone, so every rank answers the same).
pub fn supports(resp: &Response) -> bool {
    let Response::Op {
        kind,
        dtype,
        op,
        prescale,
        postscale,
        plan,
        ..
    } = resp
    else {
        return false;
    };
    if !plan.device {
        return false;
    }
    let floating = matches!(
        dtype,
        DataType::F16 | DataType::BF16 | DataType::F32 | DataType::F64
    );
    match kind {
        OpKind::Broadcast => true,
        OpKind::Allreduce => {
            let scaled = *prescale != 1.0 || *postscale != 1.0 || *op == ReduceOp::Average;
            let nccl_type = !matches!(dtype, DataType::Bool | DataType::I16 | DataType::U16);
            nccl_type && *op != ReduceOp::Adasum && (floating || !scaled)
        }
        _ => false,
    }
}

fn elems(shape: &[i64]) -> usize {
    shape.iter().product::<i64>().max(0) as usize
}

fn aligned(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN) * ALIGN
}

/// Where a response runs.
#[derive(Clone, Copy)]
pub enum Route<'a> {
    /// One group over the whole set.
    Flat(&'a dyn DeviceGroup),
    /// A group of this host's ranks, and between hosts the CPU transport among the
    /// ranks with this rank's local index (allreduce only).
    Hierarchical(&'a dyn DeviceGroup, &'a dyn Comm),
}

/// Runs a response that [`supports`] accepted, every entry present, along `route`,
/// in a set of `size` ranks; `bufs` holds the host copy of the hierarchical stage
/// between hosts, and `watch` bounds each wait for the device.
///
/// A response the route cannot run is refused before anything is queued, the same on
/// every rank, and the group stays usable. Any error after that, whatever its kind,
/// leaves the route's device group abandoned ([`DeviceGroup::abandon`]) before the
/// handles complete: a copy, kernel or collective may already be queued (the Average's
/// scale kernel, say, comes after the collective), so its work could still write
/// tensors the framework has taken back, and a collective that failed on this rank
/// alone would otherwise hold its peers in NCCL.
pub fn run_direct(
    route: Route<'_>,
    size: usize,
    resp: &Response,
    entries: &[Option<Entry>],
    bufs: &mut Buffers,
    watch: &Watch<'_>,
) -> Outcome {
    let Response::Op { kind, root, .. } = resp else {
        unreachable!("run_direct takes Op responses");
    };
    let entries: Vec<&Entry> = entries.iter().flatten().collect();
    let fail = |e: PerseusError| Outcome {
        results: entries.iter().map(|_| Err(e.clone())).collect(),
        resent: None,
    };
    // Validation: nothing is queued yet.
    if let Err(e) = runnable(resp, route) {
        return fail(e);
    }
    let (Route::Flat(group) | Route::Hierarchical(group, _)) = route;
    let job = Job {
        group,
        size,
        resp,
        entries: &entries,
        watch,
    };
    let result: Result<Option<Resent>> = match route {
        Route::Flat(_) if *kind == OpKind::Broadcast => job.broadcast(*root as usize).map(|_| None),
        Route::Flat(_) => job.allreduce(),
        Route::Hierarchical(_, cross) => job.hierarchical(cross, bufs),
    };
    match result {
        Ok(resent) => Outcome {
            results: entries.iter().map(|_| Ok(Default::default())).collect(),
            resent,
        },
        Err(e) => {
            // Work may be queued: stop it (NCCL's abort) and wait for the streams to
            // drain before any handle completes.
            group.abandon(&e.to_string());
            fail(e)
        }
    }
}

/// Whether `route` runs `resp`: a response [`supports`] accepts, and on the
/// hierarchical route an allreduce. The same answer on every rank, found before
/// anything is queued.
fn runnable(resp: &Response, route: Route<'_>) -> Result<()> {
    let Response::Op { kind, .. } = resp else {
        unreachable!("run_direct takes Op responses");
    };
    if !supports(resp) {
        return Err(PerseusError::InvalidArgument(format!(
            "this {} has no device-direct path",
            kind.name()
        )));
    }
    if matches!(route, Route::Hierarchical(..)) && *kind != OpKind::Allreduce {
        return Err(PerseusError::InvalidArgument(format!(
            "{} has no hierarchical device path",
            kind.name()
        )));
    }
    Ok(())
}

/// The memory an entry is reduced in: its output, or its input when it has none.
fn target(e: &Entry) -> (*mut u8, usize) {
    let v = e
        .output
        .as_ref()
        .or(e.input.as_ref())
        .expect("a data-moving entry has a tensor");
    (v.ptr, v.nbytes)
}

/// Queues a copy of an entry's input into its output when they differ.
unsafe fn input_to_output(group: &dyn DeviceGroup, e: &Entry) -> Result<()> {
    if let (Some(i), Some(o)) = (&e.input, &e.output) {
        if i.ptr != o.ptr {
            group.copy(i.ptr, o.ptr, o.nbytes)?;
        }
    }
    Ok(())
}

/// One response on one device group (the host's, for a hierarchical allreduce): what
/// each of its steps works on.
struct Job<'a> {
    group: &'a dyn DeviceGroup,
    /// Ranks in the process set.
    size: usize,
    resp: &'a Response,
    entries: &'a [&'a Entry],
    watch: &'a Watch<'a>,
}

impl Job<'_> {
    /// Broadcasts each tensor, in place, from group rank `root`.
    fn broadcast(&self, root: usize) -> Result<()> {
        let Job {
            group,
            entries,
            watch,
            ..
        } = *self;
        for e in entries {
            let (buf, bytes) = target(e);
            // SAFETY: the front-end keeps the tensors alive until completion.
            unsafe {
                if group.rank() == root {
                    input_to_output(group, e)?;
                }
                group.broadcast(buf, bytes, root, watch)?;
            }
        }
        group.finish(watch)
    }

    /// The flat allreduce: float16 under `PERSEUS_ALLREDUCE_DTYPE=0`, else exact
    /// ([`compress::allreduce`]).
    fn allreduce(&self) -> Result<Option<Resent>> {
        let Response::Op {
            dtype, op, plan, ..
        } = self.resp
        else {
            unreachable!("allreduce takes Op responses");
        };
        // The flat route treats every link alike: float16 between hosts only is the
        // hierarchical route's.
        let wire = match compress::wire(*dtype, *op, plan.encoding, plan.scale, self.size, || 1) {
            w @ Wire::Half { .. } => w,
            _ => Wire::Exact,
        };
        compress::allreduce(&mut Flat(self), wire)
    }

    /// The exact allreduce: in the tensor's own memory when there is one, else packed in
    /// the fusion buffer.
    fn exact(&self) -> Result<()> {
        let Job {
            group,
            size,
            resp,
            entries,
            watch,
        } = *self;
        let Response::Op { dtype, shapes, .. } = resp else {
            unreachable!("exact takes Op responses");
        };
        let dtype = *dtype;
        let (pre, post, op) = factors(resp, size);
        // SAFETY: the front-end keeps the tensors alive until completion; the fusion
        // buffer holds every packed tensor.
        unsafe {
            let (buf, count) = if let [e] = entries {
                input_to_output(group, e)?;
                (target(e).0, elems(&shapes[0]))
            } else {
                pack(group, entries, dtype, |c| c)?
            };
            if pre != 1.0 {
                group.scale(buf, count, dtype, pre)?;
            }
            allreduce_split(group, buf, count, dtype, op, watch)?;
            if post != 1.0 {
                group.scale(buf, count, dtype, post)?;
            }
            if entries.len() > 1 {
                unpack(group, entries, buf)?;
            }
        }
        group.finish(watch)
    }

    /// The float16 allreduce of float32 gradients, cast on the device. Returns the
    /// positions of the tensors whose float16 sums are not finite (then nothing was
    /// written, and the caller resends exactly).
    fn compressed(&self, wire: Wire) -> Result<Vec<usize>> {
        let Job {
            group,
            size,
            resp,
            entries,
            watch,
        } = *self;
        let Response::Op { shapes, .. } = resp else {
            unreachable!("compressed takes Op responses");
        };
        let (pre, post, _) = factors(resp, size);
        let counts: Vec<usize> = shapes.iter().map(|s| elems(s)).collect();
        let total: usize = counts.iter().sum();
        // SAFETY: as in `exact`; the image holds `total` float16 values.
        unsafe {
            let image = group.fusion(total * 2)?;
            let mut at = 0;
            for (e, &n) in entries.iter().zip(&counts) {
                let src = e.input.as_ref().or(e.output.as_ref()).expect("a tensor");
                group.cast_down(src.ptr, image.add(at * 2), n, wire.down(pre) as f32)?;
                at += n;
            }
            allreduce_split(group, image, total, DataType::F16, ReduceOp::Sum, watch)?;
            // One check of the whole image, and only when it fails one of each tensor.
            let whole = [(image as *const u8, total)];
            if !group.nonfinite(&whole, DataType::F16, watch)?.is_empty() {
                let parts: Vec<(*const u8, usize)> = starts(counts.iter().copied())
                    .into_iter()
                    .zip(&counts)
                    .map(|(at, &n)| (image.add(at * 2) as *const u8, n))
                    .collect();
                let bad = group.nonfinite(&parts, DataType::F16, watch)?;
                if !bad.is_empty() {
                    return Ok(bad);
                }
            }
            let mut at = 0;
            for (e, &n) in entries.iter().zip(&counts) {
                let dst = target(e).0;
                group.cast_up(image.add(at * 2), dst, n, wire.up(post) as f32)?;
                at += n;
            }
        }
        group.finish(watch)?;
        Ok(Vec::new())
    }

    /// Whether the sums of the tensors at `which` are all finite, once complete.
    fn finite(&self, which: &[usize]) -> Result<bool> {
        if which.is_empty() {
            return Ok(true);
        }
        let parts: Vec<(*const u8, usize)> = which
            .iter()
            .map(|&i| {
                let (buf, bytes) = target(self.entries[i]);
                (buf as *const u8, bytes / 4)
            })
            .collect();
        // SAFETY: as in `exact`; the sums are complete after `finish`.
        Ok(unsafe { self.group.nonfinite(&parts, DataType::F32, self.watch)? }.is_empty())
    }

    /// The hierarchical allreduce: a reduce-scatter among this host's devices leaves
    /// each local rank one chunk of the host's sum; the ranks with the same local index
    /// allreduce their chunk across hosts through host memory (the CPU transport); an
    /// allgather among the host's devices shares the chunks.
    ///
    /// Under a float16 plan (`PERSEUS_ALLREDUCE_DTYPE` 0 or 2), a float32 Sum or Average
    /// crosses hosts as float16: each rank casts its chunk on the device (times the
    /// gradient scale), and only the float16 bytes go to host memory and over the wire;
    /// within the host NCCL stays float32. Returns, as [`Job::allreduce`] does, the tensors
    /// whose float16 sums were not finite (redone exactly, from the inputs, on every
    /// rank) and whether their exact sums are.
    fn hierarchical(&self, cross: &dyn Comm, bufs: &mut Buffers) -> Result<Option<Resent>> {
        let Response::Op {
            dtype, op, plan, ..
        } = self.resp
        else {
            unreachable!("hierarchical takes Op responses");
        };
        // Only the links between hosts carry float16, under either encoding.
        let n = cross.size();
        let wire = compress::wire(*dtype, *op, plan.encoding, plan.scale, n, || n);
        compress::allreduce(
            &mut Hierarchical {
                job: self,
                cross,
                bufs,
            },
            wire,
        )
    }

    /// The element type of the response's tensors.
    fn dtype(&self) -> DataType {
        let Response::Op { dtype, .. } = self.resp else {
            unreachable!("the direct path takes Op responses");
        };
        *dtype
    }

    /// One hierarchical allreduce, exact between hosts or (`half`: the gradient scale)
    /// float16 there. Returns the tensors whose float16 sums are not finite; then no
    /// output was written.
    fn hierarchical_pass(
        &self,
        cross: &dyn Comm,
        bufs: &mut Buffers,
        half: Option<f64>,
    ) -> Result<Vec<usize>> {
        let (local, entries, dtype) = (self.group, self.entries, self.dtype());
        let (pre, _, op) = factors(self.resp, self.size);
        let l = local.size();
        // Room for `l` chunks and, under float16, one chunk's float16 image after them.
        let room = |c: usize| {
            let chunk = c.div_ceil(l);
            chunk * l + half.map_or(0, |_| chunk.div_ceil(2))
        };
        // SAFETY: as in `exact`; the buffer holds `l` chunks and the image.
        let (buf, count) = unsafe {
            let (buf, count) = pack(local, entries, dtype, room)?;
            if pre != 1.0 {
                local.scale(buf, count, dtype, pre)?;
            }
            local.reduce_scatter(buf, count.div_ceil(l), dtype, op, self.watch)?;
            (buf, count)
        };
        // The chunk's host copy, in a region of the pool the staged path uses too:
        // page-locked where the device pins it, so its copies queue without the host
        // waiting and run at the bus's full speed.
        let chunk = count.div_ceil(l);
        let bytes = chunk * half.map_or(dtype.size(), |_| 2);
        let mut region = bufs.staging.take(bytes, |n| local.host_region(n));
        let pinned = region.pinned();
        let host = Host {
            bytes: &mut region.bytes()[..bytes],
            pinned,
        };
        // SAFETY: as above; the region outlives the pass's device work (`finish`).
        let result =
            unsafe { self.across_and_back(cross, host, &mut bufs.scratch, buf, count, half) };
        match result {
            Ok(_) => bufs.staging.give(region),
            // Copies queued to or from it may outlast the error, until the group,
            // which is abandoned next, has drained its streams: it is never reused
            // (nor freed, which would wait for them).
            Err(_) => std::mem::forget(region),
        }
        result
    }

    /// The rest of a hierarchical pass, once the host's sums are scattered in the
    /// fusion buffer `buf` (`count` elements): this rank's chunk crosses the hosts
    /// through `host`, exact or as float16, and comes back; the chunks are gathered,
    /// checked under float16, scaled and unpacked.
    ///
    /// # Safety
    /// `buf` is the pass's fusion buffer, packed by [`pack`] with the pass's room.
    unsafe fn across_and_back(
        &self,
        cross: &dyn Comm,
        host: Host<'_>,
        scratch: &mut AlignedBuf,
        buf: *mut u8,
        count: usize,
        half: Option<f64>,
    ) -> Result<Vec<usize>> {
        let (local, entries, watch, dtype) = (self.group, self.entries, self.watch, self.dtype());
        let (_, post, op) = factors(self.resp, self.size);
        let l = local.size();
        let chunk = count.div_ceil(l);
        let first = local.rank() * chunk;
        let mine = buf.add(first * dtype.size());
        // Under float16: the elements each tensor spans.
        let live: Vec<std::ops::Range<usize>> = match half {
            None => Vec::new(),
            Some(_) => layout(entries)
                .into_iter()
                .map(|r| r.start / dtype.size()..r.end / dtype.size())
                .collect(),
        };
        let Host { bytes, pinned } = host;
        match half {
            None => {
                local.download(mine, bytes, pinned, watch)?;
                crate::collective::allreduce(cross, bytes, dtype, op, 1.0, scratch)?;
                local.upload(bytes, mine)?;
            }
            Some(scale) => {
                let image = buf.add(l * chunk * dtype.size());
                local.cast_down(mine, image, chunk, scale as f32)?;
                local.download(image, bytes, pinned, watch)?;
                // The gaps between packed tensors hold stale bytes; zeroed here, every
                // element of the gathered buffer is a tensor's or zero, so one check
                // over all of it speaks for the tensors alone.
                clear_gaps(bytes, first, &live);
                let f16 = DataType::F16;
                crate::collective::allreduce(cross, bytes, f16, ReduceOp::Sum, 1.0, scratch)?;
                local.upload(bytes, image)?;
                local.cast_up(image, mine, chunk, (1.0 / scale) as f32)?;
            }
        }
        local.allgather(buf, chunk, dtype, watch)?;
        // One check of the whole buffer (the gaps are zero), and only when it
        // fails one more, of each tensor.
        let whole = [(buf as *const u8, l * chunk)];
        if half.is_some() && !local.nonfinite(&whole, dtype, watch)?.is_empty() {
            let parts: Vec<(*const u8, usize)> = live
                .iter()
                .map(|r| (buf.add(r.start * dtype.size()) as *const u8, r.len()))
                .collect();
            let bad = local.nonfinite(&parts, dtype, watch)?;
            if !bad.is_empty() {
                local.finish(watch)?;
                return Ok(bad);
            }
        }
        if post != 1.0 {
            local.scale(buf, count, dtype, post)?;
        }
        unpack(local, entries, buf)?;
        local.finish(watch)?;
        Ok(Vec::new())
    }
}

/// The flat route's float16 passes.
struct Flat<'j, 'a>(&'j Job<'a>);

impl HalfReduce for Flat<'_, '_> {
    fn half(&mut self, wire: Wire) -> Result<Vec<usize>> {
        self.0.compressed(wire)
    }
    fn exact(&mut self, check: &[usize]) -> Result<bool> {
        self.0.exact()?;
        self.0.finite(check)
    }
}

/// The hierarchical route's passes: float16 only across hosts.
struct Hierarchical<'j, 'a, 'b> {
    job: &'j Job<'a>,
    cross: &'b dyn Comm,
    bufs: &'b mut Buffers,
}

impl HalfReduce for Hierarchical<'_, '_, '_> {
    fn half(&mut self, wire: Wire) -> Result<Vec<usize>> {
        self.job
            .hierarchical_pass(self.cross, self.bufs, Some(wire.down(1.0)))
    }
    fn exact(&mut self, check: &[usize]) -> Result<bool> {
        self.job.hierarchical_pass(self.cross, self.bufs, None)?;
        self.job.finite(check)
    }
}

/// A chunk's host copy in the hierarchical mode.
struct Host<'a> {
    bytes: &'a mut [u8],
    /// Page-locked: a copy into it is queued without the host waiting for it.
    pinned: bool,
}

/// Queues an allreduce of `count` elements at `buf`, split across the channels.
unsafe fn allreduce_split(
    group: &dyn DeviceGroup,
    buf: *mut u8,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    watch: &Watch<'_>,
) -> Result<()> {
    let parts = group
        .channels()
        .min((count * dtype.size()) / MIN_CHANNEL_BYTES)
        .max(1);
    for (c, r) in partition(count, parts).into_iter().enumerate() {
        if !r.is_empty() {
            let at = buf.add(r.start * dtype.size());
            group.allreduce(c, at, r.len(), dtype, op, watch)?;
        }
    }
    Ok(())
}

/// The scales of a reduction: before it, and after it (with Average's 1/n), and the
/// op the devices run.
fn factors(resp: &Response, size: usize) -> (f64, f64, ReduceOp) {
    let Response::Op {
        op,
        prescale,
        postscale,
        ..
    } = resp
    else {
        unreachable!("factors take Op responses");
    };
    match op {
        ReduceOp::Average => (*prescale, postscale / size as f64, ReduceOp::Sum),
        op => (*prescale, *postscale, *op),
    }
}

/// Queues copies of the entries' inputs into the fusion buffer, each at an aligned
/// offset, with room for `pad(count)` elements; returns the buffer and the elements
/// its tensors span.
unsafe fn pack(
    group: &dyn DeviceGroup,
    entries: &[&Entry],
    dtype: DataType,
    pad: impl Fn(usize) -> usize,
) -> Result<(*mut u8, usize)> {
    let spans = layout(entries);
    let count = spans.last().map_or(0, |r| r.end) / dtype.size();
    let fusion = group.fusion(pad(count) * dtype.size())?;
    for (e, r) in entries.iter().zip(spans) {
        let src = e.input.as_ref().or(e.output.as_ref()).expect("a tensor");
        group.copy(src.ptr, fusion.add(r.start), src.nbytes)?;
    }
    // The gaps are reduced too (they hold stale bytes of this buffer); reducing the
    // whole span keeps it one call per channel.
    Ok((fusion, count))
}

/// Queues copies of the packed results back to the entries' outputs.
unsafe fn unpack(group: &dyn DeviceGroup, entries: &[&Entry], fusion: *const u8) -> Result<()> {
    for (e, r) in entries.iter().zip(layout(entries)) {
        group.copy(fusion.add(r.start), target(e).0, r.len())?;
    }
    Ok(())
}

/// The bytes each packed tensor spans in the fusion buffer: one after the other, each
/// at an aligned offset.
fn layout(entries: &[&Entry]) -> Vec<std::ops::Range<usize>> {
    let offsets = starts(entries.iter().map(|e| aligned(target(e).1)));
    entries
        .iter()
        .zip(offsets)
        .map(|(e, at)| at..at + target(e).1)
        .collect()
}

/// Zeroes the float16 values of `image` (elements `first..` of the fusion buffer)
/// that no range of `live` covers.
fn clear_gaps(image: &mut [u8], first: usize, live: &[std::ops::Range<usize>]) {
    let end = first + image.len() / 2;
    let mut at = first;
    for r in live.iter().chain(std::iter::once(&(end..end))) {
        let (lo, hi) = (at.max(first), r.start.clamp(first, end));
        if lo < hi {
            image[(lo - first) * 2..(hi - first) * 2].fill(0);
        }
        at = at.max(r.end);
        if at >= end {
            break;
        }
    }
}

/// Each process set's device groups, formed with the set's members the first time
/// one of its responses may go direct: one over the whole set, and one of this
/// host's ranks for the hierarchical allreduce.
pub struct Groups {
    use_nccl: NcclUse,
    channels: usize,
    limit: Duration,
    opener: Box<dyn Opener>,
    /// Each set's group (or why none), and the device it was formed on.
    sets: HashMap<(u32, bool), (Formed, Device)>,
}

impl Groups {
    /// No groups yet; `use_nccl` is PERSEUS_NCCL_ENABLE, `channels` the communicators
    /// per group, `limit` the longest wait for a device collective (the peer timeout).
    pub fn new(
        use_nccl: NcclUse,
        channels: usize,
        limit: Duration,
        opener: Box<dyn Opener>,
    ) -> Groups {
        Groups {
            use_nccl,
            channels,
            limit,
            opener,
            sets: HashMap::new(),
        }
    }

    /// The longest wait for a device collective.
    pub fn limit(&self) -> Duration {
        self.limit
    }

    /// The group of process set `ps` (every member calls this for the same
    /// response), of this host's ranks when `local`, `None` when its device tensors
    /// go through host memory. Under PERSEUS_NCCL_ENABLE=1 that is an error naming
    /// why, on every rank. A group stays on the device it was formed on: tensors of
    /// the set on another device of this rank are an error naming both. Forming a
    /// group waits for the peers as `watch` allows.
    pub fn get(
        &mut self,
        ps: u32,
        comm: &dyn Comm,
        device: Device,
        local: bool,
        watch: &Watch<'_>,
    ) -> Result<Option<Arc<dyn DeviceGroup>>> {
        let key = (ps, local);
        if !self.sets.contains_key(&key) {
            let offer = match self.use_nccl {
                NcclUse::Off => Err("PERSEUS_NCCL_ENABLE=0".to_string()),
                _ => self.opener.offer(device),
            };
            let members: Vec<usize> = if local {
                crate::collective::host_and_peers(comm).0
            } else {
                (0..comm.size()).collect()
            };
            let formed = match agree(comm, offer)? {
                Agreement::Direct => {
                    self.opener
                        .open(comm, device, self.channels, &members, watch)?
                }
                Agreement::Staged(why) => Err(why),
            };
            if let Err(why) = &formed {
                if self.use_nccl == NcclUse::Auto && comm.rank() == 0 {
                    crate::log!(
                        crate::log::Level::Info,
                        "CUDA tensors of process set {ps} go through host \
                         memory, not NCCL: {why} (PERSEUS_NCCL_ENABLE=0 says this is meant)"
                    );
                }
            }
            self.sets.insert(key, (formed, device));
        }
        match (&self.sets[&key], self.use_nccl) {
            ((Ok(g), formed_on), _) if *formed_on != device => {
                let why = format!(
                    "process set {ps} runs its NCCL collectives on {formed_on}, but these \
                     tensors are on {device}: NCCL binds a rank's communicators to one GPU, \
                     so keep each rank's tensors on one device (or set \
                     PERSEUS_NCCL_ENABLE=0 to move them through host memory)"
                );
                // The peers may have entered this collective: later ones of this rank
                // must not pair with it in NCCL.
                g.abandon(&why);
                Err(PerseusError::InvalidArgument(why))
            }
            ((Ok(g), _), _) => Ok(Some(g.clone())),
            ((Err(why), _), NcclUse::Required) => Err(PerseusError::GpuUnavailable(format!(
                "PERSEUS_NCCL_ENABLE=1, but NCCL cannot carry the CUDA tensors of process \
                 set {ps}: {why}"
            ))),
            ((Err(_), _), _) => Ok(None),
        }
    }

    /// Forgets process set `ps` (removed); its groups are released.
    pub fn forget(&mut self, ps: u32) {
        self.sets.retain(|(p, _), _| *p != ps);
    }
}

#[cfg(test)]
mod tests;

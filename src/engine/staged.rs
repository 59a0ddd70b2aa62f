//! The host-staged path: tensors in device memory (a GPU's) reduced through the CPU
//! transports. Each device tensor is copied to host memory, the response runs on the
//! host copies exactly as it would on CPU tensors, and the results go back.
//!
//! A float32 gradient allreduce travelling as float16 (`PERSEUS_ALLREDUCE_DTYPE`) is
//! compressed on the device: only the float16 bytes cross to the host and back, and
//! the device casts them back with the inverse gradient scale and the postscale. A
//! float16 sum that overflows is redone exactly from the device inputs, as on the CPU.
//!
//! The host copies live in a [`crate::device::StagingPool`] kept from response to response: one
//! region per response, carved into a view per tensor. The CUDA device gives
//! page-locked regions, which its copies reach at the bus's full speed and without
//! the host waiting on each copy; pinning memory costs far more than a copy, hence
//! the reuse.
//!
//! The device side is a [`DeviceMemory`]: the installed device library's, and the
//! tests below use host memory in its place, which is how CI checks this logic
//! without a GPU.

use std::sync::Arc;

use super::exec::{run_op, Buffers, Entry, Outcome};
use super::message::{OpKind, Response};
use crate::compress::{self, HalfReduce, Wire};
use crate::device::{pageable, Cast, Device, DeviceMemory, HostRegion, TensorView};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{PerseusError, Result};
use crate::kernels::{first_nonfinite, from_half, to_half};

/// Byte alignment of each tensor's host copy within a region.
const STAGE_ALIGN: usize = 64;

/// Bytes a tensor of `n` bytes takes in a region.
fn room(n: usize) -> usize {
    n.div_ceil(STAGE_ALIGN) * STAGE_ALIGN
}

/// Hands out consecutive, aligned pieces of one region.
struct Carver<'a> {
    rest: &'a mut [u8],
}

impl<'a> Carver<'a> {
    /// The next `n` bytes.
    fn next(&mut self, n: usize) -> &'a mut [u8] {
        let (head, tail) = std::mem::take(&mut self.rest).split_at_mut(room(n));
        self.rest = tail;
        &mut head[..n]
    }
}

/// Finds the device memory behind a device (the CUDA device of that ordinal).
pub type Resolver<'a> = &'a dyn Fn(Device) -> Result<Arc<dyn DeviceMemory>>;

/// True when a response touches device memory on this rank.
pub fn needs_staging(entries: &[Option<Entry>]) -> bool {
    entries.iter().flatten().any(|e| {
        e.input
            .iter()
            .chain(e.output.iter())
            .any(|v| v.device != Device::Cpu)
    })
}

/// The devices a response uses, each once, with their memory.
struct Devices<'a> {
    resolve: Resolver<'a>,
    open: Vec<(Device, Arc<dyn DeviceMemory>)>,
}

impl Devices<'_> {
    fn get(&mut self, d: Device) -> Result<Arc<dyn DeviceMemory>> {
        if let Some((_, m)) = self.open.iter().find(|(k, _)| *k == d) {
            return Ok(m.clone());
        }
        let m = (self.resolve)(d)?;
        self.open.push((d, m.clone()));
        Ok(m)
    }

    /// Waits for every device's copies, even after one failed (a copy into a host
    /// region must be over before the region is zeroed or reused); the first error.
    fn finish(&self) -> Result<()> {
        let mut first = Ok(());
        for (_, m) in &self.open {
            if let Err(e) = m.finish() {
                first = first.and(Err(e));
            }
        }
        first
    }
}

fn elems(shape: &[i64]) -> usize {
    shape.iter().product::<i64>().max(0) as usize
}

/// A host view of `buf` holding a tensor of `dtype` and `shape`.
fn host_view(buf: &mut [u8], dtype: DataType, shape: &[i64]) -> TensorView {
    TensorView {
        ptr: buf.as_mut_ptr(),
        nbytes: buf.len(),
        dtype,
        shape: shape.to_vec(),
        device: Device::Cpu,
    }
}

/// The device views of `entries`, inputs and outputs.
fn device_views(entries: &[Option<Entry>]) -> impl Iterator<Item = &TensorView> {
    entries
        .iter()
        .flatten()
        .flat_map(|e| e.input.iter().chain(e.output.iter()))
        .filter(|v| v.device != Device::Cpu)
}

/// A region from the pool for `bytes` of host copies, pinned by the device of the
/// response's first device tensor where it can.
fn region_for(
    bufs: &mut Buffers,
    devices: &mut Devices<'_>,
    entries: &[Option<Entry>],
    bytes: usize,
) -> Box<dyn HostRegion> {
    let mem = device_views(entries)
        .next()
        .and_then(|v| devices.get(v.device).ok());
    bufs.staging.take(bytes, |n| match mem.as_deref() {
        Some(m) => m.host_region(n),
        None => pageable(n),
    })
}

/// Runs a data-moving response whose tensors are (partly) in device memory.
pub fn run_staged(
    comm: &dyn crate::collective::Comm,
    resp: &Response,
    entries: &[Option<Entry>],
    bufs: &mut Buffers,
    resolve: Resolver<'_>,
) -> Outcome {
    let Response::Op {
        kind,
        dtype,
        op,
        plan,
        ..
    } = resp
    else {
        unreachable!("run_staged takes Op responses");
    };
    let mut devices = Devices {
        resolve,
        open: Vec::new(),
    };
    let wire = compress::wire(*dtype, *op, plan.encoding, plan.scale, comm.size(), || {
        crate::collective::hosts_of(comm).len()
    });
    if *kind != OpKind::Allreduce || !matches!(wire, Wire::Half { .. }) {
        // Exact, or float16 between hosts only: the host executor compresses the host
        // copies.
        return exact(comm, resp, entries, bufs, &mut devices, &[]).0;
    }
    let mut staged = Staged {
        comm,
        resp,
        entries,
        bufs,
        devices: &mut devices,
    };
    let result = compress::allreduce(&mut staged, wire);
    Outcome {
        results: entries
            .iter()
            .map(|_| result.clone().map(|_| Default::default()))
            .collect(),
        resent: result.unwrap_or(None),
    }
}

/// Replaces every successful result with `e` (a device copy failed on this rank after
/// its peers were served).
fn fail_ok(mut out: Outcome, e: Option<PerseusError>) -> Outcome {
    if let Some(e) = e {
        for r in &mut out.results {
            if r.is_ok() {
                *r = Err(e.clone());
            }
        }
    }
    out
}

/// The response on host copies of the tensors, bytes as they are. Returns the outcome
/// and whether the outputs at positions `check` are all finite.
fn exact(
    comm: &dyn crate::collective::Comm,
    resp: &Response,
    entries: &[Option<Entry>],
    bufs: &mut Buffers,
    devices: &mut Devices<'_>,
    check: &[usize],
) -> (Outcome, bool) {
    let Response::Op { kind, root, .. } = resp else {
        unreachable!("exact takes Op responses");
    };
    // A broadcast's non-root ranks need not copy what they will overwrite.
    let needs_input = *kind != OpKind::Broadcast || *root as usize == comm.rank();
    // Room for a copy of every device view (an in-place output shares its input's).
    let bytes: usize = device_views(entries).map(|v| room(v.nbytes)).sum();
    let mut region = region_for(bufs, devices, entries, bytes);
    let size = region.size();
    let whole = region.bytes();
    let mut carver = Carver { rest: &mut *whole };
    let mut host: Vec<Option<Entry>> = Vec::with_capacity(entries.len());
    // The first device failure; this rank still takes part in the collective, with
    // zeros, so that its peers are not left waiting, and reports the failure after.
    let mut error: Option<PerseusError> = None;
    for e in entries {
        let Some(e) = e else {
            host.push(None);
            continue;
        };
        let mut stage = |v: &TensorView, download: bool| -> TensorView {
            if v.device == Device::Cpu {
                return v.clone();
            }
            let buf = carver.next(v.nbytes);
            if download && error.is_none() {
                let copied = devices.get(v.device).and_then(|m| {
                    // SAFETY: the front-end keeps the tensor alive until completion;
                    // the region is kept until after `finish`.
                    unsafe { m.download(v.ptr, &mut *buf, Cast::Exact) }
                });
                if let Err(err) = copied {
                    error = Some(err);
                }
            } else {
                buf.fill(0);
            }
            host_view(buf, v.dtype, &v.shape)
        };
        let input = e.input.as_ref().map(|v| stage(v, true));
        let output = match (&e.input, &e.output, &input) {
            // Written in place: the output is the input's host copy.
            (Some(i), Some(o), Some(hi)) if i.ptr == o.ptr => Some(hi.clone()),
            (_, Some(o), _) => Some(stage(o, needs_input && e.input.is_none())),
            (_, None, _) => None,
        };
        host.push(Some(Entry {
            handle: e.handle,
            input,
            output,
        }));
    }
    if let Err(err) = devices.finish() {
        error.get_or_insert(err);
    }
    let used = size - carver.rest.len();
    if error.is_some() {
        // Zeros, not half-copied bytes, go to the peers.
        region.bytes()[..used].fill(0);
    }
    let out = run_op(comm, resp, &host, bufs);
    let finite = check.iter().all(|&i| {
        host[i]
            .as_ref()
            .and_then(|e| e.output.as_ref())
            // SAFETY: the host copies are alive (in `region`) or framework memory.
            .map_or(true, |o| {
                first_nonfinite(unsafe { o.bytes() }, o.dtype).is_none()
            })
    });
    if error.is_none() {
        for ((e, h), r) in entries.iter().zip(&host).zip(&out.results) {
            let (Some(e), Some(h)) = (e, h) else { continue };
            let (Some(o), Some(ho)) = (&e.output, &h.output) else {
                continue;
            };
            if o.device == Device::Cpu || r.is_err() {
                continue;
            }
            let copied = devices.get(o.device).and_then(|m| {
                // SAFETY: as above; the host copy stays alive until `finish`.
                unsafe { m.upload(ho.bytes(), o.ptr, Cast::Exact) }
            });
            if let Err(err) = copied {
                error = Some(err);
                break;
            }
        }
        if let Err(err) = devices.finish() {
            error.get_or_insert(err);
        }
    }
    bufs.staging.give(region);
    (fail_ok(out, error), finite)
}

/// A float32 Sum or Average allreduce with float16 on the wire, cast on the device:
/// only the float16 bytes cross to the host and back.
struct Staged<'a, 'd> {
    comm: &'a dyn crate::collective::Comm,
    resp: &'a Response,
    entries: &'a [Option<Entry>],
    bufs: &'a mut Buffers,
    devices: &'a mut Devices<'d>,
}

impl HalfReduce for Staged<'_, '_> {
    fn half(&mut self, wire: Wire) -> Result<Vec<usize>> {
        let Staged {
            comm,
            resp,
            entries,
            ref mut bufs,
            ref mut devices,
        } = *self;
        let Response::Op {
            shapes,
            op,
            prescale,
            postscale,
            ..
        } = resp
        else {
            unreachable!("half takes Op responses");
        };
        let post = if *op == ReduceOp::Average {
            postscale / comm.size() as f64
        } else {
            *postscale
        };
        // One float16 image per tensor; a joined rank's are zeros, and every rank checks
        // every sum, so that all agree on a resend.
        let bytes: usize = shapes.iter().map(|s| room(elems(s) * 2)).sum();
        let mut region = region_for(bufs, devices, entries, bytes);
        let mut carver = Carver {
            rest: region.bytes(),
        };
        let mut images: Vec<&mut [u8]> = shapes.iter().map(|s| carver.next(elems(s) * 2)).collect();
        let mut error: Option<PerseusError> = None;
        let down = wire.down(*prescale);
        for (e, img) in entries.iter().zip(images.iter_mut()) {
            let Some(input) = e.as_ref().and_then(|e| e.input.as_ref()) else {
                img.fill(0);
                continue;
            };
            if input.device == Device::Cpu {
                // SAFETY: the front-end keeps the tensor alive until completion.
                to_half(img, unsafe { input.bytes() }, down);
                continue;
            }
            let copied = devices.get(input.device).and_then(|m| {
                // SAFETY: as in `exact`; the image lives until after `finish`.
                unsafe { m.download(input.ptr, img, Cast::Half(down as f32)) }
            });
            if let Err(err) = copied {
                error = Some(err);
                break;
            }
        }
        if let Err(err) = devices.finish() {
            error.get_or_insert(err);
        }
        if error.is_some() {
            // Zeros go to the peers; this rank fails after serving them.
            for img in &mut images {
                img.fill(0);
            }
        }
        let host = image_entries(&mut images, shapes);
        let out = run_op(comm, &half_response(resp), &host, bufs);
        let failed = out.results.into_iter().find_map(|r| r.err());
        if let Some(e) = error.take().or(failed) {
            bufs.staging.give(region);
            return Err(e);
        }
        let bad: Vec<usize> = images
            .iter()
            .enumerate()
            .filter(|(_, img)| first_nonfinite(img, DataType::F16).is_some())
            .map(|(i, _)| i)
            .collect();
        if !bad.is_empty() {
            bufs.staging.give(region);
            return Ok(bad);
        }
        let up = wire.up(post);
        for (e, img) in entries.iter().zip(&images) {
            let Some(o) = e.as_ref().and_then(|e| e.output.as_ref()) else {
                continue;
            };
            if o.device == Device::Cpu {
                // SAFETY: the front-end keeps the tensor alive until completion, and only
                // the engine thread writes it until then.
                from_half(unsafe { o.bytes_mut() }, img, up);
                continue;
            }
            let copied = devices.get(o.device).and_then(|m| {
                // SAFETY: as above; the image lives until after `finish`.
                unsafe { m.upload(img, o.ptr, Cast::Half(up as f32)) }
            });
            if let Err(err) = copied {
                error = Some(err);
                break;
            }
        }
        if let Err(err) = devices.finish() {
            error.get_or_insert(err);
        }
        bufs.staging.give(region);
        error.map_or(Ok(Vec::new()), Err)
    }

    fn exact(&mut self, check: &[usize]) -> Result<bool> {
        let mut exact_resp = self.resp.clone();
        if let Response::Op { plan, .. } = &mut exact_resp {
            *plan = plan.exact();
        }
        let (out, finite) = exact(
            self.comm,
            &exact_resp,
            self.entries,
            self.bufs,
            self.devices,
            check,
        );
        match out.results.into_iter().find_map(|r| r.err()) {
            Some(e) => Err(e),
            None => Ok(finite),
        }
    }
}

/// Host entries over the float16 images, each written in place.
fn image_entries(images: &mut [&mut [u8]], shapes: &[Vec<i64>]) -> Vec<Option<Entry>> {
    images
        .iter_mut()
        .zip(shapes)
        .map(|(img, s)| {
            let v = host_view(img, DataType::F16, s);
            Some(Entry {
                handle: 0,
                input: Some(v.clone()),
                output: Some(v),
            })
        })
        .collect()
}

/// The response the float16 images run: a float16 sum, unscaled and exact (the device
/// applies the scales), with every other field as negotiated.
fn half_response(resp: &Response) -> Response {
    let mut r = resp.clone();
    if let Response::Op {
        dtype,
        op,
        prescale,
        postscale,
        plan,
        ..
    } = &mut r
    {
        *dtype = DataType::F16;
        *op = ReduceOp::Sum;
        *prescale = 1.0;
        *postscale = 1.0;
        *plan = plan.exact();
    }
    r
}

/// The device memory of `d`, from the installed device library.
pub fn device_memory(d: Device) -> Result<Arc<dyn DeviceMemory>> {
    match d {
        Device::Cpu => Err(PerseusError::InvalidArgument(
            "host memory needs no staging".into(),
        )),
        Device::Cuda(ordinal) => crate::device::backend(d)?.memory(ordinal),
    }
}

#[cfg(test)]
mod tests;

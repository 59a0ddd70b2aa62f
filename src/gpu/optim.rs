//! The fused optimizer step on a CUDA device: the `optimizers` kernels, one launch per
//! parameter (three for LAMB), queued in order on Perseus's stream of the device. The
//! front-end makes that stream wait for the framework's before the step and the
//! framework's wait for it after (events: no host or device-wide sync).

use super::runtime::{driver, CudaDevice};
use crate::error::Result;
use crate::optim::{needs_grad_norm, Group, LambScalars, Rule, Slot};
use cudarc::driver::{result, sys};
use std::ffi::c_void;

/// One kernel argument, kept alive while its address is handed to the launch.
enum Arg {
    Ptr(u64),
    F32(f32),
    I32(i32),
    U64(u64),
}

/// Launches `kernel` of the `optimizers` source over `n` elements with `args`.
///
/// # Safety
/// `args` must match the kernel's parameters in order and type, and name device memory
/// the step may use.
unsafe fn launch(dev: &CudaDevice, kernel: &'static str, n: usize, args: &mut [Arg]) -> Result<()> {
    let f = dev.kernel("optimizers", kernel)?;
    let mut params: Vec<*mut c_void> = args
        .iter_mut()
        .map(|a| match a {
            Arg::Ptr(p) | Arg::U64(p) => (p as *mut u64).cast(),
            Arg::F32(x) => (x as *mut f32).cast(),
            Arg::I32(x) => (x as *mut i32).cast(),
        })
        .collect();
    dev.launch(f, n as u64, &mut params)
}

fn ptr(t: &crate::engine::TensorView) -> Arg {
    Arg::Ptr(t.ptr as u64)
}

fn flag(b: bool) -> Arg {
    Arg::I32(i32::from(b))
}

/// Queues one step over `groups` (checked by [`crate::optim::step`]; every tensor on
/// device `ordinal`) on Perseus's stream of the device.
pub fn step(ordinal: i32, groups: &[Group]) -> Result<()> {
    let dev = CudaDevice::get(ordinal)?;
    // A caller's thread: its own context (the framework's device) is current again
    // once this returns.
    let _current = dev.enter()?;
    let stream = dev.stream;
    // Device floats for LAMB: [0] the global squared gradient norm, then the squared
    // norms of the weight and of the update of each LAMB parameter.
    let lamb: usize = groups
        .iter()
        .filter(|g| matches!(g.rule, Rule::Lamb(_)))
        .map(|g| g.slots.len())
        .sum();
    let bytes = if lamb > 0 { 4 * (1 + 2 * lamb) } else { 0 };
    let norms: sys::CUdeviceptr = if bytes > 0 {
        // SAFETY: stream-ordered allocation on this device's stream, zeroed before use and
        // freed (stream-ordered) after the kernels reading it.
        unsafe {
            let p = result::malloc_async(stream, bytes).map_err(driver("cuMemAllocAsync"))?;
            result::memset_d8_async(p, 0, bytes, stream).map_err(driver("cuMemsetD8Async"))?;
            p
        }
    } else {
        0
    };
    // SAFETY: the tensors are the caller's (alive, on this device, not shared); `norms`
    // holds `1 + 2 * lamb` floats.
    let queued = unsafe { queue(&dev, groups, norms) };
    if norms != 0 {
        // SAFETY: allocated above on this stream.
        unsafe { result::free_async(norms, stream) }.map_err(driver("cuMemFreeAsync"))?;
    }
    queued
}

/// The launches of one step, in order.
///
/// # Safety
/// As for [`step`]; `norms` holds one float plus two per LAMB parameter, zeroed.
unsafe fn queue(dev: &CudaDevice, groups: &[Group], norms: sys::CUdeviceptr) -> Result<()> {
    let lambs = || {
        groups.iter().filter_map(|g| match g.rule {
            Rule::Lamb(h) => Some((h, &g.slots)),
            _ => None,
        })
    };
    if needs_grad_norm(groups) {
        for (_, slots) in lambs() {
            for s in slots.iter() {
                let mut args = [ptr(&s.grad), Arg::Ptr(norms), Arg::U64(s.len() as u64)];
                launch(dev, "sum_squares", s.len(), &mut args)?;
            }
        }
    }
    let pair = |k: usize| Arg::Ptr(norms + 4 * (1 + 2 * k as u64));
    let mut k = 0usize;
    for g in groups {
        for s in &g.slots {
            match g.rule {
                Rule::Sgd(h) => sgd(dev, &h, s)?,
                Rule::Adam(h) => {
                    let c = h.scalars(s.step);
                    let mut args = [
                        ptr(&s.weight),
                        ptr(&s.grad),
                        ptr(&s.state[0]),
                        ptr(&s.state[1]),
                        Arg::F32(c.beta1c),
                        Arg::F32(c.beta2),
                        Arg::F32(c.beta2c),
                        Arg::F32(c.eps),
                        Arg::F32(c.weight_decay),
                        Arg::F32(c.decay),
                        flag(h.decoupled),
                        flag(h.maximize),
                        Arg::F32(c.step_size),
                        Arg::F32(c.bias2_sqrt),
                        Arg::U64(s.len() as u64),
                    ];
                    launch(dev, "adam", s.len(), &mut args)?;
                }
                Rule::Lamb(h) => {
                    let c = h.scalars(s.step);
                    let grad_sq = if h.max_grad_norm > 0.0 { norms } else { 0 };
                    let mut args = vec![
                        ptr(&s.weight),
                        ptr(&s.grad),
                        ptr(&s.state[0]),
                        ptr(&s.state[1]),
                        pair(k),
                        Arg::Ptr(grad_sq),
                        Arg::F32(h.max_grad_norm as f32),
                        Arg::F32(c.beta1),
                        Arg::F32(c.beta3),
                        Arg::F32(c.beta2),
                        Arg::F32(c.beta2c),
                    ];
                    args.extend(lamb_update_args(&c, h.adam_w_mode, s));
                    launch(dev, "lamb_stage1", s.len(), &mut args)?;
                    k += 1;
                }
            }
        }
    }
    let mut k = 0usize;
    for (h, slots) in lambs() {
        for s in slots.iter() {
            let c = h.scalars(s.step);
            let mut args = vec![
                ptr(&s.weight),
                ptr(&s.state[0]),
                ptr(&s.state[1]),
                pair(k),
                Arg::F32(h.lr as f32),
                flag(c.adapt),
            ];
            args.extend(lamb_update_args(&c, h.adam_w_mode, s));
            launch(dev, "lamb_stage2", s.len(), &mut args)?;
            k += 1;
        }
    }
    Ok(())
}

/// The arguments both LAMB kernels end with: what `lamb_update` needs, and the count.
fn lamb_update_args(c: &LambScalars, adam_w: bool, s: &Slot) -> [Arg; 6] {
    [
        Arg::F32(c.eps),
        Arg::F32(c.weight_decay),
        flag(adam_w),
        Arg::F32(c.bias1),
        Arg::F32(c.bias2),
        Arg::U64(s.len() as u64),
    ]
}

/// One SGD launch.
///
/// # Safety
/// As for [`queue`].
unsafe fn sgd(dev: &CudaDevice, h: &crate::optim::Sgd, s: &Slot) -> Result<()> {
    let mom = s.state.first().map_or(Arg::Ptr(0), ptr);
    let mut args = [
        ptr(&s.weight),
        ptr(&s.grad),
        mom,
        Arg::F32(h.lr as f32),
        Arg::F32(h.momentum as f32),
        Arg::F32((1.0 - h.dampening) as f32),
        Arg::F32(h.weight_decay as f32),
        flag(h.nesterov),
        flag(h.maximize),
        flag(s.step == 1),
        Arg::U64(s.len() as u64),
    ];
    launch(dev, "sgd", s.len(), &mut args)
}

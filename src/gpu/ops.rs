//! The launches behind [`crate::device::kernels`]: one kernel (four for DGC's top-k) on
//! the caller's tensors, queued on Perseus's stream of their device. The front-end
//! orders that stream after the framework's before the call and the framework's after
//! it (events, as for the fused optimizers). The finiteness check and the top-k
//! selection return what the device found, so they wait for Perseus's stream.

use std::ffi::c_void;

use super::runtime::{CudaDevice, DeviceBuffer};
use crate::device::kernels::{threshold, Answer, Call, RADIX_DIGITS};
use crate::device::TensorView;
use crate::dtype::DataType;
use crate::error::Result;

/// Runs `call` (checked by [`crate::device::kernels::check`]) on device `ordinal`.
pub fn run(ordinal: i32, call: Call) -> Result<Answer> {
    let dev = CudaDevice::get(ordinal)?;
    // A caller's thread: its own context (the framework's device) is current again
    // once this returns.
    let _current = dev.enter()?;
    // SAFETY: the front-end holds every tensor alive and unused until the call returns
    // and orders the framework's stream after Perseus's; the checks matched devices,
    // types and lengths.
    unsafe {
        match call {
            Call::Cast { src, dst, factor } => {
                let name = match (src.dtype, dst.dtype) {
                    (DataType::F32, DataType::F16) => "f32_to_f16_scaled",
                    (DataType::F32, _) => "f32_to_bf16_scaled",
                    (DataType::F16, _) => "f16_to_f32_scaled",
                    _ => "bf16_to_f32_scaled",
                };
                let f = dev.kernel("cast", name)?;
                let n = src.elements() as u64;
                dev.cast(f, src.ptr as u64, dst.ptr as u64, factor, n)?;
                Ok(Answer::Queued)
            }
            Call::Reduce { dst, src, op } => {
                let n = dst.elements();
                dev.reduce(dst.ptr as u64, src.ptr as u64, n, dst.dtype, op)?;
                Ok(Answer::Queued)
            }
            Call::Scale { x, factor } => {
                dev.scale(x.ptr as u64, x.elements(), x.dtype, factor)?;
                Ok(Answer::Queued)
            }
            Call::Nonfinite { x } => {
                let flag = DeviceBuffer::zeroed(&dev, 4)?;
                dev.nonfinite(x.ptr as u64, x.elements(), x.dtype, flag.ptr)?;
                let mut seen = [0i32; 1];
                flag.read(&mut seen)?;
                Ok(Answer::Nonfinite(seen[0] != 0))
            }
            Call::TopK {
                x,
                k,
                indices,
                values,
            } => top_k(&dev, &x, k, &indices, &values),
        }
    }
}

/// DGC's selection: the threshold by radix selection (three `radix_histogram` passes,
/// one wait each for its 8 KiB histogram), then one `select_at_least` pass gathering
/// and clearing.
///
/// # Safety
/// As for [`run`].
unsafe fn top_k(
    dev: &CudaDevice,
    x: &TensorView,
    k: usize,
    indices: &TensorView,
    values: &TensorView,
) -> Result<Answer> {
    let n = x.elements() as u64;
    if k == 0 || n == 0 {
        return Ok(Answer::TopK {
            taken: 0,
            threshold: f32::INFINITY,
        });
    }
    let most = 1usize << RADIX_DIGITS.iter().map(|d| d.1).max().unwrap_or(0);
    let hist = DeviceBuffer::new(dev, most * 4)?;
    let histogram = dev.kernel("dgc", "radix_histogram")?;
    // Fewer blocks than an elementwise launch: each block flushes its own histogram.
    let blocks = n.div_ceil(256 * 16).clamp(1, 2048) as u32;
    let t = threshold(k, |shift, bits, prefix| {
        let bins = 1usize << bits;
        hist.zero(bins * 4)?;
        let (mut ptr, mut at, mut n2) = (x.ptr as u64, hist.ptr, n);
        let (mut shift, mut bits, mut prefix) = (shift, bits, prefix);
        let mut params: [*mut c_void; 6] = [
            (&mut ptr as *mut u64).cast(),
            (&mut at as *mut u64).cast(),
            (&mut shift as *mut u32).cast(),
            (&mut bits as *mut u32).cast(),
            (&mut prefix as *mut u32).cast(),
            (&mut n2 as *mut u64).cast(),
        ];
        dev.launch_blocks(histogram, blocks, &mut params)?;
        let mut counts = vec![0u32; bins];
        hist.read(&mut counts)?;
        Ok(counts.into_iter().map(u64::from).collect())
    })?;
    let counter = DeviceBuffer::zeroed(dev, 8)?;
    let select = dev.kernel("dgc", "select_at_least")?;
    let slots = indices.elements() as u64;
    let (mut ptr, mut t2, mut idx, mut vals) =
        (x.ptr as u64, t, indices.ptr as u64, values.ptr as u64);
    let (mut taken, mut capacity, mut n2) = (counter.ptr, slots, n);
    let mut params: [*mut c_void; 7] = [
        (&mut ptr as *mut u64).cast(),
        (&mut t2 as *mut f32).cast(),
        (&mut idx as *mut u64).cast(),
        (&mut vals as *mut u64).cast(),
        (&mut taken as *mut u64).cast(),
        (&mut capacity as *mut u64).cast(),
        (&mut n2 as *mut u64).cast(),
    ];
    dev.launch(select, n, &mut params)?;
    let mut got = [0u64; 1];
    counter.read(&mut got)?;
    Ok(Answer::TopK {
        taken: got[0].min(slots) as usize,
        threshold: t,
    })
}

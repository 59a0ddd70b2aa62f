//! The launches behind [`crate::device_kernels`]: one kernel (two for DGC's top-k) on
//! the caller's tensors, queued on Perseus's stream of their device. The front-end
//! orders that stream after the framework's before the call and the framework's after
//! it (events, as for the fused optimizers). The finiteness check and the top-k
//! selection return what the device found, so they wait for Perseus's stream.

use std::ffi::c_void;

use cudarc::driver::{result, sys};

use super::runtime::{driver, CudaDevice};
use crate::device_kernels::{threshold, Answer, Call};
use crate::dtype::DataType;
use crate::engine::TensorView;
use crate::error::Result;

/// Runs `call` (checked by [`crate::device_kernels::check`]) on device `ordinal`.
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
                let flag = Counter::new(&dev)?;
                dev.nonfinite(x.ptr as u64, x.elements(), x.dtype, flag.ptr)?;
                Ok(Answer::Nonfinite(flag.read()? != 0))
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

/// DGC's selection: the threshold by bisection (`count_at_least`, one pass and one
/// wait each), then one `select_at_least` pass gathering and clearing.
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
    let counter = Counter::new(dev)?;
    let count = dev.kernel("dgc", "count_at_least")?;
    let t = threshold(k, |t| {
        counter.zero()?;
        let (mut ptr, mut t, mut at, mut n2) = (x.ptr as u64, t, counter.ptr, n);
        let mut params: [*mut c_void; 4] = [
            (&mut ptr as *mut u64).cast(),
            (&mut t as *mut f32).cast(),
            (&mut at as *mut u64).cast(),
            (&mut n2 as *mut u64).cast(),
        ];
        dev.launch(count, n, &mut params)?;
        Ok(counter.read()? as usize)
    })?;
    counter.zero()?;
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
    let taken = counter.read()?.min(slots) as usize;
    Ok(Answer::TopK {
        taken,
        threshold: t,
    })
}

/// One 64-bit counter in device memory, on the device's stream.
struct Counter<'a> {
    dev: &'a CudaDevice,
    ptr: sys::CUdeviceptr,
}

impl<'a> Counter<'a> {
    /// A zeroed counter.
    fn new(dev: &'a CudaDevice) -> Result<Counter<'a>> {
        // SAFETY: stream-ordered allocation on the device's stream, freed on drop.
        let ptr =
            unsafe { result::malloc_async(dev.stream, 8) }.map_err(driver("cuMemAllocAsync"))?;
        let c = Counter { dev, ptr };
        c.zero()?;
        Ok(c)
    }

    /// Queues setting it to zero.
    fn zero(&self) -> Result<()> {
        // SAFETY: 8 bytes of this counter's allocation.
        unsafe { result::memset_d8_async(self.ptr, 0, 8, self.dev.stream) }
            .map_err(driver("cuMemsetD8Async"))
    }

    /// Its value once the work queued so far has run (waits for the stream).
    fn read(&self) -> Result<u64> {
        let mut v = [0u64; 1];
        // SAFETY: 8 bytes from this counter into `v`, waited for before `v` is read.
        unsafe {
            result::memcpy_dtoh_async(&mut v[..], self.ptr, self.dev.stream)
                .map_err(driver("cuMemcpyDtoHAsync"))?;
            result::stream::synchronize(self.dev.stream).map_err(driver("cuStreamSynchronize"))?;
        }
        Ok(v[0])
    }
}

impl Drop for Counter<'_> {
    fn drop(&mut self) {
        // SAFETY: allocated on this stream; freed after the work that uses it.
        let _ = unsafe { result::free_async(self.ptr, self.dev.stream) };
    }
}

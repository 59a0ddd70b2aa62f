//! CUDA devices as the engine uses them: the primary context of each device (the one
//! PyTorch uses), one non-blocking stream of Perseus's own, the kernels compiled once
//! per device, and the copies of the host-staged path ([`DeviceMemory`]).
//!
//! Ordering with the framework: the front-end exports a tensor with
//! `__dlpack__(stream=<this device's stream>)`, so the framework records an event on
//! its current stream and makes this stream wait for it (DLPack's stream protocol).
//! The engine then queues its copies and casts on this stream and waits for this
//! stream alone before completing a handle; no device-wide synchronisation.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use cudarc::driver::{result, sys};

use crate::device::{Cast, DeviceMemory, HostRegion};
use crate::device::{Waited, Watch};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{PerseusError, Result};
use crate::gpu::kernels;
use crate::gpu::libs::{check_bound, lacking, probe, CudaLib};
use crate::kernels::AlignedBuf;

/// Directories searched first for CUDA's libraries (the nvidia-* wheels' folders,
/// which the Python side passes at `init`).
static SEARCH_DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Every device opened so far, by ordinal.
static DEVICES: Mutex<Vec<(i32, Arc<CudaDevice>)>> = Mutex::new(Vec::new());

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Sets the directories searched first for CUDA's libraries.
pub fn set_search_dirs(dirs: Vec<PathBuf>) {
    *lock(&SEARCH_DIRS) = dirs;
}

/// The directories searched first for CUDA's libraries.
pub fn search_dirs() -> Vec<PathBuf> {
    lock(&SEARCH_DIRS).clone()
}

/// A failed driver call as an error naming the call.
pub(crate) fn driver(call: &'static str) -> impl Fn(result::DriverError) -> PerseusError {
    move |e| {
        let why = e
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0));
        PerseusError::Device(format!("{call} failed: {why}"))
    }
}

/// Every driver function the GPU path calls, through cudarc (its symbol names).
const DRIVER_CALLS: &[&str] = &[
    "cuInit",
    "cuGetErrorString",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetUuid_v2",
    "cuDevicePrimaryCtxRetain",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuMemsetD8Async",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuLaunchKernel",
];

/// The `scale` kernels: float32, float64, float16 and bfloat16.
pub(crate) const SCALE: [&str; 4] = ["scale_f32", "scale_f64", "scale_f16", "scale_bf16"];

/// The finiteness checks of the `nancheck` source: float32 and float16.
pub(crate) const NONFINITE: [&str; 2] = ["nonfinite_f32", "nonfinite_f16"];

/// Threads per block of every launch; blocks are capped, the kernels loop.
const BLOCK: u32 = 256;
const MAX_BLOCKS: u64 = 8192;

/// What the engine thread and the front-ends share about one device.
#[derive(Default)]
struct State {
    /// Loaded modules, by kernel source.
    modules: HashMap<&'static str, sys::CUmodule>,
    /// Kernels, by name.
    functions: HashMap<&'static str, sys::CUfunction>,
    /// Device scratch for float16 images (stream-ordered; grows, never shrinks).
    scratch: sys::CUdeviceptr,
    scratch_len: usize,
}

/// The one of `names` (the float32, float64, float16 and bfloat16 variants of a kernel)
/// for `dtype`; other types have no device `what`.
fn per_float(names: [&'static str; 4], dtype: DataType, what: &str) -> Result<&'static str> {
    let i = match dtype {
        DataType::F32 => 0,
        DataType::F64 => 1,
        DataType::F16 => 2,
        DataType::BF16 => 3,
        other => {
            return Err(PerseusError::InvalidArgument(format!(
                "no device {what} for {}",
                other.name()
            )))
        }
    };
    Ok(names[i])
}

/// One CUDA device.
pub struct CudaDevice {
    /// Its ordinal (`cuda:N`).
    ordinal: i32,
    ctx: sys::CUcontext,
    pub(crate) stream: sys::CUstream,
    /// Compute capability as `major * 10 + minor` (90 for an H100).
    sm: u32,
    /// The device's UUID: the same GPU has the same one in every process.
    pub(crate) uuid: [u8; 16],
    state: Mutex<State>,
}

// SAFETY: the handles are plain driver handles, valid on any thread once the context
// is made current there (`bind`); the mutable state is behind a mutex.
unsafe impl Send for CudaDevice {}
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    /// Device `ordinal`, opened once per process. Errors: no CUDA driver
    /// ([`PerseusError::GpuUnavailable`], naming where it was looked for), no such
    /// device, or a failing driver.
    pub fn get(ordinal: i32) -> Result<Arc<CudaDevice>> {
        let mut open = lock(&DEVICES);
        if let Some((_, d)) = open.iter().find(|(o, _)| *o == ordinal) {
            return Ok(d.clone());
        }
        let lib = probe(CudaLib::Driver, &search_dirs());
        let Some(loaded) = lib.loaded.clone() else {
            return Err(PerseusError::GpuUnavailable(lib.missing_message()));
        };
        // cudarc resolves each function on its first call and panics where one is
        // missing (a driver older than CUDA 12): every function the GPU path calls is
        // asked for here, once, so none can be missing later.
        let lacks = lacking(CudaLib::Driver, DRIVER_CALLS);
        if !lacks.is_empty() {
            return Err(PerseusError::GpuUnavailable(format!(
                "the CUDA driver {} at {} lacks {}: Perseus needs the driver of CUDA 12 or later",
                loaded.version,
                loaded.path.display(),
                lacks.join(", ")
            )));
        }
        let d = std::panic::catch_unwind(|| {
            // SAFETY: cudarc's handle, loaded (or found loaded) by its own search.
            check_bound(CudaLib::Driver, unsafe { sys::culib() })
                .map_err(PerseusError::GpuUnavailable)?;
            Self::open(ordinal)
        })
        .map_err(|_| {
            PerseusError::GpuUnavailable(format!(
                "the CUDA driver {} at {} lacks a function Perseus needs",
                loaded.version,
                loaded.path.display()
            ))
        })??;
        let d = Arc::new(d);
        open.push((ordinal, d.clone()));
        Ok(d)
    }

    fn open(ordinal: i32) -> Result<CudaDevice> {
        result::init().map_err(driver("cuInit"))?;
        let count = result::device::get_count().map_err(driver("cuDeviceGetCount"))?;
        if ordinal < 0 || ordinal >= count {
            return Err(PerseusError::InvalidArgument(format!(
                "cuda:{ordinal} does not exist: this machine has {count} CUDA device(s)"
            )));
        }
        let dev = result::device::get(ordinal).map_err(driver("cuDeviceGet"))?;
        use sys::CUdevice_attribute::*;
        // SAFETY: `dev` came from cuDeviceGet; the primary context is retained for the
        // life of the process, as PyTorch does.
        unsafe {
            let major =
                result::device::get_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
                    .map_err(driver("cuDeviceGetAttribute"))?;
            let minor =
                result::device::get_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
                    .map_err(driver("cuDeviceGetAttribute"))?;
            let ctx =
                result::primary_ctx::retain(dev).map_err(driver("cuDevicePrimaryCtxRetain"))?;
            // Current while the stream is made, then the caller's context again (a
            // Python thread's is the framework's current device).
            let _current = Current::set(ctx)?;
            let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
                .map_err(driver("cuStreamCreate"))?;
            let uuid = result::device::get_uuid(dev).map_err(driver("cuDeviceGetUuid"))?;
            Ok(CudaDevice {
                ordinal,
                ctx,
                stream,
                sm: (major * 10 + minor) as u32,
                uuid: uuid.bytes.map(|b| b as u8),
                state: Mutex::new(State::default()),
            })
        }
    }

    /// The compute capability as `major * 10 + minor`.
    pub fn sm(&self) -> u32 {
        self.sm
    }

    /// Perseus's stream on this device, as the integer DLPack's `stream=` takes.
    pub fn stream_handle(&self) -> u64 {
        self.stream as u64
    }

    /// Makes this device's context current on the calling thread, and leaves it so:
    /// for Perseus's own threads (the engine's). A caller's thread takes
    /// [`CudaDevice::enter`] instead.
    pub(crate) fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained for the life of the process.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(driver("cuCtxSetCurrent"))
    }

    /// Makes this device's context current on the calling thread until the value
    /// returned is dropped, which makes the thread's earlier one current again. Every
    /// call made on a caller's thread (a Python thread, whose current context is the
    /// framework's current device) holds one, so that the framework's device stays as
    /// it was.
    pub(crate) fn enter(&self) -> Result<Current> {
        // SAFETY: the context is retained for the life of the process.
        unsafe { Current::set(self.ctx) }
    }

    /// Compiles and loads the kernels `wanted` (each source's, by name) now, where
    /// they are otherwise compiled at their first launch; an error names the device and
    /// the cause.
    pub(crate) fn load_kernels(&self, wanted: &[(&'static str, &[&'static str])]) -> Result<()> {
        let _current = self.enter()?;
        let mut st = lock(&self.state);
        for &(source, names) in wanted {
            for &name in names {
                self.function(&mut st, source, name)?;
            }
        }
        Ok(())
    }

    /// Kernel `name` of source `source` (see [`CudaDevice::function_in`]).
    pub(crate) fn kernel(
        &self,
        source: &'static str,
        name: &'static str,
    ) -> Result<sys::CUfunction> {
        self.function(&mut lock(&self.state), source, name)
    }

    /// Kernel `name` of source `source`, compiled (to a CUBIN for this device's
    /// architecture) and loaded the first time it is asked for.
    fn function(
        &self,
        st: &mut State,
        source: &'static str,
        name: &'static str,
    ) -> Result<sys::CUfunction> {
        if let Some(f) = st.functions.get(name) {
            return Ok(*f);
        }
        let module = match st.modules.get(source) {
            Some(m) => *m,
            None => {
                let bin = kernels::binary(source, self.sm, &search_dirs())?;
                // SAFETY: `bin` is a CUBIN NVRTC made for this device's architecture, or
                // NUL-terminated PTX for one it runs.
                let m = unsafe { result::module::load_data(bin.bytes.as_ptr() as *const c_void) }
                    .map_err(|e| {
                    PerseusError::GpuUnavailable(format!(
                        "kernel source {source}, compiled by NVRTC for {}, does not \
                             load on cuda:{} (sm_{}): {}",
                        bin.target.name(),
                        self.ordinal,
                        self.sm,
                        driver("cuModuleLoadData")(e)
                    ))
                })?;
                st.modules.insert(source, m);
                m
            }
        };
        let c = CString::new(name).expect("kernel names hold no NUL");
        // SAFETY: `module` is loaded and never unloaded.
        let f = unsafe { result::module::get_function(module, c) }
            .map_err(driver("cuModuleGetFunction"))?;
        st.functions.insert(name, f);
        Ok(f)
    }

    /// Device scratch of at least `bytes`, ordered on this device's stream.
    fn scratch(&self, st: &mut State, bytes: usize) -> Result<sys::CUdeviceptr> {
        if bytes > st.scratch_len {
            // SAFETY: the old scratch was allocated on this stream; work queued on it
            // before the free completes first.
            unsafe {
                if st.scratch_len > 0 {
                    result::free_async(st.scratch, self.stream)
                        .map_err(driver("cuMemFreeAsync"))?;
                    st.scratch_len = 0;
                }
                let want = bytes.next_power_of_two().max(1 << 20);
                st.scratch =
                    result::malloc_async(self.stream, want).map_err(driver("cuMemAllocAsync"))?;
                st.scratch_len = want;
            }
        }
        Ok(st.scratch)
    }

    /// Launches an elementwise cast kernel `(src, dst, factor, n)` on this stream.
    pub(crate) fn cast(
        &self,
        f: sys::CUfunction,
        src: u64,
        dst: u64,
        factor: f32,
        n: u64,
    ) -> Result<()> {
        let (mut src, mut dst, mut factor, mut n2) = (src, dst, factor, n);
        let mut params: [*mut c_void; 4] = [
            (&mut src as *mut u64).cast(),
            (&mut dst as *mut u64).cast(),
            (&mut factor as *mut f32).cast(),
            (&mut n2 as *mut u64).cast(),
        ];
        // SAFETY: the kernel's parameters are (pointer, pointer, float, u64), as given;
        // the caller vouches for the memory.
        unsafe { self.launch(f, n, &mut params) }
    }

    /// Queues `x *= factor` over `count` values of `dtype` on this stream: float32
    /// arithmetic, but float64's for float64 values.
    ///
    /// # Safety
    /// `x` must be this device's memory, holding `count` values, the caller's to write.
    pub(crate) unsafe fn scale(
        &self,
        x: u64,
        count: usize,
        dtype: DataType,
        factor: f64,
    ) -> Result<()> {
        let name = per_float(SCALE, dtype, "scale")?;
        let f = self.kernel("scale", name)?;
        let (mut ptr, mut n) = (x, count as u64);
        let (mut f64s, mut f32s) = (factor, factor as f32);
        let s: *mut c_void = if dtype == DataType::F64 {
            (&mut f64s as *mut f64).cast()
        } else {
            (&mut f32s as *mut f32).cast()
        };
        let mut params = [
            (&mut ptr as *mut u64).cast(),
            s,
            (&mut n as *mut u64).cast(),
        ];
        self.launch(f, count as u64, &mut params)
    }

    /// Queues the finiteness check of `count` values of `dtype` (float32 or float16) at
    /// `x`: the 32-bit flag at `flag` becomes nonzero when one is NaN or infinite (it
    /// is left as it is otherwise).
    ///
    /// # Safety
    /// `x` must be this device's memory holding `count` values, `flag` four bytes of it
    /// the caller's to write.
    pub(crate) unsafe fn nonfinite(
        &self,
        x: u64,
        count: usize,
        dtype: DataType,
        flag: u64,
    ) -> Result<()> {
        let name = match dtype {
            DataType::F32 => NONFINITE[0],
            DataType::F16 => NONFINITE[1],
            other => {
                return Err(PerseusError::InvalidArgument(format!(
                    "no device finiteness check for {}",
                    other.name()
                )))
            }
        };
        let f = self.kernel("nancheck", name)?;
        let (mut ptr, mut at, mut n) = (x, flag, count as u64);
        let mut params = [
            (&mut ptr as *mut u64).cast(),
            (&mut at as *mut u64).cast(),
            (&mut n as *mut u64).cast(),
        ];
        self.launch(f, count as u64, &mut params)
    }

    /// Queues `dst = dst (op) src` over `count` values of `dtype` on this stream (op:
    /// Sum, Min, Max or Product; half types in float32 arithmetic, rounded once).
    ///
    /// # Safety
    /// `dst` and `src` must be this device's memory, holding `count` values each, the
    /// caller's to use (`dst` to write).
    pub(crate) unsafe fn reduce(
        &self,
        dst: u64,
        src: u64,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let names = ["reduce_f32", "reduce_f64", "reduce_f16", "reduce_bf16"];
        let name = per_float(names, dtype, "reduction")?;
        let mut code: i32 = match op {
            ReduceOp::Sum => 0,
            ReduceOp::Min => 1,
            ReduceOp::Max => 2,
            ReduceOp::Product => 3,
            other => {
                return Err(PerseusError::InvalidArgument(format!(
                    "no elementwise device reduction {}",
                    other.name()
                )))
            }
        };
        let f = self.kernel("reduce", name)?;
        let (mut d, mut s, mut n) = (dst, src, count as u64);
        let mut params = [
            (&mut d as *mut u64).cast(),
            (&mut s as *mut u64).cast(),
            (&mut code as *mut i32).cast(),
            (&mut n as *mut u64).cast(),
        ];
        self.launch(f, count as u64, &mut params)
    }

    /// Launches kernel `f` over `n` elements on this stream (nothing when `n` is 0).
    ///
    /// # Safety
    /// `params` must point at the kernel's parameters, in order and of its types, and
    /// the memory they name must be the caller's to use.
    pub(crate) unsafe fn launch(
        &self,
        f: sys::CUfunction,
        n: u64,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let blocks = n.div_ceil(BLOCK as u64).min(MAX_BLOCKS) as u32;
        self.launch_blocks(f, blocks, params)
    }

    /// Launches kernel `f` on `blocks` blocks of 256 threads on this stream.
    ///
    /// # Safety
    /// As for [`CudaDevice::launch`].
    pub(crate) unsafe fn launch_blocks(
        &self,
        f: sys::CUfunction,
        blocks: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        result::launch_kernel(f, (blocks, 1, 1), (BLOCK, 1, 1), 0, self.stream, params)
            .map_err(driver("cuLaunchKernel"))
    }
}

impl DeviceMemory for CudaDevice {
    unsafe fn download(&self, src: *const u8, dst: &mut [u8], cast: Cast) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        match cast {
            Cast::Exact => result::memcpy_dtoh_async(dst, src as u64, self.stream)
                .map_err(driver("cuMemcpyDtoHAsync")),
            Cast::Half(factor) => {
                let mut st = lock(&self.state);
                let f = self.function(&mut st, "cast", "f32_to_f16_scaled")?;
                let image = self.scratch(&mut st, dst.len())?;
                self.cast(f, src as u64, image, factor, (dst.len() / 2) as u64)?;
                result::memcpy_dtoh_async(dst, image, self.stream)
                    .map_err(driver("cuMemcpyDtoHAsync"))
            }
        }
    }

    unsafe fn upload(&self, src: &[u8], dst: *mut u8, cast: Cast) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        match cast {
            Cast::Exact => result::memcpy_htod_async(dst as u64, src, self.stream)
                .map_err(driver("cuMemcpyHtoDAsync")),
            Cast::Half(factor) => {
                let mut st = lock(&self.state);
                let f = self.function(&mut st, "cast", "f16_to_f32_scaled")?;
                let image = self.scratch(&mut st, src.len())?;
                result::memcpy_htod_async(image, src, self.stream)
                    .map_err(driver("cuMemcpyHtoDAsync"))?;
                self.cast(f, image, dst as u64, factor, (src.len() / 2) as u64)
            }
        }
    }

    fn finish(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: the stream lives for the life of the process.
        unsafe { result::stream::synchronize(self.stream) }.map_err(driver("cuStreamSynchronize"))
    }

    fn host_region(&self, bytes: usize) -> Box<dyn HostRegion> {
        match Pinned::new(self.ctx, bytes) {
            Ok(p) => Box::new(p),
            Err(e) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    crate::log!(
                        crate::log::Level::Warning,
                        "host copies of CUDA tensors use pageable memory \
                         (slower): {bytes} bytes of page-locked memory could not be had: {e}"
                    )
                });
                Box::new(AlignedBuf::zeroed(bytes))
            }
        }
    }
}

/// Device memory allocated on a device's stream (stream-ordered) and freed on it when
/// dropped, after the work queued so far: the small buffers one call uses, such as a
/// flag, a histogram or a table of kernel arguments.
pub(crate) struct DeviceBuffer<'a> {
    dev: &'a CudaDevice,
    /// Its address on the device.
    pub(crate) ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl<'a> DeviceBuffer<'a> {
    /// `bytes` bytes, uninitialized.
    pub(crate) fn new(dev: &'a CudaDevice, bytes: usize) -> Result<DeviceBuffer<'a>> {
        // SAFETY: stream-ordered allocation on the device's stream, freed on drop.
        let ptr = unsafe { result::malloc_async(dev.stream, bytes) }
            .map_err(driver("cuMemAllocAsync"))?;
        Ok(DeviceBuffer { dev, ptr, bytes })
    }

    /// `bytes` zeroed bytes.
    pub(crate) fn zeroed(dev: &'a CudaDevice, bytes: usize) -> Result<DeviceBuffer<'a>> {
        let b = DeviceBuffer::new(dev, bytes)?;
        b.zero(bytes)?;
        Ok(b)
    }

    /// Queues setting its first `bytes` bytes to zero.
    pub(crate) fn zero(&self, bytes: usize) -> Result<()> {
        assert!(bytes <= self.bytes);
        // SAFETY: within this allocation.
        unsafe { result::memset_d8_async(self.ptr, 0, bytes, self.dev.stream) }
            .map_err(driver("cuMemsetD8Async"))
    }

    /// Queues copying `values` to `offset` bytes in. Pageable host memory: the driver has
    /// taken the values when this returns.
    pub(crate) fn write<T: Copy>(&self, offset: usize, values: &[T]) -> Result<()> {
        assert!(offset + std::mem::size_of_val(values) <= self.bytes);
        // SAFETY: within this allocation; the values are plain data.
        unsafe { result::memcpy_htod_async(self.ptr + offset as u64, values, self.dev.stream) }
            .map_err(driver("cuMemcpyHtoDAsync"))
    }

    /// Its first values, into `out`, once the work queued so far has run (waits for
    /// the stream).
    pub(crate) fn read<T: Copy>(&self, out: &mut [T]) -> Result<()> {
        assert!(std::mem::size_of_val(out) <= self.bytes);
        // SAFETY: as many bytes as `out` holds, from this allocation into `out`, waited
        // for before `out` is read; the values are plain data.
        unsafe {
            result::memcpy_dtoh_async(out, self.ptr, self.dev.stream)
                .map_err(driver("cuMemcpyDtoHAsync"))?;
            result::stream::synchronize(self.dev.stream).map_err(driver("cuStreamSynchronize"))
        }
    }
}

impl Drop for DeviceBuffer<'_> {
    fn drop(&mut self) {
        // SAFETY: allocated on this stream; freed after the work queued so far.
        let _ = unsafe { result::free_async(self.ptr, self.dev.stream) };
    }
}

/// A context made current on the calling thread, until dropped: then the context that
/// was current before (or none) is current again. Not `Send`: it ends on the thread it
/// began on.
pub(crate) struct Current {
    previous: sys::CUcontext,
}

impl Current {
    /// Makes `ctx` current on this thread, remembering the one that was.
    ///
    /// # Safety
    /// `ctx` must be a live context that outlives the value returned.
    unsafe fn set(ctx: sys::CUcontext) -> Result<Current> {
        let previous = result::ctx::get_current()
            .map_err(driver("cuCtxGetCurrent"))?
            .unwrap_or(std::ptr::null_mut());
        result::ctx::set_current(ctx).map_err(driver("cuCtxSetCurrent"))?;
        Ok(Current { previous })
    }
}

impl Drop for Current {
    fn drop(&mut self) {
        // SAFETY: the context that was current here before (primary contexts, such as
        // the framework's, stay retained by their owners), or null, which leaves the
        // thread without one, as it was.
        let _ = unsafe { result::ctx::set_current(self.previous) };
    }
}

/// Page-locked host memory (`cuMemHostAlloc`, portable: every context's copies see it
/// as pinned), freed when dropped.
struct Pinned {
    /// The context it was allocated in, made current to free it.
    ctx: sys::CUcontext,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the memory is owned by this value alone; the context handle is valid on any
// thread (retained for the life of the process).
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(ctx: sys::CUcontext, len: usize) -> Result<Pinned> {
        // SAFETY: the context is retained for the life of the process; the allocation
        // is owned by the value returned, which frees it once.
        unsafe {
            let _current = Current::set(ctx)?;
            let ptr = result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE)
                .map_err(driver("cuMemHostAlloc"))?;
            Ok(Pinned {
                ctx,
                ptr: ptr.cast(),
                len,
            })
        }
    }
}

impl HostRegion for Pinned {
    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes owned by this value, borrowed mutably through it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    fn size(&self) -> usize {
        self.len
    }
    fn pinned(&self) -> bool {
        true
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: the pointer came from cuMemHostAlloc and is freed once; the staged
        // path waits for every copy touching it before giving it back.
        unsafe {
            let current = Current::set(self.ctx);
            let _ = result::free_host(self.ptr.cast());
            drop(current);
        }
    }
}

/// Opens device `ordinal` and returns its stream handle (for DLPack's `stream=`).
pub fn stream_of(ordinal: i32) -> Result<u64> {
    CudaDevice::get(ordinal).map(|d| d.stream_handle())
}

/// The one-rank NCCL round trip the GPU tests run: a communicator of this process
/// alone on device `ordinal` (blocking, then non-blocking where NCCL allows), an
/// allreduce of values uploaded to the device, and the values read back and compared.
/// Returns what was checked.
pub fn nccl_round_trip(ordinal: i32) -> Result<String> {
    use crate::gpu::nccl::{Communicator, Nccl, Progress};
    let dev = CudaDevice::get(ordinal)?;
    // The caller's thread: its own context is current again once this returns.
    let _current = dev.enter()?;
    let nccl = Arc::new(Nccl::load(&search_dirs())?);
    let watch = Watch::alone(Duration::from_secs(60));
    let settled = |comm: &Communicator, what: &str| match comm.settle(&watch, || None)? {
        Waited::Done => Ok(()),
        Waited::Stopped(why) => Err(PerseusError::Device(format!("{what}: {why}"))),
    };
    let modes: &[bool] = if nccl.non_blocking() {
        &[false, true]
    } else {
        &[false]
    };
    let values: Vec<f32> = (0..4099).map(|i| i as f32 * 0.5 - 7.0).collect();
    for &non_blocking in modes {
        let comm = nccl.communicator(&nccl.unique_id()?, 1, 0, non_blocking)?;
        settled(&comm, "forming a one-rank NCCL communicator")?;
        let mut back = vec![0f32; values.len()];
        let bytes = values.len() * 4;
        // SAFETY: the device buffer is allocated, used and freed on this device's
        // stream, which is synchronised before the host buffers are read or dropped.
        unsafe {
            let buf = result::malloc_async(dev.stream, bytes).map_err(driver("cuMemAllocAsync"))?;
            let run = (|| {
                result::memcpy_htod_async(buf, &values, dev.stream)
                    .map_err(driver("cuMemcpyHtoDAsync"))?;
                for op in [crate::dtype::ReduceOp::Sum, crate::dtype::ReduceOp::Average] {
                    let f32s = crate::dtype::DataType::F32;
                    let started =
                        comm.allreduce(buf, buf, values.len(), f32s, op, dev.stream_handle())?;
                    if started == Progress::Pending {
                        settled(&comm, "a one-rank NCCL allreduce")?;
                    }
                }
                result::memcpy_dtoh_async(&mut back, buf, dev.stream)
                    .map_err(driver("cuMemcpyDtoHAsync"))
            })();
            let _ = result::free_async(buf, dev.stream);
            let synced =
                result::stream::synchronize(dev.stream).map_err(driver("cuStreamSynchronize"));
            run?;
            synced?;
        }
        if back != values {
            let at = back
                .iter()
                .zip(&values)
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            return Err(PerseusError::Device(format!(
                "the NCCL round trip (non-blocking: {non_blocking}) changed element {at}: {} \
                 became {}",
                values[at], back[at]
            )));
        }
    }
    Ok(format!(
        "NCCL {} ({}) on cuda:{ordinal} (sm_{}): {} float32 values through a one-rank \
         communicator (Sum, Average; {}) came back unchanged",
        nccl.version,
        nccl.path.display(),
        dev.sm,
        values.len(),
        if modes.len() == 2 {
            "blocking and non-blocking"
        } else {
            "blocking"
        }
    ))
}

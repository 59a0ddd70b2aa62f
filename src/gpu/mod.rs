//! The GPU path's foundation (docs/gpu.md): CUDA's libraries are found and loaded at run
//! time, by the file names CUDA 12 and 13 really ship (`libnccl.so.2`, `libnvrtc.so.13`,
//! ...), so the same build imports and works on machines without CUDA; and the device
//! kernels exist as CUDA C sources that NVRTC compiles at run time.
//!
//! Nothing here panics when a library is missing: [`libs`] answers with what it searched,
//! and callers turn that into [`crate::PerseusError::GpuUnavailable`].

pub mod forming;
pub mod group;
pub mod kernels;
pub mod libs;
pub mod nccl;
pub mod nvrtc;
pub mod ops;
pub mod optim;
pub mod runtime;

use std::sync::Arc;

use crate::device::kernels::{Answer, Call};
use crate::device::{optim::Group, Backend, DeviceMemory, Opener};
use crate::error::Result;

/// The CUDA library as the engine's device backend.
struct Cuda;

impl Backend for Cuda {
    fn memory(&self, ordinal: i32) -> Result<Arc<dyn DeviceMemory>> {
        runtime::CudaDevice::get(ordinal).map(|m| m as Arc<dyn DeviceMemory>)
    }
    fn opener(&self, nonblocking: bool) -> Box<dyn Opener> {
        Box::new(forming::CudaOpener { nonblocking })
    }
    fn kernel(&self, ordinal: i32, call: Call) -> Result<Answer> {
        ops::run(ordinal, call)
    }
    fn optim_step(&self, ordinal: i32, groups: &[Group]) -> Result<()> {
        optim::step(ordinal, groups)
    }
}

/// Makes CUDA the device backend of this process ([`crate::device::install`]); the
/// Python module does so as it loads.
pub fn install() {
    crate::device::install(&Cuda);
}

//! The GPU path's foundation (docs/gpu.md): CUDA's libraries are found and loaded at run
//! time, by the file names CUDA 12 and 13 really ship (`libnccl.so.2`, `libnvrtc.so.13`,
//! ...), so the same build imports and works on machines without CUDA; and the device
//! kernels exist as CUDA C sources that NVRTC compiles at run time.
//!
//! Nothing here panics when a library is missing: [`libs`] answers with what it searched,
//! and callers turn that into [`crate::PerseusError::GpuUnavailable`].

pub mod group;
pub mod kernels;
pub mod libs;
pub mod nccl;
pub mod nvrtc;
pub mod ops;
pub mod optim;
pub mod runtime;

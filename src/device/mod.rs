//! What the engine knows of devices, at the bottom of the crate: the tensor view and
//! [`Device`], waiting on a device without the risk of waiting forever ([`watch`]),
//! device memory reached through copies ([`memory`]), collectives among the ranks'
//! devices ([`group`]), the device kernels one at a time ([`kernels`]) and the fused
//! optimizer's rules ([`optim`]).
//!
//! A device library plugs in at run time: a build with one (`crate::gpu`, the `cuda`
//! feature) installs its [`Backend`] once, and the engine, the kernels and the
//! optimizer find it through [`backend`]. Nothing here or in the engine names the
//! library, so the layers above the device point only down.

use std::sync::{Arc, OnceLock};

use crate::error::{PerseusError, Result};

pub mod group;
pub mod kernels;
pub mod memory;
pub mod optim;
pub mod tensor;
pub mod watch;

pub use group::{agree, Agreement, DeviceGroup, Formed, Opener};
pub use memory::{pageable, Cast, DeviceMemory, HostRegion, StagingPool};
pub use tensor::{Device, OwnedTensor, TensorView};
pub use watch::{wait_for, Waited, Watch};

/// A device library: the CUDA one in builds with the `cuda` feature.
pub trait Backend: Send + Sync {
    /// Device `ordinal`'s memory, for the host-staged path.
    fn memory(&self, ordinal: i32) -> Result<Arc<dyn DeviceMemory>>;
    /// How a rank forms device groups (non-blocking communicators when
    /// `nonblocking`), for the device-direct path.
    fn opener(&self, nonblocking: bool) -> Box<dyn Opener>;
    /// Runs one kernel call (checked by [`kernels::check`]) on device `ordinal`.
    fn kernel(&self, ordinal: i32, call: kernels::Call) -> Result<kernels::Answer>;
    /// Runs one fused optimizer step (checked by `crate::optim`) on device `ordinal`.
    fn optim_step(&self, ordinal: i32, groups: &[optim::Group]) -> Result<()>;
}

static BACKEND: OnceLock<&'static dyn Backend> = OnceLock::new();

/// Installs the device library of this process; the first one installed stays.
pub fn install(backend: &'static dyn Backend) {
    let _ = BACKEND.set(backend);
}

/// The library serving `device`, or why there is none.
pub fn backend(device: Device) -> Result<&'static dyn Backend> {
    BACKEND.get().copied().ok_or_else(|| {
        PerseusError::GpuUnavailable(format!(
            "{device}: this build of Perseus has no GPU support (the cuda feature)"
        ))
    })
}

/// The opener of this process: the installed library's, or one that always says why
/// not.
pub fn opener(nonblocking: bool) -> Box<dyn Opener> {
    match BACKEND.get() {
        Some(b) => b.opener(nonblocking),
        None => Box::new(NoGpu),
    }
}

/// The opener where no device library is installed.
struct NoGpu;

impl Opener for NoGpu {
    fn offer(&self, _: Device) -> std::result::Result<[u8; 16], String> {
        Err("this build of Perseus has no GPU support (the cuda feature)".into())
    }
    fn open(
        &self,
        _: &dyn crate::collective::Comm,
        _: Device,
        _: usize,
        _: &[usize],
        _: &Watch<'_>,
    ) -> Result<Formed> {
        Ok(Err("this build of Perseus has no GPU support".into()))
    }
}

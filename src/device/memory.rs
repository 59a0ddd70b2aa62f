//! Memory the engine reaches only through copies (a GPU's), and the host memory those
//! copies go through.

use crate::error::Result;
use crate::kernels::AlignedBuf;

/// How values change on their way between device and host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Cast {
    /// The bytes as they are.
    Exact,
    /// float32 on the device, float16 on the host. Values are multiplied by the
    /// factor on the device: before the cast down, after the cast up.
    Half(f32),
}

/// Memory the engine reaches only through copies, such as a GPU's. Copies are queued
/// in order on one stream of the device and complete by [`DeviceMemory::finish`].
pub trait DeviceMemory: Send + Sync {
    /// Queues a copy of device memory at `src` into `dst`. With [`Cast::Half`], `src`
    /// holds `dst.len() / 2` float32 values.
    ///
    /// # Safety
    /// `src` must be device memory of this device, alive and holding the bytes read,
    /// and `dst` must stay alive and unmoved until [`DeviceMemory::finish`] returns.
    unsafe fn download(&self, src: *const u8, dst: &mut [u8], cast: Cast) -> Result<()>;

    /// Queues a copy of `src` into device memory at `dst`. With [`Cast::Half`], `dst`
    /// receives `src.len() / 2` float32 values.
    ///
    /// # Safety
    /// As for [`DeviceMemory::download`], with `dst` writable and `src` alive until
    /// [`DeviceMemory::finish`] returns.
    unsafe fn upload(&self, src: &[u8], dst: *mut u8, cast: Cast) -> Result<()>;

    /// Waits until every copy queued so far has completed.
    fn finish(&self) -> Result<()>;

    /// Host memory of `bytes` for copies to and from this device: page-locked where
    /// the device can pin it (its copies then run at the bus's full speed, without
    /// the host waiting on each), ordinary memory otherwise.
    fn host_region(&self, bytes: usize) -> Box<dyn HostRegion> {
        pageable(bytes)
    }
}

/// Ordinary (pageable) host memory of `bytes`, for copies where no device pins any.
pub fn pageable(bytes: usize) -> Box<dyn HostRegion> {
    Box::new(AlignedBuf::zeroed(bytes))
}

/// Host memory the staged and the hierarchical device paths copy through.
pub trait HostRegion: Send {
    /// Its bytes.
    fn bytes(&mut self) -> &mut [u8];
    /// How many.
    fn size(&self) -> usize;
    /// Whether the memory is page-locked: a device's copies into it are then queued
    /// without the host waiting for them.
    fn pinned(&self) -> bool {
        false
    }
}

impl HostRegion for AlignedBuf {
    fn bytes(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
    fn size(&self) -> usize {
        self.len()
    }
}

/// The smallest region made: small responses share one size.
const MIN_REGION: usize = 1 << 20;

/// Host regions for copies of device tensors, reused from response to response: the
/// staged path's, and the hierarchical NCCL path's chunks between hosts. One is in use at
/// a time (a float16 response's images are given back before its exact resend takes one).
#[derive(Default)]
pub struct StagingPool {
    free: Vec<Box<dyn HostRegion>>,
}

impl StagingPool {
    /// A region of at least `bytes`: the smallest free one that fits, else a new one
    /// made by `make` (given its size: `bytes` rounded up to a power of two), which
    /// replaces the largest free one. Regions are kept for the life of the engine: as
    /// many as were in use at once, each the size of the largest response so rounded.
    pub fn take(
        &mut self,
        bytes: usize,
        make: impl FnOnce(usize) -> Box<dyn HostRegion>,
    ) -> Box<dyn HostRegion> {
        let fits = (0..self.free.len())
            .filter(|&i| self.free[i].size() >= bytes)
            .min_by_key(|&i| self.free[i].size());
        if let Some(i) = fits {
            return self.free.swap_remove(i);
        }
        let largest = (0..self.free.len()).max_by_key(|&i| self.free[i].size());
        if let Some(i) = largest {
            self.free.swap_remove(i);
        }
        make(bytes.next_power_of_two().max(MIN_REGION))
    }

    /// Returns a region taken before, for later responses.
    pub fn give(&mut self, region: Box<dyn HostRegion>) {
        self.free.push(region);
    }

    /// The sizes of the free regions (for tests and statistics).
    pub fn free_sizes(&self) -> Vec<usize> {
        self.free.iter().map(|r| r.size()).collect()
    }
}

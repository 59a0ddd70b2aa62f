//! A view of framework memory the engine reads and writes, and tensors the
//! engine allocates itself.

use crate::dtype::DataType;
use crate::kernels::AlignedBuf;

/// Where a tensor's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// Memory of a CUDA device (reserved for the GPU path).
    Cuda(i32),
}

impl std::fmt::Display for Device {
    /// As the frameworks write it: `cpu`, `cuda:1`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(o) => write!(f, "cuda:{o}"),
        }
    }
}

/// Contiguous tensor memory owned by a framework. The front-end keeps the
/// framework tensor alive until the operation completes.
#[derive(Debug, Clone)]
pub struct TensorView {
    /// First byte.
    pub ptr: *mut u8,
    /// Bytes.
    pub nbytes: usize,
    /// Element type.
    pub dtype: DataType,
    /// Shape.
    pub shape: Vec<i64>,
    /// Device.
    pub device: Device,
}

// SAFETY: the memory is only touched by the engine thread while the front-end
// holds the tensor alive and does not use it (Horovod's contract).
unsafe impl Send for TensorView {}

impl TensorView {
    /// How many elements it holds.
    pub fn elements(&self) -> usize {
        self.nbytes / self.dtype.size()
    }

    /// The bytes.
    ///
    /// # Safety
    /// The memory must be alive and not written by anyone else meanwhile.
    pub unsafe fn bytes(&self) -> &[u8] {
        if self.nbytes == 0 {
            return &[];
        }
        std::slice::from_raw_parts(self.ptr, self.nbytes)
    }

    /// The bytes, mutably.
    ///
    /// # Safety
    /// As for [`TensorView::bytes`], and no other view may alias it.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        if self.nbytes == 0 {
            return &mut [];
        }
        std::slice::from_raw_parts_mut(self.ptr, self.nbytes)
    }
}

/// A view of float32 values in `v` (tests), marked as living on `device`.
#[cfg(test)]
pub(crate) fn f32_view(v: &mut [f32], device: Device) -> TensorView {
    TensorView {
        ptr: v.as_mut_ptr().cast(),
        nbytes: v.len() * 4,
        dtype: DataType::F32,
        shape: vec![v.len() as i64],
        device,
    }
}

/// A tensor the engine allocated (allgather, alltoall, reducescatter output).
pub struct OwnedTensor {
    /// The data.
    pub buf: AlignedBuf,
    /// Element type.
    pub dtype: DataType,
    /// Shape.
    pub shape: Vec<i64>,
}

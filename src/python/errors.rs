//! The one place core errors become Python exceptions.

use crate::error::PerseusError;
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::PyErr;

create_exception!(
    _core,
    HorovodInternalError,
    PyRuntimeError,
    "A collective failed on this rank: ranks disagreed about it, a peer died or timed out."
);

create_exception!(
    _core,
    GpuUnavailableError,
    PyRuntimeError,
    "A GPU library (CUDA driver, NVRTC or NCCL) is missing or unusable; the message says where it was looked for."
);

/// Maps a core error to its Python exception.
pub fn to_py(e: PerseusError) -> PyErr {
    let msg = e.to_string();
    match e {
        PerseusError::NotInitialized
        | PerseusError::NotARank(_)
        | PerseusError::InvalidConfig { .. }
        | PerseusError::InvalidArgument(_) => PyValueError::new_err(msg),
        PerseusError::UnsupportedType(_) => PyTypeError::new_err(msg),
        PerseusError::Mismatch(_)
        | PerseusError::Peer(_)
        | PerseusError::Protocol(_)
        | PerseusError::Io(_)
        | PerseusError::Aborted(_)
        | PerseusError::Device(_) => HorovodInternalError::new_err(msg),
        PerseusError::GpuUnavailable(_) => GpuUnavailableError::new_err(msg),
    }
}

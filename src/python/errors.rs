//! The one place core errors become Python exceptions.

use crate::error::PerseusError;
use pyo3::create_exception;
use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

create_exception!(
    _core,
    HorovodInternalError,
    PyRuntimeError,
    "A collective failed on this rank: ranks disagreed about it, a peer died or timed out."
);

create_exception!(
    _core,
    MismatchError,
    HorovodInternalError,
    "Ranks disagreed about a collective (its name, shape, dtype, op or root): a HorovodInternalError that front-ends may raise as their framework's own type."
);

create_exception!(
    _core,
    GpuUnavailableError,
    PyRuntimeError,
    "A GPU library (CUDA driver, NVRTC or NCCL) is missing or unusable; the message says where it was looked for."
);

create_exception!(
    _core,
    NameInFlightError,
    PyValueError,
    "An operation was submitted under a name that an operation of this rank still in flight has (a ValueError)."
);

create_exception!(
    _core,
    Rank0AddressUnknown,
    PyValueError,
    "A job on several hosts does not know where rank 0 is (a ValueError); under mpirun the Python side learns it through MPI."
);

static UNSUPPORTED_OPERATION: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `UnsupportedOperationError`: an operation Horovod defines but does not implement for
/// the arguments given. It derives from `NotImplementedError` (what Horovod raises, a
/// `RuntimeError`) and from `ValueError` (what Perseus raised for bad arguments before),
/// so an `except` clause written for either catches it.
pub fn unsupported_operation(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    UNSUPPORTED_OPERATION
        .get_or_try_init(py, || {
            let bases = PyTuple::new(
                py,
                [
                    py.get_type::<PyNotImplementedError>(),
                    py.get_type::<PyValueError>(),
                ],
            )?;
            let body = PyDict::new(py);
            body.set_item("__module__", "perseus._core")?;
            body.set_item(
                "__doc__",
                "An operation Horovod defines but does not implement for these arguments \
                 (a NotImplementedError, and a ValueError).",
            )?;
            let made = py
                .get_type::<PyType>()
                .call1(("UnsupportedOperationError", bases, body))?;
            Ok::<_, PyErr>(made.cast_into::<PyType>()?.unbind())
        })
        .map(|t| t.bind(py))
}

/// Maps a core error to its Python exception.
pub fn to_py(e: PerseusError) -> PyErr {
    let msg = e.to_string();
    match e {
        PerseusError::NotInitialized
        | PerseusError::NotARank(_)
        | PerseusError::InvalidConfig { .. }
        | PerseusError::InvalidArgument(_) => PyValueError::new_err(msg),
        PerseusError::Rank0Unknown(_) => Rank0AddressUnknown::new_err(msg),
        PerseusError::NameInFlight(_) => NameInFlightError::new_err(msg),
        PerseusError::NotImplemented(_) => Python::attach(|py| match unsupported_operation(py) {
            Ok(t) => PyErr::from_type(t.clone(), msg),
            Err(e) => e,
        }),
        PerseusError::UnsupportedType(_) => PyTypeError::new_err(msg),
        PerseusError::Mismatch(_) => MismatchError::new_err(msg),
        PerseusError::Peer(_)
        | PerseusError::Protocol(_)
        | PerseusError::Io(_)
        | PerseusError::Aborted(_)
        | PerseusError::Device(_) => HorovodInternalError::new_err(msg),
        PerseusError::GpuUnavailable(_) => GpuUnavailableError::new_err(msg),
    }
}

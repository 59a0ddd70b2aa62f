//! The one error type of the core. The Python bindings map each variant to a
//! Python exception in `python/errors.rs`, and nowhere else.

use thiserror::Error;

/// Everything that can go wrong in the core.
#[derive(Debug, Clone, Error)]
pub enum PerseusError {
    /// A call was made before `init()` or after `shutdown()`.
    #[error("Perseus has not been initialized; use hvd.init().")]
    NotInitialized,
    /// This process is not a rank, though a rank's `init()` reached it: a child forked
    /// after `init()`, or a process a rank started through multiprocessing (a
    /// DataLoader worker) that ran `init()` again. The message says which.
    #[error("{0}")]
    NotARank(String),
    /// A configuration variable holds a value outside its allowed set.
    #[error("invalid value {value:?} for {var}: {allowed}")]
    InvalidConfig {
        /// The environment variable.
        var: String,
        /// The value found.
        value: String,
        /// What would have been accepted.
        allowed: String,
    },
    /// An argument is wrong (bad root, bad splits, rank outside a process set, ...).
    #[error("{0}")]
    InvalidArgument(String),
    /// A job on several hosts whose configuration does not say where rank 0 is (under
    /// mpirun the Python side can learn it through MPI and start again).
    #[error("{0}")]
    Rank0Unknown(String),
    /// An operation was submitted under a name that an operation of this rank still in
    /// flight has (in its process set).
    #[error("{0}")]
    NameInFlight(String),
    /// An operation Horovod defines but does not implement for these arguments (Adasum
    /// for a reducescatter); raised as Python's NotImplementedError, as Horovod raises it.
    #[error("{0}")]
    NotImplemented(String),
    /// A tensor has a data type the core cannot reduce or move.
    #[error("unsupported tensor data type: {0}")]
    UnsupportedType(String),
    /// Ranks disagreed about an operation (name, shape, dtype, op or root).
    #[error("{0}")]
    Mismatch(String),
    /// A peer could not be reached, closed its connection, or timed out.
    #[error("{0}")]
    Peer(String),
    /// A frame on a socket was not what the protocol allows.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// An operating-system I/O failure not tied to one peer.
    #[error("I/O error: {0}")]
    Io(String),
    /// The engine stopped (shutdown or an earlier fatal failure).
    #[error("{0}")]
    Aborted(String),
    /// A GPU library (CUDA driver, NVRTC, NCCL) is missing or unusable, or the build has
    /// no GPU support; the message names what was searched.
    #[error("{0}")]
    GpuUnavailable(String),
    /// A call into the GPU's driver failed (a copy, a kernel launch, a stream wait).
    #[error("CUDA error: {0}")]
    Device(String),
}

/// Result alias used throughout the core.
pub type Result<T> = std::result::Result<T, PerseusError>;

impl From<std::io::Error> for PerseusError {
    fn from(e: std::io::Error) -> Self {
        PerseusError::Io(e.to_string())
    }
}

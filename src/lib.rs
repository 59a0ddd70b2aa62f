//! Perseus core: a framework-agnostic engine that moves and reduces tensors
//! between the processes of a data-parallel training job. Nothing here knows
//! Python except the `python` module, built only with the `python` feature.

pub mod dtype;
pub mod env;
pub mod error;
pub mod hash;
pub mod kernels;
pub mod log;
pub mod params;

pub use dtype::{DataType, ReduceOp};
pub use error::{PerseusError, Result};
pub mod auth;
pub mod collective;
pub mod compress;
pub mod config;
pub mod deadline;
pub mod device;
pub mod engine;
#[doc(hidden)]
pub mod fuzzing;
pub mod gate;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod limits;
pub mod optim;
pub mod plan;
#[cfg(feature = "python")]
mod python;
pub mod rendezvous;
pub mod timeline;
pub mod transport;
pub mod wire;

//! What one rank checks alone before a request leaves it, so the error is raised at
//! the call.

use super::message::{self, OpKind, Request};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{PerseusError, Result};

/// The error for a process set this rank does not know.
pub(super) fn unregistered(set: u32) -> PerseusError {
    PerseusError::InvalidArgument(format!("process set {set} is not registered"))
}

/// Checks what one rank can check alone, so the error is raised at the call.
pub(super) fn check_locally(req: &Request, set_size: usize) -> Result<()> {
    if req.name.len() > message::MAX_NAME_BYTES {
        return Err(PerseusError::InvalidArgument(format!(
            "the name of this {} is {} bytes long; names may have at most {} bytes",
            req.kind.name(),
            req.name.len(),
            message::MAX_NAME_BYTES
        )));
    }
    let floating = matches!(
        req.dtype,
        DataType::F16 | DataType::BF16 | DataType::F32 | DataType::F64
    );
    if req.op == ReduceOp::Adasum && req.kind == OpKind::Reducescatter {
        return Err(PerseusError::NotImplemented(
            "reducescatter takes Sum or Average; Adasum is an allreduce op".into(),
        ));
    }
    if req.op == ReduceOp::Adasum && req.kind == OpKind::Allreduce && !floating {
        return Err(PerseusError::UnsupportedType(format!(
            "Adasum reduces floating-point tensors only, not {}",
            req.dtype.name()
        )));
    }
    if req.dtype == DataType::Bool && req.op == ReduceOp::Average && req.kind.has_data() {
        return Err(PerseusError::UnsupportedType(
            "bool tensors cannot be averaged; use op=Sum (logical or) or Min/Max".into(),
        ));
    }
    if req.kind == OpKind::Broadcast && !(0..set_size as i64).contains(&req.root) {
        return Err(PerseusError::InvalidArgument(format!(
            "broadcast root {} is not a rank of the set (0 to {})",
            req.root,
            set_size as i64 - 1
        )));
    }
    if req.kind == OpKind::Allgather && req.shape.is_empty() {
        return Err(PerseusError::InvalidArgument(
            "allgather needs a tensor of at least one dimension".into(),
        ));
    }
    if req.kind == OpKind::Alltoall {
        let d0 = req.shape.first().copied().unwrap_or(0);
        if req.shape.is_empty()
            || req.ints.len() != set_size
            || req.ints.iter().any(|&s| s < 0)
            || req.ints.iter().sum::<i64>() != d0
        {
            return Err(PerseusError::InvalidArgument(format!(
                "alltoall splits {:?} must be {set_size} non-negative row counts summing to the \
                 first dimension ({d0})",
                req.ints
            )));
        }
    }
    Ok(())
}

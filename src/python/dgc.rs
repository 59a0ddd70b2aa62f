//! `_core.dgc_fold_select`: deep gradient compression's pass over one weight on the
//! CPU ([`crate::kernels::dgc`]), on torch tensors handed in as DLPack capsules.

use super::dlpack::view_flat;
use super::errors::to_py;
use crate::dtype::DataType;
use crate::engine::{Device, TensorView};
use crate::error::PerseusError;
use crate::kernels::dgc::{fold_select, Fold};
use pyo3::prelude::*;

/// The view of `obj`, checked to be in host memory and of `dtype`.
fn host(obj: &Bound<'_, PyAny>, what: &str, dtype: DataType) -> Result<TensorView, PerseusError> {
    let v = view_flat(obj)?;
    if !matches!(v.device, Device::Cpu) {
        return Err(PerseusError::InvalidArgument(format!(
            "dgc_fold_select: {what} is not in host memory"
        )));
    }
    if v.dtype != dtype {
        return Err(PerseusError::UnsupportedType(format!(
            "dgc_fold_select: {what} is {:?}, not {dtype:?}",
            v.dtype
        )));
    }
    Ok(v)
}

/// Folds the float32 gradient `g` into the momentum `u` and velocity `v` (contiguous,
/// one length, in host memory) as SGD's `momentum`, `dampening` and `nesterov` say,
/// and writes the indices of the entries with `|v| >= threshold` into the int64
/// tensor `out`, as many as fit, in increasing order. Returns how many passed in all.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn dgc_fold_select(
    py: Python<'_>,
    g: Bound<'_, PyAny>,
    u: Bound<'_, PyAny>,
    v: Bound<'_, PyAny>,
    momentum: f32,
    dampening: f32,
    nesterov: bool,
    threshold: f32,
    out: Bound<'_, PyAny>,
) -> PyResult<usize> {
    let run = || -> Result<usize, PerseusError> {
        let g = host(&g, "g", DataType::F32)?;
        let u = host(&u, "u", DataType::F32)?;
        let v = host(&v, "v", DataType::F32)?;
        let out = host(&out, "out", DataType::I64)?;
        if u.nbytes != g.nbytes || v.nbytes != g.nbytes {
            return Err(PerseusError::InvalidArgument(format!(
                "dgc_fold_select: g, u and v hold {}, {} and {} elements",
                g.elements(),
                u.elements(),
                v.elements()
            )));
        }
        let fold = Fold {
            momentum,
            dampening,
            nesterov,
        };
        Ok(py.detach(move || {
            // SAFETY: the capsules (held by the caller) keep the tensors alive, and the
            // views were checked: host memory, the element types, one length for g, u
            // and v. The caller passes distinct tensors.
            let (g, u, v, out) = unsafe {
                (
                    std::slice::from_raw_parts(g.ptr as *const f32, g.elements()),
                    std::slice::from_raw_parts_mut(u.ptr as *mut f32, u.elements()),
                    std::slice::from_raw_parts_mut(v.ptr as *mut f32, v.elements()),
                    std::slice::from_raw_parts_mut(out.ptr as *mut i64, out.elements()),
                )
            };
            fold_select(g, u, v, fold, threshold, out)
        }))
    };
    run().map_err(to_py)
}

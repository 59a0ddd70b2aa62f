//! `_core.gpu_cast`, `gpu_reduce`, `gpu_scale`, `gpu_nonfinite`, `gpu_top_k`: the device
//! kernels one at a time ([`crate::device::kernels`]) on tensors handed in as DLPack
//! capsules. `perseus.torch.kernels` orders the framework's stream around them.

use super::dlpack::view_flat;
use super::errors::to_py;
use crate::device::kernels::{run, Answer, Call};
use crate::dtype::ReduceOp;
use crate::error::PerseusError;
use pyo3::prelude::*;

/// Runs `call` without the GIL.
fn call(py: Python<'_>, call: Call) -> PyResult<Answer> {
    py.detach(move || run(call)).map_err(to_py)
}

/// `dst = cast(src * factor)` from float32 to float16 or bfloat16, or
/// `dst = float32(src) * factor` back; queued on Perseus's stream of the device.
#[pyfunction]
pub fn gpu_cast(
    py: Python<'_>,
    src: Bound<'_, PyAny>,
    dst: Bound<'_, PyAny>,
    factor: f32,
) -> PyResult<()> {
    let (src, dst) = (
        view_flat(&src).map_err(to_py)?,
        view_flat(&dst).map_err(to_py)?,
    );
    call(py, Call::Cast { src, dst, factor }).map(|_| ())
}

/// `dst = dst (op) src` elementwise, `op` one of `"sum"`, `"min"`, `"max"`, `"product"`;
/// queued on Perseus's stream of the device.
#[pyfunction]
pub fn gpu_reduce(
    py: Python<'_>,
    dst: Bound<'_, PyAny>,
    src: Bound<'_, PyAny>,
    op: &str,
) -> PyResult<()> {
    let op = match op {
        "sum" => ReduceOp::Sum,
        "min" => ReduceOp::Min,
        "max" => ReduceOp::Max,
        "product" => ReduceOp::Product,
        other => {
            return Err(to_py(PerseusError::InvalidArgument(format!(
                "reduce: no op {other:?}; there are sum, min, max and product"
            ))))
        }
    };
    let (dst, src) = (
        view_flat(&dst).map_err(to_py)?,
        view_flat(&src).map_err(to_py)?,
    );
    call(py, Call::Reduce { dst, src, op }).map(|_| ())
}

/// `x *= factor` in place; queued on Perseus's stream of the device.
#[pyfunction]
pub fn gpu_scale(py: Python<'_>, x: Bound<'_, PyAny>, factor: f64) -> PyResult<()> {
    let x = view_flat(&x).map_err(to_py)?;
    call(py, Call::Scale { x, factor }).map(|_| ())
}

/// Whether any element of `x` (float32 or float16) is NaN or infinite; waits for
/// Perseus's stream.
#[pyfunction]
pub fn gpu_nonfinite(py: Python<'_>, x: Bound<'_, PyAny>) -> PyResult<bool> {
    let x = view_flat(&x).map_err(to_py)?;
    match call(py, Call::Nonfinite { x })? {
        Answer::Nonfinite(found) => Ok(found),
        other => unreachable!("nonfinite answered {other:?}"),
    }
}

/// DGC's selection from the float32 residual `x`: the `k` elements of largest
/// magnitude (more on ties, up to the slots) go into `indices` (int32) and `values`
/// (float32) and are cleared in `x`. Returns `(taken, threshold)`; waits for Perseus's
/// stream.
#[pyfunction]
pub fn gpu_top_k(
    py: Python<'_>,
    x: Bound<'_, PyAny>,
    k: usize,
    indices: Bound<'_, PyAny>,
    values: Bound<'_, PyAny>,
) -> PyResult<(usize, f32)> {
    let x = view_flat(&x).map_err(to_py)?;
    let indices = view_flat(&indices).map_err(to_py)?;
    let values = view_flat(&values).map_err(to_py)?;
    let top = Call::TopK {
        x,
        k,
        indices,
        values,
    };
    match call(py, top)? {
        Answer::TopK { taken, threshold } => Ok((taken, threshold)),
        other => unreachable!("top_k answered {other:?}"),
    }
}

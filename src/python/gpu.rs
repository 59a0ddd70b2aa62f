//! The GPU path's own calls: which libraries were found, their search directories,
//! Perseus's stream of a device, the one-rank NCCL round trip and the kernels' compilation
//! (docs/gpu.md). Builds without the `cuda` feature answer each with why not.

use super::errors::to_py;
#[cfg(not(feature = "cuda"))]
use crate::error::PerseusError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The GPU libraries (CUDA driver, NVRTC, NCCL): for each, a dict with `name`, `files`
/// (the names looked for), `path` and `version` (None when missing) and `missing` (why,
/// with every place searched). `dirs` are searched first.
#[pyfunction]
pub fn gpu_libraries<'py>(
    py: Python<'py>,
    dirs: Vec<std::path::PathBuf>,
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    let mut out = Vec::new();
    #[cfg(feature = "cuda")]
    for lib in crate::gpu::libs::CudaLib::ALL {
        let probe = crate::gpu::libs::probe(lib, &dirs);
        let d = PyDict::new(py);
        d.set_item("name", lib.label())?;
        d.set_item("files", lib.file_names().to_vec())?;
        d.set_item(
            "path",
            probe.loaded.as_ref().map(|l| l.path.display().to_string()),
        )?;
        d.set_item("version", probe.loaded.as_ref().map(|l| l.version.clone()))?;
        d.set_item(
            "missing",
            probe.loaded.is_none().then(|| probe.missing_message()),
        )?;
        out.push(d);
    }
    #[cfg(not(feature = "cuda"))]
    for name in ["CUDA driver", "NVRTC", "NCCL"] {
        let _ = &dirs;
        let d = PyDict::new(py);
        d.set_item("name", name)?;
        d.set_item("files", Vec::<String>::new())?;
        d.set_item("path", py.None())?;
        d.set_item("version", py.None())?;
        d.set_item(
            "missing",
            "this build of Perseus has no GPU support (the cuda feature)",
        )?;
        out.push(d);
    }
    Ok(out)
}

/// Sets the directories searched first for CUDA's libraries (the nvidia-* wheels').
#[pyfunction]
pub fn gpu_search_dirs(dirs: Vec<std::path::PathBuf>) {
    #[cfg(feature = "cuda")]
    crate::gpu::runtime::set_search_dirs(dirs);
    #[cfg(not(feature = "cuda"))]
    let _ = dirs;
}

/// Runs `$call` on device `$ordinal` without the GIL in builds with the GPU path;
/// elsewhere raises GpuUnavailableError (the call is not even compiled there).
macro_rules! on_device {
    ($py:expr, $ordinal:expr, $call:path) => {{
        #[cfg(feature = "cuda")]
        {
            $py.detach(|| $call($ordinal)).map_err(to_py)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = $py;
            Err(to_py(PerseusError::GpuUnavailable(format!(
                "cuda:{}: this build of Perseus has no GPU support (the cuda feature)",
                $ordinal
            ))))
        }
    }};
}

/// Perseus's CUDA stream on device `ordinal` (opening the device the first time), as
/// the integer `__dlpack__(stream=...)` takes. Raises GpuUnavailableError without CUDA.
#[pyfunction]
pub fn gpu_stream(py: Python<'_>, ordinal: i32) -> PyResult<u64> {
    on_device!(py, ordinal, crate::gpu::runtime::stream_of)
}

/// The one-rank NCCL round trip on device `ordinal` (docs/gpu.md); returns what was
/// checked. Raises GpuUnavailableError without CUDA or NCCL.
#[pyfunction]
pub fn gpu_nccl_round_trip(py: Python<'_>, ordinal: i32) -> PyResult<String> {
    on_device!(py, ordinal, crate::gpu::runtime::nccl_round_trip)
}

/// Compiles every device kernel source with NVRTC, to PTX or, with `sm` (90 for an
/// H100), to CUBINs for that architecture: a dict per source with `source`, `kernels`
/// and `bytes`. Raises GpuUnavailableError when NVRTC is missing.
#[pyfunction]
#[pyo3(signature = (dirs, sm=None))]
pub fn gpu_compile_kernels<'py>(
    py: Python<'py>,
    dirs: Vec<std::path::PathBuf>,
    sm: Option<u32>,
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    #[cfg(feature = "cuda")]
    {
        let compiled = py
            .detach(|| crate::gpu::kernels::compile_all(&dirs, sm))
            .map_err(to_py)?;
        let mut out = Vec::new();
        for c in compiled {
            let d = PyDict::new(py);
            d.set_item("source", c.name)?;
            d.set_item("kernels", c.kernels)?;
            d.set_item("bytes", c.bytes)?;
            out.push(d);
        }
        Ok(out)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (py, dirs, sm);
        Err(to_py(PerseusError::GpuUnavailable(
            "this build of Perseus has no GPU support (the cuda feature)".into(),
        )))
    }
}

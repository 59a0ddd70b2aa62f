//! The device kernels, as CUDA C sources that NVRTC compiles at run time.
//!
//! The sources use no CUDA header (no toolkit needs to be installed): float16 conversions
//! are PTX `cvt` instructions, bfloat16 ones are bit operations. Each kernel takes the
//! element count and walks its range with a grid-stride loop. [`compile_all`] compiles
//! every source through NVRTC, which is what CI checks on machines without a GPU.

use std::path::PathBuf;

use crate::error::{PerseusError, Result};
use crate::gpu::libs::{check_bound, probe, CudaLib};

/// Helpers every source starts with: conversions and the grid-stride loop.
const PRELUDE: &str = r#"
typedef unsigned long long u64;
#define FOR_EACH(i, n) for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); \
                            i += (u64)blockDim.x * gridDim.x)
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}
__device__ __forceinline__ float combine(float a, float b, int op) {
    switch (op) { case 0: return a + b; case 1: return fminf(a, b);
                  case 2: return fmaxf(a, b); default: return a * b; }
}
"#;

/// Every kernel source: (name, body after the prelude).
pub const SOURCES: &[(&str, &str)] = &[
    (
        "cast",
        r#"
// float32 -> float16 / bfloat16 with the gradient scale (PERSEUS_ALLREDUCE_DTYPE,
// PERSEUS_ALLREDUCE_GRADIENT_SCALE), and back with its inverse.
extern "C" __global__ void f32_to_f16_scaled(const float* x, unsigned short* y, float scale, u64 n) {
    FOR_EACH(i, n) y[i] = f32_to_f16(x[i] * scale);
}
extern "C" __global__ void f16_to_f32_scaled(const unsigned short* x, float* y, float inv, u64 n) {
    FOR_EACH(i, n) y[i] = f16_to_f32(x[i]) * inv;
}
extern "C" __global__ void f32_to_bf16_scaled(const float* x, unsigned short* y, float scale, u64 n) {
    FOR_EACH(i, n) y[i] = f32_to_bf16(x[i] * scale);
}
extern "C" __global__ void bf16_to_f32_scaled(const unsigned short* x, float* y, float inv, u64 n) {
    FOR_EACH(i, n) y[i] = bf16_to_f32(x[i]) * inv;
}
"#,
    ),
    (
        "reduce",
        r#"
// dst = dst (op) src; op 0 sum, 1 min, 2 max, 3 product. Average is a sum then a scale.
extern "C" __global__ void reduce_f32(float* dst, const float* src, int op, u64 n) {
    FOR_EACH(i, n) dst[i] = combine(dst[i], src[i], op);
}
extern "C" __global__ void reduce_f64(double* dst, const double* src, int op, u64 n) {
    FOR_EACH(i, n) {
        double a = dst[i], b = src[i];
        dst[i] = op == 0 ? a + b : op == 1 ? fmin(a, b) : op == 2 ? fmax(a, b) : a * b;
    }
}
extern "C" __global__ void reduce_f16(unsigned short* dst, const unsigned short* src, int op, u64 n) {
    FOR_EACH(i, n) dst[i] = f32_to_f16(combine(f16_to_f32(dst[i]), f16_to_f32(src[i]), op));
}
extern "C" __global__ void reduce_bf16(unsigned short* dst, const unsigned short* src, int op, u64 n) {
    FOR_EACH(i, n) dst[i] = f32_to_bf16(combine(bf16_to_f32(dst[i]), bf16_to_f32(src[i]), op));
}
"#,
    ),
    (
        "scale",
        r#"
// Prescale and postscale (and the 1/n of Average).
extern "C" __global__ void scale_f32(float* x, float s, u64 n) { FOR_EACH(i, n) x[i] *= s; }
extern "C" __global__ void scale_f64(double* x, double s, u64 n) { FOR_EACH(i, n) x[i] *= s; }
extern "C" __global__ void scale_f16(unsigned short* x, float s, u64 n) {
    FOR_EACH(i, n) x[i] = f32_to_f16(f16_to_f32(x[i]) * s);
}
extern "C" __global__ void scale_bf16(unsigned short* x, float s, u64 n) {
    FOR_EACH(i, n) x[i] = f32_to_bf16(bf16_to_f32(x[i]) * s);
}
"#,
    ),
    (
        "nancheck",
        r#"
// PERSEUS_ALLREDUCE_NANCHECK: *flag becomes 1 when any element is NaN or infinite.
extern "C" __global__ void nonfinite_f32(const float* x, int* flag, u64 n) {
    FOR_EACH(i, n) if (!isfinite(x[i])) { atomicOr(flag, 1); return; }
}
extern "C" __global__ void nonfinite_f16(const unsigned short* x, int* flag, u64 n) {
    FOR_EACH(i, n) if ((x[i] & 0x7c00u) == 0x7c00u) { atomicOr(flag, 1); return; }
}
"#,
    ),
    (
        "dgc",
        r#"
// Deep gradient compression: the top-k threshold is found by bisection on the count of
// elements at or above it; then the elements above it are gathered (index, value) and
// cleared from the residual.
extern "C" __global__ void count_at_least(const float* x, float threshold, u64* count, u64 n) {
    u64 mine = 0;
    FOR_EACH(i, n) mine += fabsf(x[i]) >= threshold;
    if (mine) atomicAdd(count, mine);
}
extern "C" __global__ void select_at_least(float* x, float threshold, unsigned int* indices,
                                           float* values, u64* taken, u64 capacity, u64 n) {
    FOR_EACH(i, n) {
        float v = x[i];
        if (fabsf(v) >= threshold) {
            u64 slot = atomicAdd(taken, 1ull);
            if (slot < capacity) { indices[slot] = (unsigned int)i; values[slot] = v; x[i] = 0.0f; }
        }
    }
}
"#,
    ),
    (
        "optimizers",
        r#"
// Fused optimizer updates on float32 tensors (src/optim): one launch per tensor does the
// whole update, with the arithmetic of torch.optim's single-tensor loops. Scalars that
// torch computes in double on the host (1 - beta, the bias corrections) arrive computed.
__device__ __forceinline__ float lerp_to(float a, float b, float w) {
    return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}
// Adds each thread's x into *out: a warp sum, then one atomic per warp. Every thread of
// the block must call it.
__device__ __forceinline__ void add_block(float x, float* out) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
    if ((threadIdx.x & 31) == 0 && x != 0.0f) atomicAdd(out, x);
}
// SGD; mom is null without momentum; keep = 1 - dampening; first: the momentum buffer
// starts as the gradient.
extern "C" __global__ void sgd(float* w, const float* g, float* mom, float lr, float momentum,
                               float keep, float weight_decay, int nesterov, int maximize,
                               int first, u64 n) {
    FOR_EACH(i, n) {
        float d = maximize ? -g[i] : g[i];
        if (weight_decay != 0.0f) d += weight_decay * w[i];
        if (mom) {
            float m = first ? d : momentum * mom[i] + keep * d;
            mom[i] = m;
            d = nesterov ? d + momentum * m : m;
        }
        w[i] -= lr * d;
    }
}
// Adam (decoupled = 0: weight decay added to the gradient) and AdamW (decoupled = 1: the
// weight shrinks by decay = 1 - lr * weight_decay first). step_size = lr / (1 - beta1^t),
// bias2_sqrt = sqrt(1 - beta2^t).
extern "C" __global__ void adam(float* w, const float* g, float* m, float* v, float beta1c,
                                float beta2, float beta2c, float eps, float weight_decay,
                                float decay, int decoupled, int maximize, float step_size,
                                float bias2_sqrt, u64 n) {
    FOR_EACH(i, n) {
        float gi = maximize ? -g[i] : g[i];
        float wi = w[i];
        if (weight_decay != 0.0f) {
            if (decoupled) wi *= decay;
            else gi += weight_decay * wi;
        }
        float mi = lerp_to(m[i], gi, beta1c);
        float vi = v[i] * beta2 + beta2c * gi * gi;
        m[i] = mi; v[i] = vi;
        w[i] = wi - step_size * (mi / (sqrtf(vi) / bias2_sqrt + eps));
    }
}
// LAMB, three kernels a step: sum_squares adds the squared norm of a gradient into *out
// (the global gradient norm); lamb_stage1 clips the gradient by that norm, updates the
// moments and adds the squared norms of the weight and of the update into norms[0..2];
// lamb_stage2 recomputes the update and applies it, scaled by the trust ratio when adapt.
__device__ __forceinline__ float lamb_update(float w, float m, float v, float bias1,
                                             float bias2, float eps, float wd, int adam_w) {
    float u = (m / bias1) / (sqrtf(v / bias2) + eps);
    return adam_w ? u + wd * w : u;
}
extern "C" __global__ void sum_squares(const float* x, float* out, u64 n) {
    float s = 0.0f;
    FOR_EACH(i, n) s += x[i] * x[i];
    add_block(s, out);
}
extern "C" __global__ void lamb_stage1(const float* w, const float* g, float* m, float* v,
                                       float* norms, const float* grad_sq,
                                       float max_grad_norm, float beta1, float beta3,
                                       float beta2, float beta2c, float eps, float wd,
                                       int adam_w, float bias1, float bias2, u64 n) {
    float clip = 1.0f;
    if (grad_sq && max_grad_norm > 0.0f) {
        float norm = sqrtf(*grad_sq);
        if (norm > max_grad_norm) clip = norm / max_grad_norm;
    }
    float ww = 0.0f, uu = 0.0f;
    FOR_EACH(i, n) {
        float wi = w[i];
        float gi = g[i] / clip;
        if (!adam_w) gi += wd * wi;
        float mi = m[i] * beta1 + beta3 * gi;
        float vi = v[i] * beta2 + beta2c * gi * gi;
        m[i] = mi; v[i] = vi;
        float u = lamb_update(wi, mi, vi, bias1, bias2, eps, wd, adam_w);
        ww += wi * wi; uu += u * u;
    }
    add_block(ww, &norms[0]);
    add_block(uu, &norms[1]);
}
extern "C" __global__ void lamb_stage2(float* w, const float* m, const float* v,
                                       const float* norms, float lr, int adapt, float eps,
                                       float wd, int adam_w, float bias1, float bias2, u64 n) {
    float ratio = lr;
    if (adapt) {
        float wn = sqrtf(norms[0]), un = sqrtf(norms[1]);
        if (wn > 0.0f && un > 0.0f) ratio = lr * (wn / un);
    }
    FOR_EACH(i, n) w[i] -= ratio * lamb_update(w[i], m[i], v[i], bias1, bias2, eps, wd, adam_w);
}
"#,
    ),
];

/// The full text NVRTC compiles for source `name`.
pub fn source(name: &str) -> Option<String> {
    SOURCES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, body)| format!("{PRELUDE}{body}"))
}

/// One compiled source.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The source's name.
    pub name: &'static str,
    /// The `extern "C"` kernels it defines.
    pub kernels: Vec<String>,
    /// The size of the PTX or CUBIN NVRTC produced, in bytes.
    pub bytes: usize,
}

/// The kernels a source defines (its `extern "C" __global__` functions).
fn kernel_names(body: &str) -> Vec<String> {
    body.split("__global__ void ")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
        .map(|s| s.trim().to_string())
        .collect()
}

/// Checks that cudarc's NVRTC is the one `probe` loaded (see [`check_bound`]); panics
/// as cudarc does where it finds none, so call it under `catch_unwind`.
fn nvrtc_bound() -> Result<()> {
    // SAFETY: cudarc's handle, loaded (or found loaded) by its own search.
    check_bound(CudaLib::Nvrtc, unsafe { cudarc::nvrtc::sys::culib() })
        .map_err(PerseusError::GpuUnavailable)
}

/// Compiles source `name` with NVRTC (found in `dirs` first, see [`probe`]) for
/// virtual architecture `arch` ("compute_75") and returns its PTX. A missing NVRTC is
/// a [`PerseusError::GpuUnavailable`] naming where it was looked for; a source that does
/// not compile is an error with NVRTC's log.
pub fn ptx(name: &str, arch: &'static str, dirs: &[PathBuf]) -> Result<String> {
    let nvrtc = probe(CudaLib::Nvrtc, dirs);
    let Some(loaded) = &nvrtc.loaded else {
        return Err(PerseusError::GpuUnavailable(nvrtc.missing_message()));
    };
    let src = source(name)
        .ok_or_else(|| PerseusError::InvalidArgument(format!("no kernel source {name}")))?;
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        name: Some(format!("{name}.cu")),
        ..Default::default()
    };
    // cudarc finds NVRTC by its SONAME, already loaded by `probe` above. It panics
    // where it cannot; keep any such panic from crossing into Python.
    let compiled = std::panic::catch_unwind(|| {
        nvrtc_bound()?;
        cudarc::nvrtc::compile_ptx_with_opts(&src, opts).map_err(|e| {
            PerseusError::InvalidArgument(format!("kernel source {name} does not compile: {e:?}"))
        })
    })
    .map_err(|_| {
        PerseusError::GpuUnavailable(format!(
            "NVRTC was loaded from {} but could not be used",
            loaded.path.display()
        ))
    })??;
    Ok(compiled.to_src())
}

/// Compiles source `name` with NVRTC into a CUBIN for the real architecture `sm_{sm}`
/// (90 for an H100). A device loads a CUBIN of its own architecture directly, whatever
/// driver it has, where PTX from a newer NVRTC than the driver would be refused. Errors
/// as for [`ptx`].
pub fn cubin(name: &str, sm: u32, dirs: &[PathBuf]) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result as nvrtc, sys};
    use std::ffi::CString;
    let lib = probe(CudaLib::Nvrtc, dirs);
    let Some(loaded) = &lib.loaded else {
        return Err(PerseusError::GpuUnavailable(lib.missing_message()));
    };
    let src = source(name)
        .ok_or_else(|| PerseusError::InvalidArgument(format!("no kernel source {name}")))?;
    let src = CString::new(src).expect("kernel sources hold no NUL");
    let file = CString::new(format!("{name}.cu")).expect("no NUL");
    let fail =
        |what: String| PerseusError::InvalidArgument(format!("kernel source {name}: {what}"));
    let run = || -> Result<Vec<u8>> {
        nvrtc_bound()?;
        let prog = nvrtc::create_program(&src, Some(&file)).map_err(|e| fail(format!("{e:?}")))?;
        // SAFETY: `prog` is live until destroyed below; the sizes NVRTC reports bound
        // the buffers it writes.
        unsafe {
            let compiled = nvrtc::compile_program(prog, &[format!("--gpu-architecture=sm_{sm}")]);
            let out = match compiled {
                Err(e) => {
                    let log = nvrtc::get_program_log(prog).unwrap_or_default();
                    let log: Vec<u8> = log.iter().map(|&c| c as u8).collect();
                    Err(fail(format!(
                        "{e:?}: {}",
                        String::from_utf8_lossy(&log).trim_end_matches('\0')
                    )))
                }
                Ok(()) => {
                    let mut size = 0usize;
                    sys::nvrtcGetCUBINSize(prog, &mut size)
                        .result()
                        .map_err(|e| fail(format!("{e:?}")))?;
                    let mut bin = vec![0u8; size];
                    sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr().cast())
                        .result()
                        .map_err(|e| fail(format!("{e:?}")))?;
                    Ok(bin)
                }
            };
            let _ = nvrtc::destroy_program(prog);
            out
        }
    };
    std::panic::catch_unwind(run).map_err(|_| {
        PerseusError::GpuUnavailable(format!(
            "NVRTC was loaded from {} but could not be used",
            loaded.path.display()
        ))
    })?
}

/// Compiles every source with NVRTC: to PTX for the oldest architecture CUDA 12 and 13
/// both support, or (`sm`) to CUBINs for one real architecture, as a device loads them.
/// Errors as for [`ptx`].
pub fn compile_all(dirs: &[PathBuf], sm: Option<u32>) -> Result<Vec<Compiled>> {
    let mut out = Vec::new();
    for (name, body) in SOURCES {
        let bytes = match sm {
            None => ptx(name, "compute_75", dirs)?.len(),
            Some(sm) => cubin(name, sm, dirs)?.len(),
        };
        out.push(Compiled {
            name,
            kernels: kernel_names(body),
            bytes,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_source_names_its_kernels() {
        let all: Vec<String> = SOURCES.iter().flat_map(|(_, b)| kernel_names(b)).collect();
        for k in [
            "f32_to_f16_scaled",
            "bf16_to_f32_scaled",
            "reduce_f32",
            "reduce_bf16",
            "scale_f16",
            "nonfinite_f32",
            "count_at_least",
            "select_at_least",
            "sgd",
            "adam",
            "sum_squares",
            "lamb_stage1",
            "lamb_stage2",
        ] {
            assert!(
                all.iter().any(|n| n == k),
                "kernel {k} missing from {all:?}"
            );
        }
        assert!(source("cast").unwrap().starts_with(PRELUDE));
        assert!(source("nothing").is_none());
    }
}

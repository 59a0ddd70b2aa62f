//! The device kernels, as CUDA C sources that NVRTC compiles at run time.
//!
//! The sources use no CUDA header (no toolkit needs to be installed): float16 conversions
//! are PTX `cvt` instructions, bfloat16 ones are bit operations. Each kernel takes the
//! element count and walks its range with a grid-stride loop. [`compile_all`] compiles
//! every source through NVRTC, which is what CI checks on machines without a GPU.

use std::path::PathBuf;

use crate::error::{PerseusError, Result};
use crate::gpu::nvrtc::{target_for, Nvrtc, Target};

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
    /// What it was compiled to (`sm_90`, or `compute_90` for PTX).
    pub target: String,
    /// The size of the PTX or CUBIN NVRTC produced, in bytes.
    pub bytes: usize,
}

/// The kernels a source defines (its `extern "C" __global__` functions).
pub(crate) fn kernel_names(body: &str) -> Vec<String> {
    body.split("__global__ void ")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
        .map(|s| s.trim().to_string())
        .collect()
}

/// The full text of source `name`, or an error naming it.
fn text(name: &str) -> Result<String> {
    source(name).ok_or_else(|| PerseusError::GpuUnavailable(format!("no kernel source {name}")))
}

/// Compiles source `name` with NVRTC (found in `dirs` first, see
/// [`crate::gpu::libs::probe`]) for virtual architecture `compute_{arch}` and returns its
/// PTX (without the terminating NUL). A missing NVRTC is a
/// [`PerseusError::GpuUnavailable`] naming where it was looked for; so is a source that
/// does not compile, with NVRTC's log.
pub fn ptx(name: &str, arch: u32, dirs: &[PathBuf]) -> Result<String> {
    let nvrtc = Nvrtc::get(dirs)?;
    let mut out = nvrtc.compile(name, &text(name)?, Target::Ptx(arch))?;
    while out.last() == Some(&0) {
        out.pop();
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// A source compiled for one device, as `cuModuleLoadData` takes it.
#[derive(Debug, Clone)]
pub struct Binary {
    /// What it is: a CUBIN of the device's architecture, or PTX the driver compiles.
    pub target: Target,
    /// The CUBIN, or the PTX with its terminating NUL.
    pub bytes: Vec<u8>,
}

/// Compiles source `name` with NVRTC for a device of architecture `sm_{sm}` (90 for an
/// H100): a CUBIN of that architecture, which the device loads directly whatever its
/// driver, where this NVRTC has it; else (a device newer than the NVRTC) PTX for the
/// newest architecture the NVRTC has below the device's, which the driver compiles
/// when loading it. Errors, all [`PerseusError::GpuUnavailable`]: NVRTC missing, no
/// architecture the device runs, a source that does not compile.
pub fn binary(name: &str, sm: u32, dirs: &[PathBuf]) -> Result<Binary> {
    let nvrtc = Nvrtc::get(dirs)?;
    let src = text(name)?;
    let supported = nvrtc.supported_archs()?;
    let target = target_for(sm, supported.as_deref()).ok_or_else(|| {
        let list: Vec<String> = supported
            .iter()
            .flatten()
            .map(|a| format!("sm_{a}"))
            .collect();
        PerseusError::GpuUnavailable(format!(
            "NVRTC {} ({}) compiles for {}, none of which a device of sm_{sm} runs \
             (CUDA 13 dropped the architectures before sm_75; an older NVRTC has them)",
            nvrtc.version,
            nvrtc.path.display(),
            list.join(", ")
        ))
    })?;
    let bytes = nvrtc.compile(name, &src, target)?;
    Ok(Binary { target, bytes })
}

/// Compiles every source with NVRTC: to PTX for the oldest architecture CUDA 12 and 13
/// both support, or (`sm`) as a device of that architecture loads them (see
/// [`binary`]). Errors as for [`binary`].
pub fn compile_all(dirs: &[PathBuf], sm: Option<u32>) -> Result<Vec<Compiled>> {
    let mut out = Vec::new();
    for (name, body) in SOURCES {
        let (target, bytes) = match sm {
            None => (Target::Ptx(75), ptx(name, 75, dirs)?.len()),
            Some(sm) => {
                let b = binary(name, sm, dirs)?;
                (b.target, b.bytes.len())
            }
        };
        out.push(Compiled {
            name,
            kernels: kernel_names(body),
            target: target.name(),
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

    /// NVRTC where the loader finds it (LD_LIBRARY_PATH, CUDA_HOME, ...), or None: the
    /// tests below then say so and pass (CI runs the same checks from Python, with the
    /// NVRTC of torch's nvidia wheels, in tests/python/test_gpu.py).
    fn nvrtc_here() -> Option<std::sync::Arc<Nvrtc>> {
        match Nvrtc::get(&[]) {
            Ok(n) => Some(n),
            Err(e) => {
                eprintln!("skipped: no NVRTC here ({e})");
                None
            }
        }
    }

    fn gpu_unavailable(r: Result<impl std::fmt::Debug>) -> String {
        match r {
            Err(PerseusError::GpuUnavailable(msg)) => msg,
            other => panic!("expected GpuUnavailable, got {other:?}"),
        }
    }

    #[test]
    fn a_source_that_does_not_compile_is_an_unusable_gpu_not_an_argument_error() {
        // No NVRTC needed: the name is checked first.
        let msg = gpu_unavailable(binary("nothing", 90, &[]).map(|b| b.bytes.len()));
        assert!(
            msg.contains("no kernel source nothing") || msg.contains("NVRTC"),
            "{msg}"
        );
        let Some(nvrtc) = nvrtc_here() else { return };
        let broken = "extern \"C\" __global__ void f(int* x) { x[0] = undeclared_here; }";
        let msg = gpu_unavailable(nvrtc.compile("broken", broken, Target::Ptx(75)));
        assert!(
            msg.contains("kernel source broken does not compile for compute_75"),
            "{msg}"
        );
        assert!(msg.contains("undeclared_here"), "NVRTC's log: {msg}");
    }

    #[test]
    fn a_device_newer_than_nvrtc_gets_ptx_and_one_older_than_it_an_error() {
        let Some(nvrtc) = nvrtc_here() else { return };
        let archs = nvrtc.supported_archs().unwrap().expect("NVRTC 12 or 13");
        assert!(archs.contains(&90), "{archs:?}");
        let own = binary("scale", 90, &[]).unwrap();
        assert_eq!(own.target, Target::Cubin(90));
        assert_eq!(&own.bytes[..4], b"\x7fELF", "a CUBIN is an ELF file");
        // sm_999: newer than any NVRTC knows, so PTX for the newest it has.
        let newest = *archs.last().unwrap();
        let ptx = binary("scale", 999, &[]).unwrap();
        assert_eq!(ptx.target, Target::Ptx(newest));
        assert_eq!(ptx.bytes.last(), Some(&0), "PTX ends with its NUL");
        let text = String::from_utf8_lossy(&ptx.bytes);
        assert!(text.contains(".entry scale_f32"), "{text}");
        // Older than every architecture NVRTC has: a clear error, not a panic.
        let msg = gpu_unavailable(binary("scale", 10, &[]).map(|b| b.bytes.len()));
        assert!(
            msg.contains("none of which a device of sm_10 runs"),
            "{msg}"
        );
        let all = compile_all(&[], Some(999)).unwrap();
        assert!(all.iter().all(|c| c.target == format!("compute_{newest}")));
    }
}

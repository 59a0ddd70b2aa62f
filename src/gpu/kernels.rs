//! The device kernels, as CUDA C sources that NVRTC compiles at run time.
//!
//! The sources use no CUDA header (no toolkit needs to be installed): float16 conversions
//! are PTX `cvt` instructions, bfloat16 ones are bit operations. Each kernel takes the
//! element count and walks its range with a grid-stride loop. [`compile_all`] compiles
//! every source through NVRTC, which is what CI checks on machines without a GPU.

use std::path::PathBuf;

use crate::error::{PerseusError, Result};
use crate::gpu::nvrtc::{target_for, Nvrtc, Target};

/// Helpers every source starts with: conversions, the grid-stride loop and the 16-byte
/// vectors the elementwise kernels move.
const PRELUDE: &str = r#"
typedef unsigned long long u64;
#define FOR_EACH(i, n) for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); \
                            i += (u64)blockDim.x * gridDim.x)
// The elementwise kernels load and store 16 bytes at a time (8 for the half side of a
// cast) where every pointer allows it, and the last elements, fewer than a vector, one
// at a time; a misaligned view (x[1:]) goes one at a time throughout. The arithmetic per
// element is the same either way.
#define ALIGNED(p, bytes) ((((u64)(p)) & ((bytes) - 1)) == 0)
struct alignas(16) F4 { float x, y, z, w; };
struct alignas(16) D2 { double x, y; };
struct alignas(16) U4 { unsigned int x, y, z, w; };
struct alignas(8) U2 { unsigned int x, y; };
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
// A 16-bit float (bf: bfloat16, else float16) in the low bits of h, to float32 and back.
__device__ __forceinline__ float half_in(unsigned int h, int bf) {
    return bf ? bf16_to_f32((unsigned short)h) : f16_to_f32((unsigned short)h);
}
__device__ __forceinline__ unsigned int half_out(float f, int bf) {
    return bf ? f32_to_bf16(f) : f32_to_f16(f);
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
__device__ __forceinline__ unsigned int down2(float a, float b, float scale, int bf) {
    return half_out(a * scale, bf) | (half_out(b * scale, bf) << 16);
}
__device__ __forceinline__ void down(const float* x, unsigned short* y, float scale, u64 n,
                                     int bf) {
    u64 head = 0;
    if (ALIGNED(x, 16) && ALIGNED(y, 8)) {
        FOR_EACH(v, n / 4) {
            F4 a = ((const F4*)x)[v];
            U2 h; h.x = down2(a.x, a.y, scale, bf); h.y = down2(a.z, a.w, scale, bf);
            ((U2*)y)[v] = h;
        }
        head = n / 4 * 4;
    }
    FOR_EACH(t, n - head) { u64 i = head + t; y[i] = half_out(x[i] * scale, bf); }
}
__device__ __forceinline__ void up(const unsigned short* x, float* y, float inv, u64 n, int bf) {
    u64 head = 0;
    if (ALIGNED(x, 8) && ALIGNED(y, 16)) {
        FOR_EACH(v, n / 4) {
            U2 h = ((const U2*)x)[v];
            F4 a;
            a.x = half_in(h.x & 0xffffu, bf) * inv; a.y = half_in(h.x >> 16, bf) * inv;
            a.z = half_in(h.y & 0xffffu, bf) * inv; a.w = half_in(h.y >> 16, bf) * inv;
            ((F4*)y)[v] = a;
        }
        head = n / 4 * 4;
    }
    FOR_EACH(t, n - head) { u64 i = head + t; y[i] = half_in(x[i], bf) * inv; }
}
extern "C" __global__ void f32_to_f16_scaled(const float* x, unsigned short* y, float scale, u64 n) {
    down(x, y, scale, n, 0);
}
extern "C" __global__ void f16_to_f32_scaled(const unsigned short* x, float* y, float inv, u64 n) {
    up(x, y, inv, n, 0);
}
extern "C" __global__ void f32_to_bf16_scaled(const float* x, unsigned short* y, float scale, u64 n) {
    down(x, y, scale, n, 1);
}
extern "C" __global__ void bf16_to_f32_scaled(const unsigned short* x, float* y, float inv, u64 n) {
    up(x, y, inv, n, 1);
}
"#,
    ),
    (
        "reduce",
        r#"
// dst = dst (op) src; op 0 sum, 1 min, 2 max, 3 product. Average is a sum then a scale.
__device__ __forceinline__ double combine64(double a, double b, int op) {
    return op == 0 ? a + b : op == 1 ? fmin(a, b) : op == 2 ? fmax(a, b) : a * b;
}
extern "C" __global__ void reduce_f32(float* dst, const float* src, int op, u64 n) {
    u64 head = 0;
    if (ALIGNED(dst, 16) && ALIGNED(src, 16)) {
        FOR_EACH(v, n / 4) {
            F4 a = ((F4*)dst)[v], b = ((const F4*)src)[v];
            a.x = combine(a.x, b.x, op); a.y = combine(a.y, b.y, op);
            a.z = combine(a.z, b.z, op); a.w = combine(a.w, b.w, op);
            ((F4*)dst)[v] = a;
        }
        head = n / 4 * 4;
    }
    FOR_EACH(t, n - head) { u64 i = head + t; dst[i] = combine(dst[i], src[i], op); }
}
extern "C" __global__ void reduce_f64(double* dst, const double* src, int op, u64 n) {
    u64 head = 0;
    if (ALIGNED(dst, 16) && ALIGNED(src, 16)) {
        FOR_EACH(v, n / 2) {
            D2 a = ((D2*)dst)[v], b = ((const D2*)src)[v];
            a.x = combine64(a.x, b.x, op); a.y = combine64(a.y, b.y, op);
            ((D2*)dst)[v] = a;
        }
        head = n / 2 * 2;
    }
    FOR_EACH(t, n - head) { u64 i = head + t; dst[i] = combine64(dst[i], src[i], op); }
}
// Two 16-bit floats in a word, combined in float32 and rounded once each.
__device__ __forceinline__ unsigned int combine2(unsigned int a, unsigned int b, int op, int bf) {
    return half_out(combine(half_in(a & 0xffffu, bf), half_in(b & 0xffffu, bf), op), bf)
         | (half_out(combine(half_in(a >> 16, bf), half_in(b >> 16, bf), op), bf) << 16);
}
__device__ __forceinline__ void reduce_halves(unsigned short* dst, const unsigned short* src,
                                              int op, u64 n, int bf) {
    u64 head = 0;
    if (ALIGNED(dst, 16) && ALIGNED(src, 16)) {
        FOR_EACH(v, n / 8) {
            U4 a = ((U4*)dst)[v], b = ((const U4*)src)[v];
            a.x = combine2(a.x, b.x, op, bf); a.y = combine2(a.y, b.y, op, bf);
            a.z = combine2(a.z, b.z, op, bf); a.w = combine2(a.w, b.w, op, bf);
            ((U4*)dst)[v] = a;
        }
        head = n / 8 * 8;
    }
    FOR_EACH(t, n - head) {
        u64 i = head + t;
        dst[i] = half_out(combine(half_in(dst[i], bf), half_in(src[i], bf), op), bf);
    }
}
extern "C" __global__ void reduce_f16(unsigned short* dst, const unsigned short* src, int op, u64 n) {
    reduce_halves(dst, src, op, n, 0);
}
extern "C" __global__ void reduce_bf16(unsigned short* dst, const unsigned short* src, int op, u64 n) {
    reduce_halves(dst, src, op, n, 1);
}
"#,
    ),
    (
        "scale",
        r#"
// Prescale and postscale (and the 1/n of Average).
extern "C" __global__ void scale_f32(float* x, float s, u64 n) {
    u64 head = 0;
    if (ALIGNED(x, 16)) {
        FOR_EACH(v, n / 4) {
            F4 a = ((F4*)x)[v];
            a.x *= s; a.y *= s; a.z *= s; a.w *= s;
            ((F4*)x)[v] = a;
        }
        head = n / 4 * 4;
    }
    FOR_EACH(t, n - head) x[head + t] *= s;
}
extern "C" __global__ void scale_f64(double* x, double s, u64 n) {
    u64 head = 0;
    if (ALIGNED(x, 16)) {
        FOR_EACH(v, n / 2) {
            D2 a = ((D2*)x)[v];
            a.x *= s; a.y *= s;
            ((D2*)x)[v] = a;
        }
        head = n / 2 * 2;
    }
    FOR_EACH(t, n - head) x[head + t] *= s;
}
__device__ __forceinline__ unsigned int scale2(unsigned int a, float s, int bf) {
    return half_out(half_in(a & 0xffffu, bf) * s, bf) | (half_out(half_in(a >> 16, bf) * s, bf) << 16);
}
__device__ __forceinline__ void scale_halves(unsigned short* x, float s, u64 n, int bf) {
    u64 head = 0;
    if (ALIGNED(x, 16)) {
        FOR_EACH(v, n / 8) {
            U4 a = ((U4*)x)[v];
            a.x = scale2(a.x, s, bf); a.y = scale2(a.y, s, bf);
            a.z = scale2(a.z, s, bf); a.w = scale2(a.w, s, bf);
            ((U4*)x)[v] = a;
        }
        head = n / 8 * 8;
    }
    FOR_EACH(t, n - head) { u64 i = head + t; x[i] = half_out(half_in(x[i], bf) * s, bf); }
}
extern "C" __global__ void scale_f16(unsigned short* x, float s, u64 n) { scale_halves(x, s, n, 0); }
extern "C" __global__ void scale_bf16(unsigned short* x, float s, u64 n) { scale_halves(x, s, n, 1); }
"#,
    ),
    (
        "nancheck",
        r#"
// PERSEUS_ALLREDUCE_NANCHECK: *flag becomes 1 when any element is NaN or infinite.
extern "C" __global__ void nonfinite_f32(const float* x, int* flag, u64 n) {
    u64 head = 0;
    if (ALIGNED(x, 16)) {
        FOR_EACH(v, n / 4) {
            F4 a = ((const F4*)x)[v];
            if (!isfinite(a.x) || !isfinite(a.y) || !isfinite(a.z) || !isfinite(a.w)) {
                atomicOr(flag, 1); return;
            }
        }
        head = n / 4 * 4;
    }
    FOR_EACH(t, n - head) if (!isfinite(x[head + t])) { atomicOr(flag, 1); return; }
}
// A float16 is NaN or infinite when its exponent bits are all set.
__device__ __forceinline__ bool nonfinite2(unsigned int w) {
    return (w & 0x7c00u) == 0x7c00u || (w & 0x7c000000u) == 0x7c000000u;
}
extern "C" __global__ void nonfinite_f16(const unsigned short* x, int* flag, u64 n) {
    u64 head = 0;
    if (ALIGNED(x, 16)) {
        FOR_EACH(v, n / 8) {
            U4 a = ((const U4*)x)[v];
            if (nonfinite2(a.x) || nonfinite2(a.y) || nonfinite2(a.z) || nonfinite2(a.w)) {
                atomicOr(flag, 1); return;
            }
        }
        head = n / 8 * 8;
    }
    FOR_EACH(t, n - head) if ((x[head + t] & 0x7c00u) == 0x7c00u) { atomicOr(flag, 1); return; }
}
"#,
    ),
    (
        "dgc",
        r#"
// Deep gradient compression. The top-k threshold is found by radix selection over the
// magnitudes' bit patterns (ordered as the magnitudes are; NaNs, above infinity's, are
// never counted): each pass histograms one digit of the patterns that share the digits
// chosen so far. Then the elements at or above it are gathered (index, value) and
// cleared from the residual.
#define RADIX_MAX_BINS 2048
extern "C" __global__ void radix_histogram(const float* x, unsigned int* hist,
                                           unsigned int shift, unsigned int bits,
                                           unsigned int prefix, u64 n) {
    __shared__ unsigned int local[RADIX_MAX_BINS];
    unsigned int bins = 1u << bits, high = shift + bits;
    for (unsigned int b = threadIdx.x; b < bins; b += blockDim.x) local[b] = 0;
    __syncthreads();
    FOR_EACH(i, n) {
        unsigned int key = __float_as_uint(x[i]) & 0x7fffffffu;
        if (key <= 0x7f800000u && (high >= 32 || (key >> high) == (prefix >> high)))
            atomicAdd(&local[(key >> shift) & (bins - 1)], 1u);
    }
    __syncthreads();
    for (unsigned int b = threadIdx.x; b < bins; b += blockDim.x)
        if (local[b]) atomicAdd(&hist[b], local[b]);
}
// One atomic per warp and round: the lanes taking an element share a run of slots.
extern "C" __global__ void select_at_least(float* x, float threshold, unsigned int* indices,
                                           float* values, u64* taken, u64 capacity, u64 n) {
    unsigned int lane = threadIdx.x & 31;
    FOR_EACH(i, n) {
        float v = x[i];
        bool take = fabsf(v) >= threshold;
        unsigned int active = __activemask();
        unsigned int want = __ballot_sync(active, take);
        if (want) {
            unsigned int leader = __ffs(want) - 1;
            u64 base = 0;
            if (lane == leader) base = atomicAdd(taken, (u64)__popc(want));
            base = __shfl_sync(active, base, leader);
            if (take) {
                u64 slot = base + __popc(want & ((1u << lane) - 1u));
                if (slot < capacity) { indices[slot] = (unsigned int)i; values[slot] = v; x[i] = 0.0f; }
            }
        }
    }
}
"#,
    ),
    (
        "optimizers",
        r#"
// Fused optimizer updates on float32 tensors (src/optim), with the arithmetic of
// torch.optim's single-tensor loops. One launch per kernel and step covers every
// parameter: argument i of the table describes parameter i, and block b works on chunk
// (map[b] & 0xffffffff) of parameter (map[b] >> 32), CHUNK elements. Scalars that torch
// computes in double on the host (1 - beta, the bias corrections) arrive computed. The
// argument structs match src/gpu/optim.rs's, field for field.
#define CHUNK 4096
#define CHUNK_OF(a, table, map)                                                         \
    u64 m_ = map[blockIdx.x];                                                          \
    a = table[m_ >> 32];                                                               \
    u64 start_ = (m_ & 0xffffffffull) * CHUNK;                                         \
    u64 end_ = start_ + CHUNK < a.n ? start_ + CHUNK : a.n;
#define FOR_CHUNK(i) for (u64 i = start_ + threadIdx.x; i < end_; i += blockDim.x)
__device__ __forceinline__ float lerp_to(float a, float b, float w) {
    return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}
// The sum of every thread's x, in thread 0 (the others get 0), in an order fixed by the
// block's shape: a warp sum, then the warps' sums in turn. No atomics, so every rank
// computes the same bits from the same values. Every thread of the block must call it.
__device__ __forceinline__ float block_sum(float x) {
    __shared__ float warps[32];
    for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
    if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = x;
    __syncthreads();
    float total = 0.0f;
    if (threadIdx.x == 0)
        for (unsigned int w = 0; w < (blockDim.x + 31) / 32; w++) total += warps[w];
    __syncthreads();
    return total;
}
// out[j * width + c] = the sum over blocks b in [seg[j], seg[j + 1]) of
// partials[b * width + c]: the per-block sums of a multi-tensor launch gathered per
// parameter (or, with one segment, over all), one block per segment, in a fixed order.
extern "C" __global__ void sum_segments(const float* partials, const unsigned int* seg,
                                        int width, float* out) {
    unsigned int j = blockIdx.x;
    for (int c = 0; c < width; c++) {
        float s = 0.0f;
        for (unsigned int b = seg[j] + threadIdx.x; b < seg[j + 1]; b += blockDim.x)
            s += partials[(u64)b * width + c];
        s = block_sum(s);
        if (threadIdx.x == 0) out[(u64)j * width + c] = s;
    }
}
// SGD; mom is null without momentum; keep = 1 - dampening; first: the momentum buffer
// starts as the gradient.
struct SgdArgs {
    float* w; const float* g; float* mom; u64 n;
    float lr, momentum, keep, weight_decay;
    int nesterov, maximize, first, pad;
};
static_assert(sizeof(SgdArgs) == 64, "SgdArgs: src/gpu/optim.rs has 64 bytes");
extern "C" __global__ void sgd(const SgdArgs* table, const u64* map) {
    SgdArgs a;
    CHUNK_OF(a, table, map);
    FOR_CHUNK(i) {
        float d = a.maximize ? -a.g[i] : a.g[i];
        if (a.weight_decay != 0.0f) d += a.weight_decay * a.w[i];
        if (a.mom) {
            float m = a.first ? d : a.momentum * a.mom[i] + a.keep * d;
            a.mom[i] = m;
            d = a.nesterov ? d + a.momentum * m : m;
        }
        a.w[i] -= a.lr * d;
    }
}
// Adam (decoupled = 0: weight decay added to the gradient) and AdamW (decoupled = 1: the
// weight shrinks by decay = 1 - lr * weight_decay first). step_size = lr / (1 - beta1^t),
// bias2_sqrt = sqrt(1 - beta2^t).
struct AdamArgs {
    float* w; const float* g; float* m; float* v; u64 n;
    float beta1c, beta2, beta2c, eps, weight_decay, decay, step_size, bias2_sqrt;
    int decoupled, maximize;
};
static_assert(sizeof(AdamArgs) == 80, "AdamArgs: src/gpu/optim.rs has 80 bytes");
extern "C" __global__ void adam(const AdamArgs* table, const u64* map) {
    AdamArgs a;
    CHUNK_OF(a, table, map);
    FOR_CHUNK(i) {
        float gi = a.maximize ? -a.g[i] : a.g[i];
        float wi = a.w[i];
        if (a.weight_decay != 0.0f) {
            if (a.decoupled) wi *= a.decay;
            else gi += a.weight_decay * wi;
        }
        float mi = lerp_to(a.m[i], gi, a.beta1c);
        float vi = a.v[i] * a.beta2 + a.beta2c * gi * gi;
        a.m[i] = mi; a.v[i] = vi;
        a.w[i] = wi - a.step_size * (mi / (sqrtf(vi) / a.bias2_sqrt + a.eps));
    }
}
// LAMB: sum_squares writes each block's part of the squared gradient norm to
// partials[b] (sum_segments then adds them all: the global gradient norm, norms[0]);
// lamb_stage1 clips the gradient by that norm, updates the moments and writes each
// block's part of the squared norms of the weight and of the update to partials[2b..2b+2]
// (sum_segments then adds them per parameter: its pair in norms); lamb_stage2
// recomputes the update and applies it, scaled by the trust ratio when adapt.
__device__ __forceinline__ float lamb_update(float w, float m, float v, float bias1,
                                             float bias2, float eps, float wd, int adam_w) {
    float u = (m / bias1) / (sqrtf(v / bias2) + eps);
    return adam_w ? u + wd * w : u;
}
struct SumSquaresArgs { const float* x; u64 n; };
static_assert(sizeof(SumSquaresArgs) == 16, "SumSquaresArgs: src/gpu/optim.rs has 16 bytes");
extern "C" __global__ void sum_squares(const SumSquaresArgs* table, const u64* map,
                                       float* partials) {
    SumSquaresArgs a;
    CHUNK_OF(a, table, map);
    float s = 0.0f;
    FOR_CHUNK(i) s += a.x[i] * a.x[i];
    s = block_sum(s);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}
struct Lamb1Args {
    const float* w; const float* g; float* m; float* v; const float* grad_sq;
    u64 n;
    float max_grad_norm, beta1, beta3, beta2, beta2c, eps, wd, bias1, bias2;
    int adam_w;
};
static_assert(sizeof(Lamb1Args) == 88, "Lamb1Args: src/gpu/optim.rs has 88 bytes");
extern "C" __global__ void lamb_stage1(const Lamb1Args* table, const u64* map,
                                       float* partials) {
    Lamb1Args a;
    CHUNK_OF(a, table, map);
    float ww = 0.0f, uu = 0.0f, clip = 1.0f;
    if (a.grad_sq && a.max_grad_norm > 0.0f) {
        float norm = sqrtf(*a.grad_sq);
        if (norm > a.max_grad_norm) clip = norm / a.max_grad_norm;
    }
    FOR_CHUNK(i) {
        float wi = a.w[i];
        float gi = a.g[i] / clip;
        if (!a.adam_w) gi += a.wd * wi;
        float mi = a.m[i] * a.beta1 + a.beta3 * gi;
        float vi = a.v[i] * a.beta2 + a.beta2c * gi * gi;
        a.m[i] = mi; a.v[i] = vi;
        float u = lamb_update(wi, mi, vi, a.bias1, a.bias2, a.eps, a.wd, a.adam_w);
        ww += wi * wi; uu += u * u;
    }
    ww = block_sum(ww);
    uu = block_sum(uu);
    if (threadIdx.x == 0) { partials[2 * (u64)blockIdx.x] = ww; partials[2 * (u64)blockIdx.x + 1] = uu; }
}
struct Lamb2Args {
    float* w; const float* m; const float* v; const float* norms; u64 n;
    float lr, eps, wd, bias1, bias2;
    int adapt, adam_w, pad;
};
static_assert(sizeof(Lamb2Args) == 72, "Lamb2Args: src/gpu/optim.rs has 72 bytes");
extern "C" __global__ void lamb_stage2(const Lamb2Args* table, const u64* map) {
    Lamb2Args a;
    CHUNK_OF(a, table, map);
    float ratio = a.lr;
    if (a.adapt) {
        float wn = sqrtf(a.norms[0]), un = sqrtf(a.norms[1]);
        if (wn > 0.0f && un > 0.0f) ratio = a.lr * (wn / un);
    }
    FOR_CHUNK(i) {
        a.w[i] -= ratio * lamb_update(a.w[i], a.m[i], a.v[i], a.bias1, a.bias2, a.eps, a.wd,
                                      a.adam_w);
    }
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
            "radix_histogram",
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

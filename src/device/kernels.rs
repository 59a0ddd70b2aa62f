//! The device kernels one at a time, on the caller's CUDA tensors: the casts with the
//! gradient scale, the reductions, the scale, the finiteness check and DGC's top-k
//! selection. The collectives run them inside their own steps; this entry point lets the
//! GPU tests compare each with torch's own operations and the kernel benchmark time
//! them (`perseus.torch.kernels`, `benchmarks/kernels.py`).
//!
//! The arguments are checked here, in every build, before any device is touched; the
//! launches are the installed [`super::Backend`]'s.

use super::tensor::{Device, TensorView};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{PerseusError, Result};

/// One kernel call.
pub enum Call {
    /// `dst = src * factor`, cast: float32 to float16 or bfloat16, or back.
    Cast {
        /// The values read.
        src: TensorView,
        /// The values written, as many.
        dst: TensorView,
        /// The factor applied in float32 (before a cast down, after a cast up).
        factor: f32,
    },
    /// `dst = dst (op) src`, elementwise (float32, float64, float16, bfloat16).
    Reduce {
        /// Read and written.
        dst: TensorView,
        /// Read.
        src: TensorView,
        /// Sum, Min, Max or Product.
        op: ReduceOp,
    },
    /// `x *= factor`, in place.
    Scale {
        /// Read and written.
        x: TensorView,
        /// The factor (float32 arithmetic but for float64 tensors).
        factor: f64,
    },
    /// Whether any element is NaN or infinite (float32, float16).
    Nonfinite {
        /// Read.
        x: TensorView,
    },
    /// DGC's selection: the `k` float32 elements of largest magnitude are gathered
    /// (`indices` int32, `values` float32, as many slots each) and cleared in `x`, the
    /// residual; ties at the threshold are taken too, as long as there are slots.
    TopK {
        /// The residual: read, and the elements taken set to zero.
        x: TensorView,
        /// How many to take.
        k: usize,
        /// Receives the indices taken.
        indices: TensorView,
        /// Receives their values.
        values: TensorView,
    },
}

/// What a call returns.
#[derive(Debug, PartialEq)]
pub enum Answer {
    /// Queued on Perseus's stream of the device.
    Queued,
    /// The finiteness check's answer: true when some element is NaN or infinite.
    Nonfinite(bool),
    /// The top-k selection: how many slots were filled, and the magnitude threshold.
    TopK {
        /// Slots filled: `k`, more on ties (up to the slots), fewer when `x` holds NaNs.
        taken: usize,
        /// The least magnitude taken.
        threshold: f32,
    },
}

/// The device every named tensor is on: one CUDA device, or an error naming the first
/// that is not.
fn one_device(what: &str, tensors: &[(&str, &TensorView)]) -> Result<i32> {
    let mut ordinal = None;
    for (name, t) in tensors {
        match (t.device, ordinal) {
            (Device::Cpu, _) => {
                return Err(PerseusError::InvalidArgument(format!(
                    "{what}: {name} is in host memory; the device kernels take CUDA tensors"
                )))
            }
            (Device::Cuda(o), None) => ordinal = Some(o),
            (Device::Cuda(o), Some(first)) if o != first => {
                return Err(PerseusError::InvalidArgument(format!(
                    "{what}: {name} is on cuda:{o}, the others on cuda:{first}"
                )))
            }
            _ => {}
        }
    }
    Ok(ordinal.expect("every call names a tensor"))
}

fn dtype_error(what: &str, name: &str, t: &TensorView, want: &str) -> PerseusError {
    PerseusError::InvalidArgument(format!("{what}: {name} is {}; {want}", t.dtype.name()))
}

fn same_length(what: &str, a: (&str, &TensorView), b: (&str, &TensorView)) -> Result<()> {
    if a.1.elements() != b.1.elements() {
        return Err(PerseusError::InvalidArgument(format!(
            "{what}: {} has {} elements, {} {}",
            a.0,
            a.1.elements(),
            b.0,
            b.1.elements()
        )));
    }
    Ok(())
}

const FLOATS: &str = "it takes float32, float64, float16 or bfloat16";

/// Checks a call's arguments (types and lengths first, then the device, so that a
/// type error is named the same way with or without a GPU); returns the device it runs
/// on.
pub fn check(call: &Call) -> Result<i32> {
    match call {
        Call::Cast { src, dst, .. } => {
            let what = "cast";
            use DataType::*;
            match (src.dtype, dst.dtype) {
                (F32, F16 | BF16) | (F16 | BF16, F32) => {}
                _ => {
                    return Err(PerseusError::InvalidArgument(format!(
                        "cast: {} to {}; it casts float32 to float16 or bfloat16, or back",
                        src.dtype.name(),
                        dst.dtype.name()
                    )))
                }
            }
            same_length(what, ("src", src), ("dst", dst))?;
            one_device(what, &[("src", src), ("dst", dst)])
        }
        Call::Reduce { dst, src, op } => {
            let what = "reduce";
            if !matches!(
                dst.dtype,
                DataType::F32 | DataType::F64 | DataType::F16 | DataType::BF16
            ) {
                return Err(dtype_error(what, "dst", dst, FLOATS));
            }
            if src.dtype != dst.dtype {
                return Err(dtype_error(what, "src", src, "it must be dst's type"));
            }
            if !matches!(
                op,
                ReduceOp::Sum | ReduceOp::Min | ReduceOp::Max | ReduceOp::Product
            ) {
                return Err(PerseusError::InvalidArgument(format!(
                    "reduce: {} is no elementwise reduction; there are sum, min, max and product",
                    op.name()
                )));
            }
            same_length(what, ("dst", dst), ("src", src))?;
            one_device(what, &[("dst", dst), ("src", src)])
        }
        Call::Scale { x, .. } => {
            if !matches!(
                x.dtype,
                DataType::F32 | DataType::F64 | DataType::F16 | DataType::BF16
            ) {
                return Err(dtype_error("scale", "x", x, FLOATS));
            }
            one_device("scale", &[("x", x)])
        }
        Call::Nonfinite { x } => {
            if !matches!(x.dtype, DataType::F32 | DataType::F16) {
                return Err(dtype_error(
                    "nonfinite",
                    "x",
                    x,
                    "it takes float32 or float16",
                ));
            }
            one_device("nonfinite", &[("x", x)])
        }
        Call::TopK {
            x,
            k,
            indices,
            values,
        } => {
            let what = "top_k";
            if x.dtype != DataType::F32 {
                return Err(dtype_error(what, "x", x, "it takes float32"));
            }
            if indices.dtype != DataType::I32 {
                return Err(dtype_error(what, "indices", indices, "they are int32"));
            }
            if values.dtype != DataType::F32 {
                return Err(dtype_error(what, "values", values, "they are float32"));
            }
            same_length(what, ("indices", indices), ("values", values))?;
            if x.elements() > u32::MAX as usize {
                return Err(PerseusError::InvalidArgument(format!(
                    "top_k: x has {} elements; indices are 32-bit",
                    x.elements()
                )));
            }
            if *k > indices.elements() {
                return Err(PerseusError::InvalidArgument(format!(
                    "top_k: k is {k}, but indices and values have room for {}",
                    indices.elements()
                )));
            }
            one_device(what, &[("x", x), ("indices", indices), ("values", values)])
        }
    }
}

/// Checks `call` and runs it on its device.
pub fn run(call: Call) -> Result<Answer> {
    let ordinal = check(&call)?;
    super::backend(Device::Cuda(ordinal))?.kernel(ordinal, call)
}

/// The digits of a radix selection over the non-negative floats' 31-bit patterns, most
/// significant first, as `(shift, bits)`: 11, 11 and 9 bits, so a histogram has 2048
/// bins at most.
pub const RADIX_DIGITS: [(u32, u32); 3] = [(20, 11), (9, 11), (0, 9)];

/// The magnitude threshold of a top-`k` selection: the `k`-th largest magnitude, found
/// by radix selection over the magnitudes' bit patterns (ordered as the non-negative
/// floats are). `hist(shift, bits, prefix)` counts, for each value of the digit
/// `(pattern >> shift) & (2^bits - 1)`, the non-NaN magnitudes whose pattern agrees
/// with `prefix` above that digit; three such passes ([`RADIX_DIGITS`]) settle the
/// threshold exactly. When fewer than `k` magnitudes are not NaN (no threshold takes a
/// NaN), the answer is 0; for `k` = 0 it is infinity.
pub fn threshold(k: usize, mut hist: impl FnMut(u32, u32, u32) -> Result<Vec<u64>>) -> Result<f32> {
    if k == 0 {
        return Ok(f32::INFINITY);
    }
    let (mut prefix, mut need) = (0u32, k as u64);
    for (shift, bits) in RADIX_DIGITS {
        let counts = hist(shift, bits, prefix)?;
        // The largest digit at or above which `need` patterns remain.
        let mut digit = None;
        for (d, &c) in counts.iter().enumerate().rev() {
            if c >= need {
                digit = Some(d as u32);
                break;
            }
            need -= c;
        }
        match digit {
            Some(d) => prefix |= d << shift,
            // Only on the first pass: fewer than k values that are not NaN.
            None => return Ok(0.0),
        }
    }
    Ok(f32::from_bits(prefix))
}

/// [`threshold`]'s histogram on the host: what the `radix_histogram` kernel computes.
pub fn radix_histogram(values: &[f32], shift: u32, bits: u32, prefix: u32) -> Vec<u64> {
    let mut counts = vec![0u64; 1 << bits];
    let high = shift + bits;
    for v in values {
        let key = v.to_bits() & 0x7fff_ffff;
        if key <= f32::INFINITY.to_bits() && (high >= 32 || key >> high == prefix >> high) {
            counts[((key >> shift) & ((1 << bits) - 1)) as usize] += 1;
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(device: Device, dtype: DataType, n: usize) -> TensorView {
        TensorView {
            ptr: std::ptr::null_mut(),
            nbytes: n * dtype.size(),
            dtype,
            shape: vec![],
            device,
        }
    }

    const GPU: Device = Device::Cuda(0);

    fn err(call: Call) -> String {
        check(&call).unwrap_err().to_string()
    }

    #[test]
    fn arguments_are_checked_naming_the_one_at_fault() {
        let f32s = |n| on(GPU, DataType::F32, n);
        let cast = |src, dst| Call::Cast {
            src,
            dst,
            factor: 1.0,
        };
        assert_eq!(
            check(&cast(
                on(Device::Cuda(3), DataType::F32, 4),
                on(Device::Cuda(3), DataType::BF16, 4)
            ))
            .unwrap(),
            3
        );
        let e = err(cast(
            on(Device::Cpu, DataType::F32, 4),
            on(GPU, DataType::F16, 4),
        ));
        assert!(e.contains("src is in host memory"), "{e}");
        let e = err(cast(f32s(4), on(Device::Cuda(1), DataType::F16, 4)));
        assert!(e.contains("dst is on cuda:1, the others on cuda:0"), "{e}");
        let e = err(cast(f32s(4), f32s(4)));
        assert!(e.contains("float32 to float32"), "{e}");
        let e = err(cast(f32s(4), on(GPU, DataType::F16, 5)));
        assert!(e.contains("src has 4 elements, dst 5"), "{e}");
        let reduce = |dst, src, op| Call::Reduce { dst, src, op };
        let e = err(reduce(f32s(4), on(GPU, DataType::F64, 4), ReduceOp::Sum));
        assert!(e.contains("src is float64; it must be dst's type"), "{e}");
        let e = err(reduce(f32s(4), f32s(4), ReduceOp::Average));
        assert!(e.contains("no elementwise reduction"), "{e}");
        let ints = on(GPU, DataType::I32, 4);
        let e = err(reduce(ints.clone(), ints.clone(), ReduceOp::Sum));
        assert!(e.contains("dst is int32"), "{e}");
        let e = err(Call::Nonfinite {
            x: on(GPU, DataType::F64, 4),
        });
        assert!(e.contains("float32 or float16"), "{e}");
        let top = |k, slots| Call::TopK {
            x: f32s(10),
            k,
            indices: on(GPU, DataType::I32, slots),
            values: f32s(slots),
        };
        assert_eq!(check(&top(3, 3)).unwrap(), 0);
        let e = err(top(4, 3));
        assert!(
            e.contains("k is 4, but indices and values have room for 3"),
            "{e}"
        );
        let e = err(Call::TopK {
            x: f32s(10),
            k: 1,
            indices: f32s(2),
            values: f32s(2),
        });
        assert!(e.contains("indices is float32; they are int32"), "{e}");
    }

    #[test]
    #[cfg(not(feature = "cuda"))]
    fn without_the_gpu_build_a_checked_call_says_so() {
        let x = on(GPU, DataType::F32, 4);
        let e = run(Call::Scale { x, factor: 2.0 }).unwrap_err().to_string();
        assert!(
            e.contains("cuda:0: this build of Perseus has no GPU support"),
            "{e}"
        );
    }

    /// The threshold of `values` by [`threshold`], with the histograms the kernel
    /// computes, and how many passes it took.
    fn threshold_of(values: &[f32], k: usize) -> (f32, usize) {
        let mut passes = 0;
        let t = threshold(k, |shift, bits, prefix| {
            passes += 1;
            Ok(radix_histogram(values, shift, bits, prefix))
        })
        .unwrap();
        (t, passes)
    }

    #[test]
    fn the_threshold_is_the_kth_largest_magnitude_exactly() {
        // Distinct magnitudes of every scale, both signs.
        let values: Vec<f32> = (0..1000)
            .map(|i| {
                let m = ((i * 7919) % 1000) as f32 * 1.37e-3 + 1e-30;
                if i % 3 == 0 {
                    -m * 1e6
                } else {
                    m
                }
            })
            .collect();
        let mut mags: Vec<f32> = values.iter().map(|v| v.abs()).collect();
        mags.sort_by(|a, b| b.total_cmp(a));
        for k in [1, 2, 10, 999, 1000] {
            let (t, passes) = threshold_of(&values, k);
            assert_eq!(t, mags[k - 1], "k = {k}");
            assert_eq!(passes, 3);
        }
        // Ties: every value at the threshold counts.
        let (t, _) = threshold_of(&[1.0, -2.0, 2.0, 2.0, 0.5], 2);
        assert_eq!(t, 2.0);
        // Infinities are magnitudes like any other; NaNs are never taken.
        let (t, _) = threshold_of(&[f32::NEG_INFINITY, 3.0, f32::NAN], 1);
        assert_eq!(t, f32::INFINITY);
        let (t, _) = threshold_of(&[f32::NAN, 3.0, f32::NAN], 2);
        assert_eq!(t, 0.0);
        // k = 0: infinity (the device call takes nothing without asking).
        let (t, _) = threshold_of(&[1.0, 2.0], 0);
        assert_eq!(t, f32::INFINITY);
    }

    #[test]
    fn the_threshold_matches_a_sort_whichever_digit_the_values_differ_in() {
        // Patterns of every size (random bits), neighbours a few ulps apart (they differ
        // in the last digit only), denormals, zeros of both signs, repeats and NaNs.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut values: Vec<f32> = (0..2000)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let bits = (seed >> 32) as u32;
                f32::from_bits((bits & 0x7fff_ffff).min(0x7f80_0000) | (bits & 0x8000_0000))
            })
            .collect();
        for ulps in 0..40u32 {
            values.push(f32::from_bits(1.0f32.to_bits() + ulps % 13));
            values.push(-f32::from_bits(ulps * 3)); // denormals and -0.0
        }
        values.extend([0.0, -0.0, f32::NAN, -f32::NAN, 7.5, 7.5, -7.5]);
        let mut mags: Vec<f32> = values
            .iter()
            .filter(|v| !v.is_nan())
            .map(|v| v.abs())
            .collect();
        mags.sort_by(|a, b| b.total_cmp(a));
        for k in (1..=mags.len()).step_by(7).chain([mags.len()]) {
            assert_eq!(
                threshold_of(&values, k).0.to_bits(),
                mags[k - 1].to_bits(),
                "k = {k}"
            );
        }
        assert_eq!(
            threshold_of(&values, mags.len() + 1).0,
            0.0,
            "more than the non-NaNs"
        );
    }
}

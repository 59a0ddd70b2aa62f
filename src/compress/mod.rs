//! Float16 on the wire (`PERSEUS_ALLREDUCE_DTYPE`, seed 002): a float32 gradient
//! allreduce whose values travel as float16, on every link or only between hosts (the
//! mixed mode). Values are multiplied by the gradient scale on their way into float16
//! and divided by it on their way out, so that small gradients keep their precision.
//! A float16 sum that is not finite (an overflow) is never handed to the framework:
//! every rank saw the same sums, so every rank redoes the allreduce exactly from the
//! inputs, and the caller learns which tensors overflowed and whether their exact sums
//! are finite (if so, the scale was to blame).
//!
//! This module decides when float16 applies ([`wire`]) and runs the encode, check
//! and resend sequence ([`allreduce`]) for every executor: the host one, the
//! host-staged device one and the device-direct one differ only in how they cast and
//! reduce, which each gives as a [`HalfReduce`].

use std::ops::Range;

use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::kernels::first_nonfinite;
use crate::plan::Encoding;

/// How an allreduce's values travel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Wire {
    /// As they are.
    Exact,
    /// As float16 on every link, times `scale` (the gradient scale) in float16.
    Half {
        /// The gradient scale.
        scale: f64,
    },
    /// As float16 between hosts only, times `scale` there; float32 within a host.
    HalfBetweenHosts {
        /// The gradient scale.
        scale: f64,
    },
}

impl Wire {
    /// The factor inputs are multiplied by on their way into float16, after `pre`.
    pub fn down(&self, pre: f64) -> f64 {
        pre * self.scale()
    }

    /// The factor float16 sums are multiplied by on their way out, with `post`.
    pub fn up(&self, post: f64) -> f64 {
        post / self.scale()
    }

    fn scale(&self) -> f64 {
        match self {
            Wire::Exact => 1.0,
            Wire::Half { scale } | Wire::HalfBetweenHosts { scale } => *scale,
        }
    }
}

/// How an allreduce of `dtype` with `op` travels under the plan's `encoding` and
/// gradient `scale`, among `ranks` ranks on `hosts()` hosts: float16 only for a
/// float32 Sum or Average, and only where a link would carry it.
pub fn wire(
    dtype: DataType,
    op: ReduceOp,
    encoding: Encoding,
    scale: f64,
    ranks: usize,
    hosts: impl FnOnce() -> usize,
) -> Wire {
    if dtype != DataType::F32 || !matches!(op, ReduceOp::Sum | ReduceOp::Average) {
        return Wire::Exact;
    }
    match encoding {
        Encoding::Half if ranks > 1 => Wire::Half { scale },
        Encoding::HalfBetweenHosts if hosts() > 1 => Wire::HalfBetweenHosts { scale },
        _ => Wire::Exact,
    }
}

/// A float16 allreduce that overflowed and was resent exactly.
#[derive(Debug, Clone, PartialEq)]
pub struct Resent {
    /// The positions of the tensors whose float16 sums were not finite.
    pub bad: Vec<usize>,
    /// Whether their exact sums are finite (then the gradient scale was to blame).
    pub finite: bool,
}

/// What an executor does its own way in a float16 allreduce.
pub trait HalfReduce {
    /// Casts the inputs into float16 (times [`Wire::down`]), reduces, and casts the sums
    /// back into the outputs (times [`Wire::up`]) unless one is not finite. Returns the
    /// positions of the tensors whose float16 sums are not finite; then no output was
    /// written, and the inputs are intact.
    fn half(&mut self, wire: Wire) -> Result<Vec<usize>>;
    /// The exact allreduce, from the inputs. Returns whether the outputs of the
    /// tensors at `check` are all finite.
    fn exact(&mut self, check: &[usize]) -> Result<bool>;
}

/// Runs one allreduce as `wire` says, resending exactly where a float16 sum is not
/// finite.
pub fn allreduce(r: &mut dyn HalfReduce, wire: Wire) -> Result<Option<Resent>> {
    if wire == Wire::Exact {
        r.exact(&[])?;
        return Ok(None);
    }
    let bad = r.half(wire)?;
    if bad.is_empty() {
        return Ok(None);
    }
    // Every rank saw the same float16 sums, so every rank resends.
    let finite = r.exact(&bad)?;
    Ok(Some(Resent { bad, finite }))
}

/// The positions of the parts of `image` (values of `dtype`, `parts` as byte ranges)
/// holding a value that is not finite: one pass over the whole, then one per part only
/// when the whole has one.
pub fn nonfinite_parts(
    image: &[u8],
    dtype: DataType,
    parts: impl IntoIterator<Item = Range<usize>>,
) -> Vec<usize> {
    if first_nonfinite(image, dtype).is_none() {
        return Vec::new();
    }
    parts
        .into_iter()
        .enumerate()
        .filter(|(_, r)| first_nonfinite(&image[r.clone()], dtype).is_some())
        .map(|(i, _)| i)
        .collect()
}

#[cfg(test)]
mod tests;

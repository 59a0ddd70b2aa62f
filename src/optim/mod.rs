//! Fused optimizer updates (seed 001's fused optimizer and LAMB): one pass over each
//! parameter reads its gradient and optimizer state and writes the new weight and state,
//! where a framework's optimizer makes several passes, each a kernel launch or a loop
//! over memory. SGD (momentum, dampening, Nesterov), Adam and AdamW, and LAMB, on
//! float32 tensors in host memory ([`host`], spread over the cores) or on one CUDA
//! device (`gpu::optim`, the `optimizers` kernels).
//!
//! The arithmetic follows torch.optim's single-tensor loops, scalar for scalar (the
//! scalars torch computes in double precision on the host are computed the same way
//! here), so a fused step lands within float rounding of torch's. LAMB is the fused
//! LAMB that seed 001 describes: the gradients are clipped by their global norm, and each
//! parameter's update is scaled by its trust ratio `|w| / |update|` (with `always_adapt`
//! off, only where weight decay is on, as apex's FusedLAMB does).

pub mod host;
#[cfg(test)]
mod tests;

pub use crate::device::optim::{Adam, Group, Lamb, Rule, Sgd, Slot};

use crate::device::optim::{clip_factor, needs_grad_norm, AdamScalars, LambScalars};
use crate::device::{backend, Device};
use crate::dtype::DataType;
use crate::error::{PerseusError, Result};

/// Runs one optimizer step over `groups`, in host memory or on the CUDA device every
/// tensor lives on. Every tensor is checked first (float32, matching lengths, the state
/// the rule needs, one device, no two tensors sharing memory); nothing is written
/// unless all pass.
pub fn step(groups: &[Group]) -> Result<()> {
    let device = check(groups)?;
    match device {
        None | Some(Device::Cpu) => {
            host::step(groups);
            Ok(())
        }
        Some(d @ Device::Cuda(ordinal)) => backend(d)?.optim_step(ordinal, groups),
    }
}

/// Validates every tensor; returns the one device they share (None: no tensors).
fn check(groups: &[Group]) -> Result<Option<Device>> {
    let mut device = None;
    // (first byte, bytes, group, parameter, which tensor): the message is only made
    // for an overlap, not for every tensor of every step.
    let mut tensors_seen: Vec<(usize, usize, usize, usize, &str)> = Vec::new();
    for (gi, group) in groups.iter().enumerate() {
        let names = group.rule.state_names();
        for (pi, slot) in group.slots.iter().enumerate() {
            let at =
                |what: &str| format!("{} parameter {pi} of group {gi}: {what}", group.rule.name());
            if slot.state.len() != names.len() {
                return Err(PerseusError::InvalidArgument(at(&format!(
                    "expected {} state tensors ({}), got {}",
                    names.len(),
                    names.join(", "),
                    slot.state.len()
                ))));
            }
            if slot.step == 0 {
                return Err(PerseusError::InvalidArgument(at(
                    "the step count starts at 1 (this step included)",
                )));
            }
            let tensors = std::iter::once(("weight", &slot.weight))
                .chain(std::iter::once(("grad", &slot.grad)))
                .chain(names.iter().copied().zip(slot.state.iter()));
            for (what, t) in tensors {
                if t.dtype != DataType::F32 {
                    return Err(PerseusError::UnsupportedType(at(&format!(
                        "{what} is {}; fused optimizers update float32 tensors",
                        t.dtype.name()
                    ))));
                }
                if t.nbytes != slot.weight.nbytes {
                    return Err(PerseusError::InvalidArgument(at(&format!(
                        "{what} has {} elements, the weight {}",
                        t.nbytes / 4,
                        slot.len()
                    ))));
                }
                match device {
                    None => device = Some(t.device),
                    Some(d) if d != t.device => {
                        return Err(PerseusError::InvalidArgument(at(&format!(
                            "{what} is on {}, other tensors on {}; one step runs on one device",
                            t.device, d
                        ))))
                    }
                    Some(_) => {}
                }
                if t.nbytes > 0 {
                    tensors_seen.push((t.ptr as usize, t.nbytes, gi, pi, what));
                }
            }
        }
    }
    // No two tensors may overlap: weights and state are written in place, by several
    // threads (or launches) at once.
    tensors_seen.sort_by_key(|t| t.0);
    let at = |&(_, _, gi, pi, what): &(usize, usize, usize, usize, &str)| {
        format!(
            "{} parameter {pi} of group {gi}: {what}",
            groups[gi].rule.name()
        )
    };
    for pair in tensors_seen.windows(2) {
        let (first, second) = (&pair[0], &pair[1]);
        if first.0 + first.1 > second.0 {
            return Err(PerseusError::InvalidArgument(format!(
                "{} and {} share memory; every weight, gradient and state tensor needs its own",
                at(first),
                at(second)
            )));
        }
    }
    Ok(device)
}

//! `_core.optimizer_step`: the fused optimizer step (src/optim) over framework tensors
//! handed in as DLPack capsules.

use super::dlpack;
use super::errors::to_py;
use crate::error::PerseusError;
use crate::optim::{self, Adam, Group, Lamb, Rule, Sgd, Slot};
use pyo3::prelude::*;
use std::collections::HashMap;

/// One parameter as the front-end passes it: weight, gradient and state capsules, and
/// the step count (this step included).
type PySlot<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Vec<Bound<'py, PyAny>>,
    u64,
);

/// Hyper-parameter `key` of a `kind` group.
fn get(hyper: &HashMap<String, f64>, kind: &str, key: &str) -> Result<f64, PerseusError> {
    hyper.get(key).copied().ok_or_else(|| {
        PerseusError::InvalidArgument(format!("{kind} group: missing hyper-parameter {key:?}"))
    })
}

/// The rule a group's kind and hyper-parameters name.
fn rule(kind: &str, h: &HashMap<String, f64>) -> Result<Rule, PerseusError> {
    let f = |key| get(h, kind, key);
    let b = |key| get(h, kind, key).map(|v| v != 0.0);
    Ok(match kind {
        "sgd" => Rule::Sgd(Sgd {
            lr: f("lr")?,
            momentum: f("momentum")?,
            dampening: f("dampening")?,
            weight_decay: f("weight_decay")?,
            nesterov: b("nesterov")?,
            maximize: b("maximize")?,
        }),
        "adam" | "adamw" => Rule::Adam(Adam {
            lr: f("lr")?,
            beta1: f("beta1")?,
            beta2: f("beta2")?,
            eps: f("eps")?,
            weight_decay: f("weight_decay")?,
            decoupled: kind == "adamw",
            maximize: b("maximize")?,
        }),
        "lamb" => Rule::Lamb(Lamb {
            lr: f("lr")?,
            beta1: f("beta1")?,
            beta2: f("beta2")?,
            eps: f("eps")?,
            weight_decay: f("weight_decay")?,
            adam_w_mode: b("adam_w_mode")?,
            grad_averaging: b("grad_averaging")?,
            bias_correction: b("bias_correction")?,
            max_grad_norm: f("max_grad_norm")?,
            always_adapt: b("always_adapt")?,
        }),
        other => {
            return Err(PerseusError::InvalidArgument(format!(
                "no fused optimizer {other:?}; there are sgd, adam, adamw and lamb"
            )))
        }
    })
}

/// One fused optimizer step. `groups`: per parameter group, its kind (`"sgd"`,
/// `"adam"`, `"adamw"`, `"lamb"`), its hyper-parameters, and its parameters as
/// `(weight, grad, [state...], step)` with DLPack capsules of contiguous float32
/// tensors, all in host memory or all on one CUDA device. Weights and state are
/// updated in place; on a device the step is queued on Perseus's stream.
#[pyfunction]
pub fn optimizer_step(
    py: Python<'_>,
    groups: Vec<(String, HashMap<String, f64>, Vec<PySlot<'_>>)>,
) -> PyResult<()> {
    let mut parsed = Vec::with_capacity(groups.len());
    for (kind, hyper, slots) in &groups {
        let rule = rule(kind, hyper).map_err(to_py)?;
        let mut out = Vec::with_capacity(slots.len());
        for (w, g, state, step) in slots {
            out.push(Slot {
                weight: dlpack::view_flat(w).map_err(to_py)?,
                grad: dlpack::view_flat(g).map_err(to_py)?,
                state: state
                    .iter()
                    .map(dlpack::view_flat)
                    .collect::<Result<_, _>>()
                    .map_err(to_py)?,
                step: *step,
            });
        }
        parsed.push(Group { rule, slots: out });
    }
    py.detach(move || optim::step(&parsed)).map_err(to_py)
}

//! The fused optimizers' rules and the tensors of one step ([`Group`]): what `crate::optim`
//! checks and runs in host memory, and a device backend runs on its device.

use super::tensor::TensorView;

/// SGD's hyper-parameters (torch.optim.SGD's meaning).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor; 0 keeps no momentum buffer.
    pub momentum: f64,
    /// Dampening of the gradient added to the momentum buffer.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Maximise the objective instead of minimising it.
    pub maximize: bool,
}

/// Adam's and AdamW's hyper-parameters (torch.optim.Adam / AdamW).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adam {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay: an L2 term in the gradient (Adam) or a shrink of the weight (AdamW).
    pub weight_decay: f64,
    /// AdamW: decoupled weight decay.
    pub decoupled: bool,
    /// Maximise the objective instead of minimising it.
    pub maximize: bool,
}

/// LAMB's hyper-parameters (the fused LAMB of apex and AIAK).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lamb {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay.
    pub weight_decay: f64,
    /// True: decoupled weight decay (added to the update); false: an L2 term in the gradient.
    pub adam_w_mode: bool,
    /// True: the first moment takes `1 - beta1` of the gradient; false: all of it.
    pub grad_averaging: bool,
    /// Divide the moments by `1 - beta^t`.
    pub bias_correction: bool,
    /// Gradients are scaled down when their global norm (over every LAMB group of the
    /// step) exceeds it; 0 or less: no clipping.
    pub max_grad_norm: f64,
    /// Apply the trust ratio even without weight decay.
    pub always_adapt: bool,
}

/// One parameter group's update rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rule {
    /// SGD with momentum.
    Sgd(Sgd),
    /// Adam or AdamW.
    Adam(Adam),
    /// LAMB.
    Lamb(Lamb),
}

impl Rule {
    /// The state tensors each parameter carries, in the order a [`Slot`] lists them.
    pub fn state_names(&self) -> &'static [&'static str] {
        match self {
            Rule::Sgd(s) if s.momentum != 0.0 => &["momentum_buffer"],
            Rule::Sgd(_) => &[],
            Rule::Adam(_) | Rule::Lamb(_) => &["exp_avg", "exp_avg_sq"],
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        match self {
            Rule::Sgd(_) => "SGD",
            Rule::Adam(a) if a.decoupled => "AdamW",
            Rule::Adam(_) => "Adam",
            Rule::Lamb(_) => "LAMB",
        }
    }
}

/// One parameter: its weight, gradient and state (as [`Rule::state_names`] lists them),
/// and its step count including this step (1 on the first; SGD starts its momentum
/// buffer from the gradient on step 1).
#[derive(Debug, Clone)]
pub struct Slot {
    /// The weight, updated in place.
    pub weight: TensorView,
    /// The gradient, read only.
    pub grad: TensorView,
    /// The optimizer state, updated in place.
    pub state: Vec<TensorView>,
    /// The step count, this step included.
    pub step: u64,
}

impl Slot {
    /// Elements.
    pub fn len(&self) -> usize {
        self.weight.nbytes / 4
    }

    /// True when the parameter has no elements.
    pub fn is_empty(&self) -> bool {
        self.weight.nbytes == 0
    }
}

/// One parameter group: a rule and the parameters it updates.
#[derive(Debug, Clone)]
pub struct Group {
    /// The update rule and its hyper-parameters.
    pub rule: Rule,
    /// The parameters.
    pub slots: Vec<Slot>,
}

/// Adam's per-step scalars, computed as torch computes them (in double, then float).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdamScalars {
    /// `1 - beta1`: the weight of the gradient in the first moment.
    pub beta1c: f32,
    pub beta2: f32,
    /// `1 - beta2`.
    pub beta2c: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// `1 - lr * weight_decay` (AdamW's shrink).
    pub decay: f32,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bias2_sqrt: f32,
}

impl Adam {
    pub(crate) fn scalars(&self, step: u64) -> AdamScalars {
        let t = step as f64;
        AdamScalars {
            beta1c: (1.0 - self.beta1) as f32,
            beta2: self.beta2 as f32,
            beta2c: (1.0 - self.beta2) as f32,
            eps: self.eps as f32,
            weight_decay: self.weight_decay as f32,
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            step_size: (self.lr / (1.0 - self.beta1.powf(t))) as f32,
            bias2_sqrt: (1.0 - self.beta2.powf(t)).sqrt() as f32,
        }
    }
}

/// LAMB's per-step scalars.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LambScalars {
    pub beta1: f32,
    /// The weight of the gradient in the first moment: `1 - beta1`, or 1 without
    /// gradient averaging.
    pub beta3: f32,
    pub beta2: f32,
    /// `1 - beta2`.
    pub beta2c: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// `1 - beta1^t` (1 without bias correction).
    pub bias1: f32,
    /// `1 - beta2^t` (1 without bias correction).
    pub bias2: f32,
    /// Whether the trust ratio scales the step.
    pub adapt: bool,
}

impl Lamb {
    pub(crate) fn scalars(&self, step: u64) -> LambScalars {
        let t = step as f64;
        let (bias1, bias2) = if self.bias_correction {
            (1.0 - self.beta1.powf(t), 1.0 - self.beta2.powf(t))
        } else {
            (1.0, 1.0)
        };
        LambScalars {
            beta1: self.beta1 as f32,
            beta3: if self.grad_averaging {
                (1.0 - self.beta1) as f32
            } else {
                1.0
            },
            beta2: self.beta2 as f32,
            beta2c: (1.0 - self.beta2) as f32,
            eps: self.eps as f32,
            weight_decay: self.weight_decay as f32,
            bias1: bias1 as f32,
            bias2: bias2 as f32,
            adapt: self.always_adapt || self.weight_decay != 0.0,
        }
    }
}

/// The factor LAMB divides every gradient by: the global gradient norm over
/// `max_grad_norm` when it exceeds it, else 1.
pub(crate) fn clip_factor(grad_sq: f64, max_grad_norm: f64) -> f32 {
    let norm = grad_sq.sqrt();
    if max_grad_norm > 0.0 && norm > max_grad_norm {
        (norm / max_grad_norm) as f32
    } else {
        1.0
    }
}

/// True when some LAMB group of the step clips its gradients, so the global gradient
/// norm (over the gradients of every LAMB group) must be computed first.
pub(crate) fn needs_grad_norm(groups: &[Group]) -> bool {
    groups
        .iter()
        .any(|g| matches!(g.rule, Rule::Lamb(l) if l.max_grad_norm > 0.0))
}

//! HOROVOD_AUTOTUNE and its options, read as Horovod 0.28 names them.

use super::{float_var, int_var, invalid, var};
use crate::error::Result;

/// How autotuning samples, and which knobs it may move.
#[derive(Debug, Clone, PartialEq)]
pub struct AutotuneSettings {
    /// CSV file rank 0 writes every sample to (HOROVOD_AUTOTUNE_LOG).
    pub log: Option<String>,
    /// Samples measured and discarded before tuning starts.
    pub warmup_samples: u32,
    /// Training steps in one sample.
    pub steps_per_sample: u32,
    /// Samples scored before the best settings are kept for good.
    pub max_samples: u32,
    /// Noise term of the Gaussian process, on scores scaled to unit variance.
    pub noise: f64,
    /// The fusion threshold may move (neither HOROVOD_FUSION_THRESHOLD nor
    /// PERSEUS_ALLREDUCE_FUSION is set).
    pub fusion: bool,
    /// The cycle time may move (HOROVOD_CYCLE_TIME is not set).
    pub cycle: bool,
    /// The allreduce may move between the hierarchy and the flat ring (no
    /// PERSEUS_ALLREDUCE_MODE, HOROVOD_HIERARCHICAL_ALLREDUCE or
    /// AIAK_HIERARCHICAL_ALLREDUCE is set), where the hosts allow a hierarchy.
    pub mode: bool,
}

/// The autotune settings, or `None` when HOROVOD_AUTOTUNE is unset or 0.
/// Knobs the user set are held constant, as Horovod does; when none is left to
/// move, autotuning is off and `note` says why.
pub fn from_env(note: &mut Vec<String>) -> Result<Option<AutotuneSettings>> {
    if int_var("HOROVOD_AUTOTUNE", 0, 0, 1)? == 0 {
        return Ok(None);
    }
    let noise_name = "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE";
    let noise = float_var(noise_name, 0.8)?;
    if !(1e-6..=100.0).contains(&noise) {
        let v = var(noise_name).unwrap_or_default();
        return Err(invalid(noise_name, &v, super::allowed_of(noise_name)));
    }
    let s = AutotuneSettings {
        log: var("HOROVOD_AUTOTUNE_LOG"),
        warmup_samples: int_var("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", 3, 0, 1000)? as u32,
        steps_per_sample: int_var("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", 10, 1, 100_000)? as u32,
        max_samples: int_var("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", 20, 1, 1000)? as u32,
        noise,
        fusion: var("HOROVOD_FUSION_THRESHOLD").is_none()
            && var("PERSEUS_ALLREDUCE_FUSION").is_none(),
        cycle: var("HOROVOD_CYCLE_TIME").is_none(),
        mode: [
            "PERSEUS_ALLREDUCE_MODE",
            "HOROVOD_HIERARCHICAL_ALLREDUCE",
            "AIAK_HIERARCHICAL_ALLREDUCE",
        ]
        .iter()
        .all(|v| var(v).is_none()),
    };
    if !s.fusion && !s.cycle && !s.mode {
        note.push(
            "HOROVOD_AUTOTUNE=1 has nothing to tune: the fusion threshold, the cycle time \
             and the allreduce mode are all set, so they are used as given"
                .into(),
        );
        return Ok(None);
    }
    Ok(Some(s))
}

//! HOROVOD_AUTOTUNE and its options, read as Horovod 0.28 names them.

use crate::error::Result;
use crate::params;

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
    if !params::flag("HOROVOD_AUTOTUNE")? {
        return Ok(None);
    }
    let s = AutotuneSettings {
        log: params::text("HOROVOD_AUTOTUNE_LOG")?,
        warmup_samples: params::int("HOROVOD_AUTOTUNE_WARMUP_SAMPLES")? as u32,
        steps_per_sample: params::int("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE")? as u32,
        max_samples: params::int("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES")? as u32,
        noise: params::float("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE")?,
        fusion: !params::is_set("HOROVOD_FUSION_THRESHOLD")
            && !params::is_set("PERSEUS_ALLREDUCE_FUSION"),
        cycle: !params::is_set("HOROVOD_CYCLE_TIME"),
        mode: [
            "PERSEUS_ALLREDUCE_MODE",
            "HOROVOD_HIERARCHICAL_ALLREDUCE",
            "AIAK_HIERARCHICAL_ALLREDUCE",
        ]
        .into_iter()
        .all(|v| !params::is_set(v)),
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

//! How one allreduce travels: its encoding on the wire
//! (`PERSEUS_ALLREDUCE_DTYPE`, `PERSEUS_ALLREDUCE_GRADIENT_SCALE`), its
//! shape across hosts (`PERSEUS_ALLREDUCE_MODE`), and whether its tensors are
//! in device memory. Every rank puts its plan in its request; the coordinator
//! refuses to pair requests whose encodings or modes differ, so all ranks
//! always run the same algorithm, and answers `device` only when every rank's
//! tensor is on a device (then NCCL may carry it, docs/gpu.md).

use crate::error::{PerseusError, Result};

/// The encoding of float32 data on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Encoding {
    /// As it is (PERSEUS_ALLREDUCE_DTYPE=1, and every non-gradient reduction).
    Exact = 0,
    /// float16 on every link (PERSEUS_ALLREDUCE_DTYPE=0).
    Half = 1,
    /// float32 within a host, float16 between hosts (PERSEUS_ALLREDUCE_DTYPE=2).
    HalfBetweenHosts = 2,
}

/// The shape of an allreduce across hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// Hierarchical when the set spans several hosts with several ranks each.
    Auto = 0,
    /// One ring over all ranks (PERSEUS_ALLREDUCE_MODE=0).
    Flat = 1,
    /// Reduce within each host, allreduce across hosts, share within the host
    /// (PERSEUS_ALLREDUCE_MODE=1).
    Hierarchical = 2,
}

/// The plan of one allreduce request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plan {
    /// Encoding of float32 data.
    pub encoding: Encoding,
    /// Factor applied before a float16 cast and undone after (gradient scale).
    pub scale: f64,
    /// Flat or hierarchical.
    pub mode: Mode,
    /// In a request: this rank's tensor is in device (GPU) memory. In a response:
    /// every rank's is, and none has joined.
    pub device: bool,
}

impl Default for Plan {
    fn default() -> Self {
        Plan {
            encoding: Encoding::Exact,
            scale: 1.0,
            mode: Mode::Auto,
            device: false,
        }
    }
}

impl Plan {
    /// The same plan with the exact encoding (for reductions that are not gradients).
    pub fn exact(self) -> Plan {
        Plan {
            encoding: Encoding::Exact,
            scale: 1.0,
            ..self
        }
    }

    /// The same plan with `device` cleared: what must agree between ranks.
    pub fn on_host(self) -> Plan {
        Plan {
            device: false,
            ..self
        }
    }

    /// Wire codes of the encoding, the mode and the device flag.
    pub fn codes(&self) -> (u8, u8, u8) {
        (self.encoding as u8, self.mode as u8, u8::from(self.device))
    }

    /// Rebuilds a plan from its wire form.
    pub fn from_codes(encoding: u8, scale: f64, mode: u8, device: u8) -> Result<Plan> {
        let encoding = match encoding {
            0 => Encoding::Exact,
            1 => Encoding::Half,
            2 => Encoding::HalfBetweenHosts,
            c => return Err(PerseusError::Protocol(format!("unknown encoding {c}"))),
        };
        let mode = match mode {
            0 => Mode::Auto,
            1 => Mode::Flat,
            2 => Mode::Hierarchical,
            c => {
                return Err(PerseusError::Protocol(format!(
                    "unknown allreduce mode {c}"
                )))
            }
        };
        let device = match device {
            0 => false,
            1 => true,
            c => return Err(PerseusError::Protocol(format!("unknown device flag {c}"))),
        };
        Ok(Plan {
            encoding,
            scale,
            mode,
            device,
        })
    }

    /// In words, for mismatch errors.
    pub fn describe(&self) -> String {
        let enc = match self.encoding {
            Encoding::Exact => "exact".to_string(),
            Encoding::Half => format!("float16 (scale {})", self.scale),
            Encoding::HalfBetweenHosts => format!("float16 between hosts (scale {})", self.scale),
        };
        format!("{enc}, {} mode", self.mode.name())
    }
}

impl Mode {
    /// In a word, for mismatch errors.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Auto => "automatic",
            Mode::Flat => "flat",
            Mode::Hierarchical => "hierarchical",
        }
    }
}

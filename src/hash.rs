//! FNV-1a: the core's one non-cryptographic hash, for short identities (an
//! operation's fingerprint, a segment's file name). Never used where a peer could
//! choose the bytes to collide on purpose; the job secret covers that (`auth`).

/// FNV-1a's 64-bit offset basis: the usual starting point.
pub const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

const PRIME: u64 = 0x100_0000_01b3;

/// FNV-1a (64-bit) of `bytes`, starting from `start` ([`OFFSET`] for the standard
/// hash; another start gives an independent second hash of the same bytes).
pub fn fnv1a(start: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(start, |h, &b| (h ^ u64::from(b)).wrapping_mul(PRIME))
}

#[cfg(test)]
mod tests;

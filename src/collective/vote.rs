//! A vote of one byte among every rank, waiting as long as busy peers take.

use crate::error::Result;
use crate::transport::{Mesh, Recv, Send};

/// The largest of every rank's `mine`: a dissemination of one byte, in log2(n) rounds.
/// Peers may be busy elsewhere for a long time, so each round waits as long as it takes:
/// `alive` runs meanwhile, and an error from it ends the vote with that error.
pub fn patient_max(mesh: &Mesh, mine: u8, alive: &mut dyn FnMut() -> Result<()>) -> Result<u8> {
    let (n, r) = (mesh.size(), mesh.rank());
    let mut max = [mine];
    let mut dist = 1;
    while dist < n {
        let (to, from) = ((r + dist) % n, (r + n - dist) % n);
        let mut theirs = [0u8];
        mesh.transfer_patient(
            &mut [Send::new(to, &max)],
            &mut [Recv::new(from, &mut theirs)],
            alive,
        )?;
        max[0] = max[0].max(theirs[0]);
        dist *= 2;
    }
    Ok(max[0])
}

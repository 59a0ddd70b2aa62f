//! A vote of one byte among every rank, waiting as long as busy peers take.

use crate::error::Result;
use crate::transport::{Mesh, Recv, Send};

/// Fewest ranks whose votes go up and down a tree: 2(n-1) messages in all, against
/// n·ceil(log2 n) for the dissemination that two ranks use (one round, no relay).
const TREE_MIN_RANKS: usize = 3;

/// The largest of every rank's `mine`, and how many messages this rank sent for it.
/// Two ranks swap their bytes; more go up a binomial tree to rank 0 and the result comes
/// back down it. Peers may be busy elsewhere for a long time, so each hop waits as long
/// as it takes: `alive` runs meanwhile, and an error from it ends the vote with that
/// error.
pub fn patient_max(
    mesh: &Mesh,
    mine: u8,
    alive: &mut dyn FnMut() -> Result<()>,
) -> Result<(u8, usize)> {
    let (n, r) = (mesh.size(), mesh.rank());
    if n < TREE_MIN_RANKS {
        return dissemination(mesh, mine, alive);
    }
    let mut max = [mine];
    let mut sent = 0;
    // Up: gather the children's bytes (r + 1, r + 2, r + 4, ... below r's lowest set
    // bit), then pass the largest to the parent.
    let mut mask = 1;
    while mask < n {
        if r & mask != 0 {
            mesh.transfer_patient(&mut [Send::new(r - mask, &max)], &mut [], alive)?;
            sent += 1;
            let mut got = [0u8];
            mesh.transfer_patient(&mut [], &mut [Recv::new(r - mask, &mut got)], alive)?;
            max = got;
            break;
        }
        if r + mask < n {
            let mut theirs = [0u8];
            mesh.transfer_patient(&mut [], &mut [Recv::new(r + mask, &mut theirs)], alive)?;
            max[0] = max[0].max(theirs[0]);
        }
        mask <<= 1;
    }
    // Down: the result to each child, the farthest first.
    while mask > 1 {
        mask >>= 1;
        if r + mask < n {
            mesh.transfer_patient(&mut [Send::new(r + mask, &max)], &mut [], alive)?;
            sent += 1;
        }
    }
    Ok((max[0], sent))
}

/// Every rank learns the largest byte in ceil(log2 n) rounds of one send each.
fn dissemination(
    mesh: &Mesh,
    mine: u8,
    alive: &mut dyn FnMut() -> Result<()>,
) -> Result<(u8, usize)> {
    let (n, r) = (mesh.size(), mesh.rank());
    let mut max = [mine];
    let (mut dist, mut sent) = (1, 0);
    while dist < n {
        let (to, from) = ((r + dist) % n, (r + n - dist) % n);
        let mut theirs = [0u8];
        mesh.transfer_patient(
            &mut [Send::new(to, &max)],
            &mut [Recv::new(from, &mut theirs)],
            alive,
        )?;
        sent += 1;
        max[0] = max[0].max(theirs[0]);
        dist *= 2;
    }
    Ok((max[0], sent))
}

//! Hierarchical allreduce and allgather for groups that span hosts with several
//! ranks on each. With `L` ranks per host: a ring reduce-scatter within each host
//! leaves local rank `i` owning shard `i` of the host's sum; the ranks with
//! the same local index (one per host: the shard's leaders) allreduce that
//! shard across hosts; a ring allgather within each host shares the shards.
//! Every rank leads one shard, so `L` connections between hosts work at
//! once, each carrying `1/L` of the data, and the exchange between hosts
//! takes `2(H-1)` steps for `H` hosts rather than the flat ring's `2(n-1)`.
//! That stage alone may travel as float16.

use std::ops::Range;

use super::ring::{allgather_ranges, allreduce, byte_parts, reduce_scatter_ranges};
use super::{consecutive, Comm, SubComm};
use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::kernels::{from_half, to_half, AlignedBuf};

/// The group's ranks by host, hosts in order of their first rank.
pub fn hosts_of(comm: &dyn Comm) -> Vec<Vec<usize>> {
    let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
    for r in 0..comm.size() {
        let h = comm.host(r);
        match groups.iter_mut().find(|(k, _)| *k == h) {
            Some((_, g)) => g.push(r),
            None => groups.push((h, vec![r])),
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

/// This rank's host's ranks, and the ranks with this rank's local index on every
/// host (one per host, in host order; the group must [`fits`]).
pub fn host_and_peers(comm: &dyn Comm) -> (Vec<usize>, Vec<usize>) {
    let hosts = hosts_of(comm);
    let mine = hosts
        .iter()
        .find(|g| g.contains(&comm.rank()))
        .expect("rank on no host")
        .clone();
    let li = mine.iter().position(|&r| r == comm.rank()).unwrap();
    let peers = hosts.iter().map(|g| g[li]).collect();
    (mine, peers)
}

/// True when the hierarchical algorithm applies: several hosts, each with
/// the same number (at least two) of the group's ranks.
pub fn fits(hosts: &[Vec<usize>]) -> bool {
    hosts.len() > 1 && hosts[0].len() > 1 && hosts.iter().all(|g| g.len() == hosts[0].len())
}

/// Hierarchical allreduce of `buf` in place (the group must [`fits`]).
/// With `half_between_hosts` (float32 only), the stage between hosts carries
/// float16 and every rank ends with the same float16-rounded values.
pub fn allreduce_hierarchical(
    comm: &dyn Comm,
    buf: &mut [u8],
    dtype: DataType,
    op: ReduceOp,
    half_between_hosts: bool,
    half: &mut AlignedBuf,
    scratch: &mut AlignedBuf,
) -> Result<()> {
    let (mine, leaders) = host_and_peers(comm);
    let li = mine.iter().position(|&r| r == comm.rank()).unwrap();
    let intra = SubComm::new(comm, mine);
    let cross = SubComm::new(comm, leaders);
    let parts = byte_parts(buf.len(), dtype.size(), intra.size());
    reduce_scatter_ranges(&intra, buf, &parts, dtype, op)?;
    let shard = &mut buf[parts[li].clone()];
    if half_between_hosts && dtype == DataType::F32 {
        half.resize(shard.len() / 2);
        to_half(half.as_mut_slice(), shard, 1.0);
        allreduce(&cross, half.as_mut_slice(), DataType::F16, op, 1.0, scratch)?;
        from_half(shard, half.as_slice(), 1.0);
    } else {
        allreduce(&cross, shard, dtype, op, 1.0, scratch)?;
    }
    allgather_ranges(&intra, buf, &parts)
}

/// Hierarchical allgather of blocks of `sizes[i]` bytes from group rank `i`, laid out
/// in rank order in `buf`; this rank's block must already be in place, and the group
/// must [`fits`] (`L` ranks on each of `H` hosts).
///
/// First the ranks with the same local index on every host (one per host) gather
/// their blocks across hosts, `L` such groups at once: each block crosses to each other
/// host once, where the flat ring sends up to `n - 1` blocks over each of its links
/// between hosts. Then the ranks of each host share what they gathered. The blocks
/// travel through a staging buffer ordered by local index, then host, so that what
/// each step moves is one contiguous range per rank; the result is copied back into
/// rank order.
pub fn allgatherv_hierarchical(comm: &dyn Comm, buf: &mut [u8], sizes: &[usize]) -> Result<()> {
    let hosts = hosts_of(comm);
    let (mine, peers) = host_and_peers(comm);
    let li = mine.iter().position(|&r| r == comm.rank()).unwrap();
    let in_place = consecutive(sizes.iter().copied());
    // Group ranks in staging order: local index 0 of every host, then local index 1...
    let order: Vec<usize> = (0..mine.len())
        .flat_map(|i| hosts.iter().map(move |g| g[i]))
        .collect();
    let staged_ranges = consecutive(order.iter().map(|&r| sizes[r]));
    let mut staged = vec![0..0; sizes.len()];
    for (k, &r) in order.iter().enumerate() {
        staged[r] = staged_ranges[k].clone();
    }
    let mut stage = AlignedBuf::zeroed(buf.len());
    let me = comm.rank();
    stage.as_mut_slice()[staged[me].clone()].copy_from_slice(&buf[in_place[me].clone()]);
    // Across hosts: this local index's blocks, one per host.
    let cross = SubComm::new(comm, peers.clone());
    let parts: Vec<Range<usize>> = peers.iter().map(|&r| staged[r].clone()).collect();
    allgather_ranges(&cross, stage.as_mut_slice(), &parts)?;
    // Within the host: local index i brings the blocks of local index i of every host,
    // one contiguous range.
    let intra = SubComm::new(comm, mine.clone());
    let columns: Vec<Range<usize>> = (0..mine.len())
        .map(|i| {
            let first = staged[hosts[0][i]].start;
            let last = staged[hosts[hosts.len() - 1][i]].end;
            first..last
        })
        .collect();
    debug_assert_eq!(columns[li], parts[0].start..parts[parts.len() - 1].end);
    allgather_ranges(&intra, stage.as_mut_slice(), &columns)?;
    for r in (0..sizes.len()).filter(|&r| r != me) {
        buf[in_place[r].clone()].copy_from_slice(&stage.as_slice()[staged[r].clone()]);
    }
    Ok(())
}

//! Hierarchical allreduce for groups that span hosts with several ranks on
//! each. With `L` ranks per host: a ring reduce-scatter within each host
//! leaves local rank `i` owning shard `i` of the host's sum; the ranks with
//! the same local index (one per host: the shard's leaders) allreduce that
//! shard across hosts; a ring allgather within each host shares the shards.
//! Every rank leads one shard, so `L` connections between hosts work at
//! once, each carrying `1/L` of the data, and the exchange between hosts
//! takes `2(H-1)` steps for `H` hosts rather than the flat ring's `2(n-1)`.
//! That stage alone may travel as float16.

use super::ring::{allgather_ranges, allreduce, byte_parts, reduce_scatter_ranges};
use super::{Comm, SubComm};
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

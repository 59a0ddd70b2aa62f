//! How the ranks of a process set form their NCCL group: each offers its device
//! ([`offer`]), every rank learns every offer, and where all can take part each
//! channel's communicator is made from unique ids rank 0 shares ([`open`]). A member
//! that cannot make its part says so in the same exchange, so no rank waits for it.

use std::sync::Arc;

use cudarc::driver::{result, sys};

use super::group::{Channel, NcclGroup, DIRECT_KERNELS};
use super::nccl::{Nccl, UniqueId, UNIQUE_ID_BYTES};
use super::runtime::{driver, search_dirs, CudaDevice};
use crate::collective::{allgatherv, Comm};
use crate::device::{agree, Agreement, Device, DeviceGroup, Formed, Opener, Waited, Watch};
use crate::error::{PerseusError, Result};

/// Forms NCCL groups on CUDA devices.
pub struct CudaOpener {
    /// Non-blocking communicators (PERSEUS_NCCL_NONBLOCKING).
    pub nonblocking: bool,
}

impl Opener for CudaOpener {
    fn offer(&self, device: Device) -> std::result::Result<[u8; 16], String> {
        let Device::Cuda(ordinal) = device else {
            return Err("its tensors are in host memory".into());
        };
        offer(ordinal)
    }

    fn open(
        &self,
        comm: &dyn Comm,
        device: Device,
        channels: usize,
        members: &[usize],
        watch: &Watch<'_>,
    ) -> Result<Formed> {
        let Device::Cuda(ordinal) = device else {
            return Ok(Err("its tensors are in host memory".into()));
        };
        let how = Forming {
            channels,
            nonblocking: self.nonblocking,
        };
        Ok(open(comm, ordinal, how, members, watch)?.map(|g| Arc::new(g) as Arc<dyn DeviceGroup>))
    }
}

/// What this rank offers to the set: the UUID of `cuda:ordinal`, or why it cannot use
/// NCCL (never a panic; a missing library is a reason like any other). The kernels the
/// direct path launches are compiled and loaded here, before the ranks agree: a device
/// whose NVRTC cannot make them (or whose driver cannot load them) is a reason too, so
/// every rank goes through host memory together, where a kernel failing in the middle
/// of a collective would abandon the set's group for good.
pub fn offer(ordinal: i32) -> std::result::Result<[u8; 16], String> {
    let dev = CudaDevice::get(ordinal).map_err(|e| e.to_string())?;
    Nccl::load(&search_dirs()).map_err(|e| e.to_string())?;
    dev.load_kernels(DIRECT_KERNELS).map_err(|e| {
        format!(
            "the device kernels of the NCCL path are not usable on cuda:{ordinal} (sm_{}): {e}",
            dev.sm()
        )
    })?;
    Ok(dev.uuid)
}

/// How a group's communicators are formed.
#[derive(Debug, Clone, Copy)]
pub struct Forming {
    /// How many (`PERSEUS_ALLREDUCE_STREAMS`), each with its own stream.
    pub channels: usize,
    /// Non-blocking (`PERSEUS_NCCL_NONBLOCKING`), where NCCL allows it.
    pub nonblocking: bool,
}

/// Forms this rank's NCCL group on `cuda:ordinal`: the ranks `members` of `comm`
/// (every member of `comm` calls this together, each with its own group's members),
/// after [`agree`] answered [`Agreement::Direct`]. Non-blocking communicators are
/// waited for as `watch` allows. Returns the group, or why it could not be formed (the
/// same words on every rank).
pub fn open(
    comm: &dyn Comm,
    ordinal: i32,
    how: Forming,
    members: &[usize],
    watch: &Watch<'_>,
) -> Result<std::result::Result<NcclGroup, String>> {
    let channels = how.channels.max(1);
    // Everything that can fail on this rank alone happens before the status is shared:
    // the device, NCCL, and each channel's stream and event and the group's own.
    let made = (|| -> Result<(Arc<CudaDevice>, Arc<Nccl>, Local)> {
        let dev = CudaDevice::get(ordinal)?;
        dev.bind()?;
        let nccl = Arc::new(Nccl::load(&search_dirs())?);
        let local = Local::new(&dev, channels)?;
        Ok((dev, nccl, local))
    })();
    // Each group's first member makes its ids; every rank's slot (a status byte, then
    // the ids) is gathered, and each rank reads its leader's. A rank that could not
    // make its part, or a leader that could not make the ids, says so in its status,
    // and no rank of that group waits in ncclCommInitRank for it.
    let slot = 1 + channels * UNIQUE_ID_BYTES;
    let mut all = vec![0u8; slot * comm.size()];
    let me = comm.rank();
    let leader = members[0];
    let mut why_not = made.as_ref().err().map(|e| e.to_string());
    if made.is_ok() {
        all[me * slot] = MADE;
    }
    if leader == me {
        let ids = made
            .as_ref()
            .map_err(|e| e.clone())
            .and_then(|(_, nccl, _)| {
                (0..channels)
                    .map(|_| nccl.unique_id())
                    .collect::<Result<Vec<_>>>()
            });
        match ids {
            Ok(list) => {
                all[me * slot] |= IDS;
                for (i, id) in list.iter().enumerate() {
                    let at = me * slot + 1 + i * UNIQUE_ID_BYTES;
                    all[at..at + UNIQUE_ID_BYTES].copy_from_slice(&id.0);
                }
            }
            Err(e) => why_not = why_not.or(Some(e.to_string())),
        }
    }
    allgatherv(comm, &mut all, &vec![slot; comm.size()])?;
    let ids = &all[leader * slot + 1..(leader + 1) * slot];
    let rank = members
        .iter()
        .position(|&m| m == me)
        .expect("a member of its group");
    let formed = match ready_to_form(&all, slot, members) {
        Err(why) => Err(why_not.unwrap_or(why)),
        Ok(()) => made
            .map_err(|e| e.to_string())
            .and_then(|(dev, nccl, local)| {
                dev.bind()
                    .and_then(|()| {
                        let (size, nb) = (members.len(), how.nonblocking);
                        form(&nccl, ids, size, rank, nb, local.streams, watch)
                    })
                    .map(|chans| (dev, chans, local.ready, local.flag))
                    .map_err(|e| e.to_string())
            }),
    };
    // Every rank learns whether every rank formed its group.
    let offer = formed.as_ref().map(|(d, ..)| d.uuid).map_err(|e| e.clone());
    match agree(comm, offer)? {
        Agreement::Direct => {
            let (dev, channels, ready, flag) = formed.expect("agreed, so formed here");
            if channels.len() > 1 && comm.rank() == 0 {
                static SAID: std::sync::Once = std::sync::Once::new();
                let note = concurrent_note(channels.len());
                SAID.call_once(|| crate::log!(crate::log::Level::Info, "{note}"));
            }
            Ok(Ok(NcclGroup::new(
                dev,
                channels,
                ready,
                flag,
                rank,
                members.len(),
            )))
        }
        Agreement::Staged(why) => Ok(Err(why)),
    }
}

/// What rank 0 says once when a group has several channels: their communicators run
/// side by side, which NCCL's guide does not promise to be safe (docs/gpu.md).
fn concurrent_note(channels: usize) -> String {
    format!(
        "PERSEUS_ALLREDUCE_STREAMS={channels}: the parts of a split allreduce run on \
         {channels} NCCL communicators at once. NCCL's guide warns that this can deadlock \
         where their kernels do not all fit on the GPU at once (NCCL_MAX_CTAS caps each \
         one's); a deadlock ends at the peer timeout (GLOO_TIMEOUT_SECONDS) with the \
         set's communicators aborted. Unset it for one communicator, which is safe"
    )
}

/// Status bit: this rank has its device and NCCL.
const MADE: u8 = 1;
/// Status bit (a group's leader): the ids follow.
const IDS: u8 = 2;

/// Whether the ranks of a group can call ncclCommInitRank together, from the gathered
/// slots (a status byte first): every member has its device and NCCL, and the leader
/// made the ids. Otherwise why not, naming the first rank that cannot, so that none
/// waits for a rank that will never join.
fn ready_to_form(all: &[u8], slot: usize, members: &[usize]) -> std::result::Result<(), String> {
    if let Some(m) = members.iter().find(|&&m| all[m * slot] & MADE == 0) {
        return Err(format!("rank {m} could not load its GPU or NCCL"));
    }
    let leader = members[0];
    if all[leader * slot] & IDS == 0 {
        return Err(format!("rank {leader} could not make NCCL's unique ids"));
    }
    Ok(())
}

/// What a group needs of this rank's device alone, made before any rank calls
/// ncclCommInitRank. Kept for the life of the process once made (one per process set;
/// a set that ends up staged leaves them unused).
struct Local {
    /// Each channel's stream and the event marking its last work.
    streams: Vec<(sys::CUstream, sys::CUevent)>,
    /// The group's `ready` event.
    ready: sys::CUevent,
    /// Four bytes for the finiteness flag.
    flag: sys::CUdeviceptr,
}

impl Local {
    fn new(dev: &CudaDevice, channels: usize) -> Result<Local> {
        let event = || {
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(driver("cuEventCreate"))
        };
        let streams = (0..channels)
            .map(|_| {
                let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
                    .map_err(driver("cuStreamCreate"))?;
                Ok((stream, event()?))
            })
            .collect::<Result<Vec<_>>>()?;
        // SAFETY: four bytes on the Perseus stream, freed never (one per group).
        let flag =
            unsafe { result::malloc_async(dev.stream, 4) }.map_err(driver("cuMemAllocAsync"))?;
        Ok(Local {
            streams,
            ready: event()?,
            flag,
        })
    }
}

/// The channels: one communicator each, joined back to back (every member of the
/// group calls this together, once every member has made its [`Local`]). Non-blocking
/// ones are each waited for as `watch` allows: a member that never joins (its process
/// ended, or it gave up) then fails the formation on this rank at the watch's limit at
/// the latest, and the communicators formed so far are aborted (by their drop).
fn form(
    nccl: &Arc<Nccl>,
    ids: &[u8],
    size: usize,
    rank: usize,
    nonblocking: bool,
    streams: Vec<(sys::CUstream, sys::CUevent)>,
    watch: &Watch<'_>,
) -> Result<Vec<Channel>> {
    streams
        .into_iter()
        .enumerate()
        .map(|(c, (stream, done))| {
            let mut id = UniqueId([0; UNIQUE_ID_BYTES]);
            id.0.copy_from_slice(&ids[c * UNIQUE_ID_BYTES..(c + 1) * UNIQUE_ID_BYTES]);
            let comm = nccl.communicator(&id, size, rank, nonblocking)?;
            match comm.settle(watch, || None)? {
                Waited::Done => Ok(Channel { comm, stream, done }),
                Waited::Stopped(why) => Err(PerseusError::Device(format!(
                    "forming NCCL communicator {c} of the process set: {why}"
                ))),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{concurrent_note, ready_to_form, IDS, MADE};

    #[test]
    fn more_than_one_channel_is_noted_as_outside_what_nccl_promises() {
        assert!(concurrent_note(3).contains("PERSEUS_ALLREDUCE_STREAMS=3"));
    }

    /// Gathered slots of two ranks each: a status byte and one filler byte.
    fn slots(status: &[u8]) -> Vec<u8> {
        status.iter().flat_map(|&s| [s, 0]).collect()
    }

    #[test]
    fn no_rank_waits_for_a_member_that_cannot_join() {
        let ok = slots(&[MADE | IDS, MADE, MADE | IDS, MADE]);
        assert_eq!(ready_to_form(&ok, 2, &[0, 1]), Ok(()));
        assert_eq!(ready_to_form(&ok, 2, &[2, 3]), Ok(()));
        // Rank 3 has no GPU or NCCL: its group stays out, the other group forms.
        let lost = slots(&[MADE | IDS, MADE, MADE | IDS, 0]);
        assert_eq!(ready_to_form(&lost, 2, &[0, 1]), Ok(()));
        assert_eq!(
            ready_to_form(&lost, 2, &[2, 3]),
            Err("rank 3 could not load its GPU or NCCL".into())
        );
        // A leader without ids.
        let no_ids = slots(&[MADE, MADE]);
        assert_eq!(
            ready_to_form(&no_ids, 2, &[0, 1]),
            Err("rank 0 could not make NCCL's unique ids".into())
        );
    }
}

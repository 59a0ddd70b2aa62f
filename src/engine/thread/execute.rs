//! Running one response on this rank: the data-moving ones through the host, staged or
//! device-direct executor, the others (joins, barriers, process sets, aborts) in place;
//! then the handles complete, with their timeline spans and counters.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::super::message::{shape_bytes, OpKind, Response};
use super::super::offline::Mode;
use super::super::offline::Schedule;
use super::super::{direct, exec, staged, timeline_names, Counters, Entry, Output, Request};
use super::State;
use crate::collective::{Comm, SubComm};
use crate::device::{Device, Watch};
use crate::dtype::ReduceOp;
use crate::error::PerseusError;
use crate::timeline;
use std::time::Duration;

impl State {
    /// A compressed allreduce overflowed float16 and went again uncompressed:
    /// counted, and said once per process (by the set's first rank) when the
    /// exact sums were finite, i.e. when the gradient scale was to blame.
    fn note_resend(&mut self, members: &[usize], names: &[String], bad: &[usize], finite: bool) {
        let c = &self.shared.counters;
        c.compression_resends.fetch_add(1, Ordering::Relaxed);
        if !finite || members.first() != Some(&self.mesh.rank()) {
            return;
        }
        if self.warned_overflow {
            return;
        }
        self.warned_overflow = true;
        let which: Vec<&str> = bad.iter().map(|&i| names[i].as_str()).collect();
        crate::log!(
            crate::log::Level::Warning,
            "the float16 sum of gradient(s) {} overflowed at \
             PERSEUS_ALLREDUCE_GRADIENT_SCALE={}; the buffer was resent uncompressed. \
             Lower the scale (e.g. PERSEUS_ALLREDUCE_GRADIENT_SCALE=1) if this repeats. \
             (Said once.)",
            which.join(", "),
            self.gradient_scale
        );
    }

    pub(super) fn execute(&mut self, mut resp: Response) {
        // What negotiated this operation is in the counters before a caller wakes.
        self.note_traffic();
        if let Response::Op {
            kind: OpKind::Allreduce,
            plan,
            ..
        } = &mut resp
        {
            // HOROVOD_AUTOTUNE chose the flat ring over the hierarchy (every rank
            // got that choice at the same point of the answers).
            if self.auto_flat && plan.mode == crate::plan::Mode::Auto {
                plan.mode = crate::plan::Mode::Flat;
            }
        }
        match &resp {
            Response::Op {
                process_set,
                names,
                kind,
                shapes,
                dtype,
                op,
                ..
            } => {
                let ps = *process_set;
                crate::log!(
                    crate::log::Level::Trace,
                    "{kind:?} of {} tensor(s) in process set {ps}, from '{}'",
                    names.len(),
                    names.first().map_or("", String::as_str)
                );
                let mut taken = Vec::with_capacity(names.len());
                for n in names {
                    match self.entries.remove(&(ps, n.clone())) {
                        Some((_, e, at)) => taken.push(Some((e, at))),
                        None if self.joined.contains(&ps) && *kind == OpKind::Allreduce => {
                            taken.push(None)
                        }
                        None => {
                            let msg = format!(
                                "the coordinator scheduled {} '{n}', which this rank never submitted",
                                kind.name()
                            );
                            return self.fail_all(PerseusError::Protocol(msg));
                        }
                    }
                }
                let began = taken.iter().flatten().map(|(e, _)| e.handle);
                self.shared.recorder.lock().unwrap().started(began);
                let members = self.shared.sets.lock().unwrap().get(&ps).cloned();
                let Some(members) = members else {
                    return self.fail_all(PerseusError::Protocol(format!("unknown set {ps}")));
                };
                let comm = SubComm::new(&self.mesh, members.clone());
                let start = Instant::now();
                let (entries, queued): (Vec<Option<Entry>>, Vec<Option<Instant>>) =
                    taken.into_iter().map(Option::unzip).unzip();
                let tracing = self.shared.timeline.active();
                self.bufs.phases = tracing.then(Vec::new);
                let outcome = if direct::supports(&resp) {
                    run_device(
                        &mut self.groups,
                        &mut self.bufs,
                        &self.shared.counters,
                        ps,
                        &comm,
                        &resp,
                        &entries,
                    )
                } else if staged::needs_staging(&entries) {
                    let resolve = staged::device_memory;
                    staged::run_staged(&comm, &resp, &entries, &mut self.bufs, &resolve)
                } else {
                    exec::run_op(&comm, &resp, &entries, &mut self.bufs)
                };
                drop(comm);
                let end = Instant::now();
                let phases = self.bufs.phases.take().unwrap_or_default();
                // Every data-moving kind has its names.
                let op_name = timeline_names::op_name(*kind, *op).unwrap_or("OPERATION");
                let negotiate = timeline_names::negotiate_name(*kind, *op).unwrap_or("NEGOTIATE");
                // Waiting for the group and the vote, when run from the offline schedule.
                let wait = if matches!(self.mode, Mode::Running(_)) {
                    "OFFLINE"
                } else {
                    negotiate
                };
                if let Some(r) = &outcome.resent {
                    self.note_resend(&members, names, &r.bad, r.finite);
                }
                let results = outcome.results;
                let c = &self.shared.counters;
                c.operations.fetch_add(1, Ordering::Relaxed);
                c.tensors.fetch_add(names.len() as u64, Ordering::Relaxed);
                if names.len() > 1 {
                    c.fused_buffers.fetch_add(1, Ordering::Relaxed);
                    let bytes: usize = shapes.iter().map(|s| shape_bytes(s, *dtype)).sum();
                    c.fused_bytes_max.fetch_max(bytes as u64, Ordering::Relaxed);
                }
                let (intra, inter) = self.mesh.bytes_sent();
                c.bytes_intra_host.store(intra, Ordering::Relaxed);
                c.bytes_inter_host.store(inter, Ordering::Relaxed);
                let extra = self.mesh.bytes_sent_extra();
                c.bytes_extra_streams.store(extra, Ordering::Relaxed);
                c.transfer_rounds
                    .store(self.mesh.rounds(), Ordering::Relaxed);
                c.linked_peers
                    .store(self.mesh.linked_peers() as u64, Ordering::Relaxed);
                let shared = self.shared.clone();
                let tl = &shared.timeline;
                for (i, ((name, (e, at)), r)) in names
                    .iter()
                    .zip(entries.into_iter().zip(queued))
                    .zip(results)
                    .enumerate()
                {
                    if tracing {
                        let row = timeline_names::row_name(*kind, name);
                        if let Some(at) = at {
                            tl.span(&row, wait, at, start, "");
                        }
                        // This rank's tensor, as Horovod's; the negotiated shape where
                        // this rank has joined.
                        let view = e
                            .as_ref()
                            .and_then(|e| e.input.as_ref().or(e.output.as_ref()));
                        let shape = view
                            .map(|v| v.shape.as_slice())
                            .or(shapes.get(i).map(Vec::as_slice));
                        let args = timeline::op_args(*dtype, shape, names.len());
                        tl.span(&row, op_name, start, end, &args);
                        for p in &phases {
                            tl.span(&row, p.name, p.start, p.end, "");
                        }
                    }
                    if let Some(e) = e {
                        let failed = r.as_ref().err().cloned();
                        self.finish(&ps, name, e.handle, r);
                        if let Some(err @ (PerseusError::Peer(_) | PerseusError::Protocol(_))) =
                            failed
                        {
                            self.fail_all(err);
                        }
                    }
                }
            }
            Response::Error {
                process_set,
                names,
                message,
            } => {
                for n in names {
                    if let Some((_, e, _)) = self.entries.remove(&(*process_set, n.clone())) {
                        self.finish(
                            process_set,
                            n,
                            e.handle,
                            Err(PerseusError::Mismatch(message.clone())),
                        );
                    }
                }
            }
            Response::Done {
                kind,
                process_set,
                name,
                value,
            } => {
                let ps = *process_set;
                let Some((req, e, at)) = self.entries.remove(&(ps, name.clone())) else {
                    return;
                };
                // A barrier's or a join's row: its negotiation (NEGOTIATE_BARRIER,
                // NEGOTIATE_JOIN), all there is of it, as in Horovod's timeline.
                if let Some(negotiate) = timeline_names::negotiate_name(*kind, ReduceOp::Sum) {
                    let row = timeline_names::row_name(*kind, name);
                    let tl = &self.shared.timeline;
                    tl.span(&row, negotiate, at, Instant::now(), "");
                }
                match kind {
                    OpKind::Join => {
                        self.joined.remove(&ps);
                        // Before the caller wakes: its next unnamed request counts anew.
                        self.shared.names.lock().unwrap().joined(ps);
                    }
                    OpKind::AddProcessSet | OpKind::FormProcessSet => {
                        let ranks = req.ints.iter().map(|&r| r as usize).collect();
                        self.shared
                            .sets
                            .lock()
                            .unwrap()
                            .insert(*value as u32, ranks);
                    }
                    OpKind::RemoveProcessSet => {
                        self.shared.sets.lock().unwrap().remove(&(*value as u32));
                        self.groups.forget(*value as u32);
                    }
                    OpKind::Shutdown => self.exit = true,
                    _ => {}
                }
                let out = Output {
                    value: *value,
                    ..Output::default()
                };
                self.finish(&ps, name, e.handle, Ok(out));
            }
            Response::Abort { message } => self.fail_all(PerseusError::Aborted(message.clone())),
            Response::Offline { groups } => {
                if matches!(self.mode, Mode::Negotiated) {
                    self.mode = Mode::Offered(groups.clone());
                    // From here requests are held: a caller waiting on one must say so.
                    self.shared.offline.store(true, Ordering::Relaxed);
                    let ack = Request::new(OpKind::OfflineAck, "offline", 0);
                    self.transmit(vec![ack]);
                }
            }
            Response::Switch { go, skip } => {
                match std::mem::replace(&mut self.mode, Mode::Negotiated) {
                    Mode::Offered(groups) if *go => {
                        self.mode = Mode::Running(Schedule::new(groups, skip.clone()));
                        self.voted_at = Instant::now();
                        self.shared.offline.store(true, Ordering::Relaxed);
                    }
                    _ => self.fall_back(),
                }
            }
            Response::Params { cycle_us, flat, .. } => {
                self.cycle = Duration::from_micros(*cycle_us);
                self.auto_flat = *flat;
                let c = &self.shared.counters;
                c.autotune_changes.fetch_add(1, Ordering::Relaxed);
            }
            Response::Cached {
                process_set,
                name,
                id,
            } => {
                let key = (*process_set, name.clone());
                if let Some((req, _, _)) = self.entries.get(&key) {
                    self.cache.insert(key, (*id, req.clone()));
                }
            }
        }
    }
}

/// Runs a response whose tensors are on every rank's device: over NCCL when the
/// set has a group, else through host memory.
#[allow(clippy::too_many_arguments)]
fn run_device(
    groups: &mut direct::Groups,
    bufs: &mut exec::Buffers,
    counters: &Counters,
    ps: u32,
    comm: &SubComm<'_>,
    resp: &Response,
    entries: &[Option<Entry>],
) -> exec::Outcome {
    let mut devices = entries
        .iter()
        .flatten()
        .flat_map(|e| e.input.iter().chain(e.output.iter()))
        .map(|v| v.device)
        .filter(|d| *d != Device::Cpu);
    let device = devices.next().unwrap_or(Device::Cpu);
    let other = devices.find(|d| *d != device);
    // PERSEUS_ALLREDUCE_MODE=1: NCCL within each host, the CPU transport between.
    let hierarchical = matches!(
        resp,
        Response::Op { kind: OpKind::Allreduce, plan, .. }
            if plan.mode == crate::plan::Mode::Hierarchical
    ) && crate::collective::fits(&crate::collective::hosts_of(comm));
    let ended = || ended_peers(comm);
    let watch = Watch {
        limit: groups.limit(),
        ended: &ended,
    };
    match groups.get(ps, comm, device, hierarchical, &watch) {
        Ok(Some(group)) if other.is_some() => {
            let e = PerseusError::InvalidArgument(format!(
                "one fused collective holds tensors on {device} and on {}: NCCL runs a \
                 rank's part on one GPU, so keep each rank's tensors on one device",
                other.expect("matched")
            ));
            // The peers may have entered this collective: later ones of this rank must
            // not pair with it in NCCL.
            group.abandon(&e.to_string());
            exec::Outcome {
                results: entries.iter().map(|_| Err(e.clone())).collect(),
                resent: None,
            }
        }
        Ok(Some(group)) => {
            counters.nccl_operations.fetch_add(1, Ordering::Relaxed);
            if hierarchical {
                let cross = SubComm::new(comm, crate::collective::host_and_peers(comm).1);
                let route = direct::Route::Hierarchical(&*group, &cross);
                direct::run_direct(route, comm.size(), resp, entries, bufs, &watch)
            } else {
                let route = direct::Route::Flat(&*group);
                direct::run_direct(route, comm.size(), resp, entries, bufs, &watch)
            }
        }
        Ok(None) => {
            let resolve = staged::device_memory;
            staged::run_staged(comm, resp, entries, bufs, &resolve)
        }
        Err(e) => exec::Outcome {
            results: entries.iter().map(|_| Err(e.clone())).collect(),
            resent: None,
        },
    }
}

/// The members of a process set whose processes have ended, in words naming their
/// global ranks, or `None` while all are alive.
fn ended_peers(comm: &SubComm<'_>) -> Option<String> {
    let gone = comm.ended();
    if gone.is_empty() {
        return None;
    }
    let ranks: Vec<String> = gone
        .iter()
        .map(|&i| format!("rank {}", comm.members()[i]))
        .collect();
    Some(format!("the process of {} has ended", ranks.join(" and ")))
}

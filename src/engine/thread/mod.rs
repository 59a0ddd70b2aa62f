//! The engine thread: it takes callers' requests from the inbox, sends them up to the
//! coordinator (on rank 0 it runs the coordinator in place), receives the answers and
//! runs them in the order the coordinator fixed ([`execute`]). It sleeps in one poll(2)
//! over the inbox's eventfd and the control streams, so it wakes at once for either.

mod execute;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::control::{Incoming, Uplink};
use super::inbox::Inbox;
use super::message::{OpKind, Request, Response, WireRequest};
use super::offline::Mode;
use super::{direct, exec, Entry, Event, Output, Shared};
use crate::collective;
use crate::config::Config;
use crate::error::{PerseusError, Result};
use crate::transport::Mesh;

/// How long the engine stays awake (yielding the core) waiting for an
/// answer that is due, before it sleeps in poll(2).
const ANSWER_SPIN: Duration = Duration::from_micros(200);

/// How long the engine stays awake (yielding the core) after its last event,
/// before it sleeps in poll(2): in a loop of synchronous calls the caller's next
/// operation comes within tens of microseconds and then finds it awake, where
/// waking a thread asleep on an idle virtual CPU took 30-40 µs (a lone 4 KiB
/// allreduce on one rank: 55 µs sleeping, 11 µs staying awake; benchmarks/NOTES.md).
/// Only where the host has a spare core for each rank ([`Config::spare_cores`]):
/// with one core a rank, a job that alternated compute and small allreduces lost
/// about 5% to it.
const IDLE_SPIN: Duration = Duration::from_micros(100);

/// The engine thread's own state.
pub(super) struct State {
    mesh: Mesh,
    uplink: Uplink,
    inbox: Arc<Inbox<Event>>,
    /// Rank 0: the coordinator's answers to this rank, not yet run.
    local: Vec<Response>,
    shared: Arc<Shared>,
    entries: HashMap<(u32, String), (Request, Entry, Instant)>,
    joined: HashSet<u32>,
    cache: HashMap<(u32, String), (u32, Request)>,
    bufs: exec::Buffers,
    cycle: Duration,
    /// HOROVOD_AUTOTUNE chose the flat ring for allreduces of an automatic mode.
    auto_flat: bool,
    /// How long to stay awake for an answer that is due (zero when the host's
    /// cores are oversubscribed: a yielding rank steals its neighbour's slice).
    spin: Duration,
    /// How long to stay awake after the last event ([`IDLE_SPIN`]; zero without
    /// a spare core for each rank).
    idle_spin: Duration,
    exit: bool,
    /// The float16 overflow warning was given.
    warned_overflow: bool,
    /// PERSEUS_ALLREDUCE_GRADIENT_SCALE, for that warning.
    gradient_scale: f64,
    /// Offline negotiation (PERSEUS_OFFLINE_NEG): negotiating, offered, or running.
    mode: Mode,
    /// Requests held while the mode holds them, in the order they came.
    parked: Vec<Request>,
    /// Handles callers reported waiting on while running offline.
    waited: HashSet<u64>,
    /// Rank 0: when the stall check last ran.
    stall_checked: Instant,
    /// Running offline, a rank that has not voted for this long votes to leave the
    /// schedule, so that a rank that stopped submitting is named by the stall check,
    /// which only the coordinator runs (the shorter of the stall limits; none
    /// without them).
    offline_patience: Option<Duration>,
    /// When this rank last voted in the offline schedule, or began running it.
    voted_at: Instant,
    /// Each process set's NCCL group, or why its CUDA tensors are staged.
    groups: direct::Groups,
}

impl State {
    /// The state of a rank's engine thread, over its `mesh` and control `uplink`.
    pub(super) fn new(
        mesh: Mesh,
        uplink: Uplink,
        inbox: Arc<Inbox<Event>>,
        shared: Arc<Shared>,
        config: &Config,
    ) -> State {
        // More ranks than cores here: every wait sleeps at once (see Config::oversubscribed).
        let oversubscribed = config.oversubscribed();
        State {
            mesh: if oversubscribed {
                mesh.without_spin()
            } else {
                mesh
            },
            uplink,
            inbox,
            local: Vec::new(),
            shared,
            entries: HashMap::new(),
            joined: HashSet::new(),
            cache: HashMap::new(),
            bufs: exec::Buffers::default(),
            cycle: config.cycle_time,
            auto_flat: false,
            spin: if oversubscribed {
                Duration::ZERO
            } else {
                ANSWER_SPIN
            },
            idle_spin: if config.spare_cores() {
                IDLE_SPIN
            } else {
                Duration::ZERO
            },
            exit: false,
            warned_overflow: false,
            gradient_scale: config.plan.scale,
            mode: Mode::Negotiated,
            parked: Vec::new(),
            waited: HashSet::new(),
            stall_checked: Instant::now(),
            offline_patience: [config.stall.warn, config.stall.fail]
                .into_iter()
                .flatten()
                .min(),
            voted_at: Instant::now(),
            groups: direct::Groups::new(
                config.nccl,
                config.nccl_channels,
                config.timeout,
                crate::device::opener(config.nccl_nonblocking),
            ),
        }
    }
}

/// How often rank 0 looks for stalled tensors while some wait.
const STALL_TICK: Duration = Duration::from_secs(1);

impl State {
    pub(super) fn run(mut self) {
        // The hold below must end on time: ask for 1 µs timer slack (default 50 µs).
        // SAFETY: prctl on the calling thread only.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong) };
        self.cycle_loop();
        // Whatever callers queued after the engine stopped fails instead of hanging.
        self.inbox.close();
        let err = self.shared.fatal.lock().unwrap().clone();
        let err =
            err.unwrap_or_else(|| PerseusError::Aborted("the Perseus engine has stopped".into()));
        for ev in self.inbox.take() {
            if let Event::Enqueue(b) = ev {
                let (req, entry, _) = *b;
                self.finish(&req.process_set, &req.name, entry.handle, Err(err.clone()));
            }
        }
    }

    /// Requests are sent at once while nothing is awaiting an answer. While
    /// something is, new ones are held until an answer arrives or the cycle
    /// time passes, so a burst (many small tensors, gradients of small layers)
    /// negotiates and fuses in a few batches instead of one message each. The
    /// time limit keeps ranks that submit in different orders from waiting on
    /// each other.
    fn cycle_loop(&mut self) {
        let mut held: Vec<Request> = Vec::new();
        let mut held_since = Instant::now();
        let mut idle_since: Option<Instant> = None;
        loop {
            // Events wait in memory for at most timeline::FLUSH_EVERY.
            self.shared.timeline.tick();
            let mut got = false;
            for ev in self.inbox.take() {
                got = true;
                if held.is_empty() {
                    held_since = Instant::now();
                }
                self.handle(ev, &mut held);
                if self.exit {
                    return;
                }
            }
            if self.mode.holds() {
                self.parked.append(&mut held);
            }
            let answered = self.receive(&mut held);
            let watch_in = self.watch_peers();
            self.note_traffic();
            self.check_stalls();
            if self.exit {
                return;
            }
            if self.run_offline() {
                continue;
            }
            if got || answered {
                idle_since = None;
                let awaiting = self.entries.len() > held.len();
                if !awaiting || answered || held_since.elapsed() >= self.cycle {
                    self.send_up(std::mem::take(&mut held));
                }
                continue;
            }
            if !held.is_empty() {
                let left = self.cycle.saturating_sub(held_since.elapsed());
                if left.is_zero() {
                    self.send_up(std::mem::take(&mut held));
                } else {
                    // Held requests wait for an answer or the deadline; what
                    // callers add meanwhile joins them without waking us.
                    self.uplink.sleep::<Event>(None, Some(left));
                }
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            let awake_for = if self.entries.is_empty() {
                self.idle_spin
            } else {
                self.spin.max(self.idle_spin)
            };
            if since.elapsed() < awake_for {
                // An answer is due soon, or the caller's next operation may be:
                // stay awake for it rather than sleep, since a sleeping thread on
                // an idle virtual CPU takes tens of microseconds to wake.
                std::thread::yield_now();
            } else {
                let stalls = self.stall_watch().then_some(STALL_TICK);
                // Wake to write the timeline's last events, if any wait, and to
                // leave a quiet offline schedule.
                let tick = [
                    stalls,
                    self.shared.timeline.due(),
                    self.offline_quiet_in(),
                    watch_in,
                ]
                .into_iter()
                .flatten()
                .min();
                self.uplink.sleep(Some(&self.inbox), tick);
                idle_since = None;
            }
        }
    }

    /// Rank 0 with the stall check on and tensors waiting for ranks.
    fn stall_watch(&self) -> bool {
        self.uplink
            .coordinator_ref()
            .is_some_and(|c| c.stall_watch())
    }

    /// Rank 0, once per [`STALL_TICK`] while tensors wait: warns about those
    /// waiting past PERSEUS_STALL_CHECK_TIME_SECONDS, and stops the job when
    /// one waits past PERSEUS_STALL_SHUTDOWN_TIME_SECONDS.
    fn check_stalls(&mut self) {
        if !self.stall_watch() || self.stall_checked.elapsed() < STALL_TICK {
            return;
        }
        self.stall_checked = Instant::now();
        let Some(coord) = self.uplink.coordinator() else {
            return;
        };
        let found = coord.check_stalls(Instant::now());
        let warned = found.warnings.len() as u64;
        self.shared
            .counters
            .stall_warnings
            .fetch_add(warned, Ordering::Relaxed);
        for w in &found.warnings {
            crate::log!(
                crate::log::Level::Warning,
                "stall: {w}. Every rank must submit the same collectives; \
                 a rank may be stuck, slow, or on another code path \
                 (PERSEUS_STALL_CHECK_TIME_SECONDS)."
            );
        }
        if !found.abort.is_empty() {
            self.uplink.dispatch(found.abort, &mut self.local);
            self.run_local(&mut Vec::new());
        }
    }

    /// Takes what the control streams hold: rank 0 feeds requests to its
    /// coordinator; everyone runs the answers addressed to them. True when
    /// answers arrived.
    fn receive(&mut self, held: &mut Vec<Request>) -> bool {
        let mut answered = self.run_local(held);
        for inc in self.uplink.receive() {
            match inc {
                Incoming::Requests(rank, reqs) => {
                    if let Some(coord) = self.uplink.coordinator() {
                        let out = coord.submit_wire(rank, reqs);
                        self.uplink.dispatch(out, &mut self.local);
                    }
                }
                Incoming::Responses(rs) => {
                    answered = true;
                    self.send_up(std::mem::take(held));
                    rs.into_iter().for_each(|r| self.execute(r));
                }
                Incoming::Lost(rank, why) => self.lost(rank, &why),
                Incoming::Reported(rank, why) => self.reported(rank, &why),
                Incoming::Silent(rank, why) => self.silenced(rank, &why),
            }
            if self.exit {
                return answered;
            }
            answered |= self.run_local(held);
        }
        answered
    }

    /// The control stream of rank `rank` broke, or it stopped answering (`why`): rank 0
    /// tells every rank the job cannot continue; a worker fails what it has pending.
    fn lost(&mut self, rank: usize, why: &str) {
        if self.shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let why = self
            .mesh
            .also_ended(on_host(&self.mesh, rank, why), Some(rank));
        if let Some(coord) = self.uplink.coordinator() {
            let out = coord.disconnect(rank, &why);
            self.uplink.dispatch(out, &mut self.local);
        } else if self.uplink.parent() == Some(rank) {
            self.fail_all(lost_coordinator(rank, &why));
        } else {
            // A rank below this one: rank 0 hears of it, and tells every rank.
            self.uplink.report_gone(rank, &why);
        }
    }

    /// Rank 0: a relay reported rank `rank` gone (`why`, which names its host): the
    /// job cannot continue.
    fn reported(&mut self, rank: usize, why: &str) {
        if self.shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        if let Some(coord) = self.uplink.coordinator() {
            let out = coord.disconnect(rank, why);
            self.uplink.dispatch(out, &mut self.local);
        }
    }

    /// Rank `rank` answered nothing for the timeout (`why`): it goes into the silent
    /// ranks ([`super::Engine::silent_ranks`]) and counts as lost.
    fn silenced(&mut self, rank: usize, why: &str) {
        self.shared.silent.lock().unwrap().insert(rank);
        self.lost(rank, why);
    }

    /// Whether the ranks this one waits for are there ([`Uplink::watch`]): a worker
    /// waits while it has operations pending. Returns how long until the next look.
    fn watch_peers(&mut self) -> Option<Duration> {
        let (silent, next) = self.uplink.watch(!self.entries.is_empty());
        for inc in silent {
            if let Incoming::Silent(rank, why) = inc {
                self.silenced(rank, &why);
            }
        }
        if !self.local.is_empty() {
            self.run_local(&mut Vec::new());
        }
        next
    }

    /// Rank 0: runs its own share of what the coordinator answered, right after
    /// each dispatch (`held`: requests to send up after, as an answer lets them
    /// go). The workers then hold each batch whole and rank 0 joins its
    /// collectives before it writes the next, so it never waits to write to a
    /// worker that waits for it in a collective. True when something ran.
    fn run_local(&mut self, held: &mut Vec<Request>) -> bool {
        let mut ran = false;
        while !self.local.is_empty() && !self.exit {
            ran = true;
            for r in std::mem::take(&mut self.local) {
                self.execute(r);
            }
        }
        // Only now: sending up dispatches again on rank 0.
        if ran && !self.exit {
            self.send_up(std::mem::take(held));
        }
        ran
    }

    fn handle(&mut self, ev: Event, batch: &mut Vec<Request>) {
        match ev {
            Event::Enqueue(b) => {
                let (req, entry, at) = *b;
                if let Some(e) = self.shared.fatal.lock().unwrap().clone() {
                    self.finish(&req.process_set, &req.name, entry.handle, Err(e));
                    return;
                }
                if req.kind == OpKind::Join {
                    self.joined.insert(req.process_set);
                }
                batch.push(req.clone());
                self.entries
                    .insert((req.process_set, req.name.clone()), (req, entry, at));
            }
            Event::SetFusion(bytes) => {
                if let Some(coord) = self.uplink.coordinator() {
                    coord.set_fusion_threshold(bytes as usize);
                }
            }
            Event::Fatal(msg) => self.fail_all(PerseusError::Aborted(msg)),
            Event::Waiting(h) => {
                self.waited.insert(h);
            }
            Event::Panic(what) => panic!("{what}"),
        }
    }

    /// Sends requests to the coordinator, or holds them while offline
    /// negotiation does (see [`offline`]).
    fn send_up(&mut self, mut batch: Vec<Request>) {
        if self.mode.holds() {
            self.parked.append(&mut batch);
            return;
        }
        self.transmit(batch);
    }

    /// Runs the offline schedule as far as the held requests allow: before
    /// the next groups every rank votes; one that cannot go on sends all back
    /// to negotiation. True when it did something.
    fn run_offline(&mut self) -> bool {
        let mut did = false;
        while let Mode::Running(schedule) = &mut self.mode {
            if self.exit {
                break;
            }
            let off = self.parked.iter().any(|r| !schedule.fits(r));
            let held: HashSet<&str> = self.parked.iter().map(|r| r.name.as_str()).collect();
            let ready = if off {
                0
            } else {
                schedule.ready_ahead(|g| match g {
                    Response::Op { names, .. } => names.iter().all(|n| held.contains(n.as_str())),
                    _ => false,
                })
            };
            drop(held);
            let quiet = self.offline_quiet_in() == Some(Duration::ZERO);
            if ready == 0 && !off && !self.caller_blocked() && !quiet {
                break;
            }
            if ready == 0 && quiet {
                crate::log!(
                    crate::log::Level::Debug,
                    "rank {}: no offline vote for {:?}: leaving the schedule, so that \
                     negotiation names whatever ranks stopped submitting",
                    self.mesh.rank(),
                    self.voted_at.elapsed()
                );
            }
            did = true;
            let voted = offline_vote(
                &self.mesh,
                &mut self.uplink,
                &mut self.local,
                &self.shared.silent,
                ready,
            );
            self.voted_at = Instant::now();
            let voted = voted.map(|(k, sent)| {
                let c = &self.shared.counters;
                c.vote_messages.fetch_add(sent as u64, Ordering::Relaxed);
                let each = crate::transport::message_bytes(1) as u64;
                c.vote_bytes
                    .fetch_add(sent as u64 * each, Ordering::Relaxed);
                k
            });
            match voted {
                Err(e) => self.fail_all(e),
                Ok(0) => self.fall_back(),
                Ok(k) => {
                    for _ in 0..k {
                        let Mode::Running(s) = &mut self.mode else {
                            break;
                        };
                        let group = s.next();
                        s.advance();
                        if let Response::Op { names, .. } = &group {
                            let ran: HashSet<&String> = names.iter().collect();
                            self.parked.retain(|r| !ran.contains(&r.name));
                            let skipped = &self.shared.counters.negotiations_skipped;
                            skipped.fetch_add(names.len() as u64, Ordering::Relaxed);
                        }
                        self.execute(group);
                    }
                }
            }
        }
        did
    }

    /// Publishes what the control streams carried so far (`Engine::counters`).
    pub(super) fn note_traffic(&self) {
        let (sent, received) = self.uplink.traffic();
        let c = &self.shared.counters;
        c.control_frames_sent.store(sent.frames, Ordering::Relaxed);
        c.control_bytes_sent.store(sent.bytes, Ordering::Relaxed);
        c.control_frames_received
            .store(received.frames, Ordering::Relaxed);
        c.control_bytes_received
            .store(received.bytes, Ordering::Relaxed);
    }

    /// Running offline with the stall check on: how long until this rank, without a
    /// vote, leaves the schedule (zero: now).
    fn offline_quiet_in(&self) -> Option<Duration> {
        match self.mode {
            Mode::Running(_) => self
                .offline_patience
                .map(|p| p.saturating_sub(self.voted_at.elapsed())),
            _ => None,
        }
    }

    /// True when a caller waits on a held tensor: its group cannot complete
    /// before that caller goes on, so the schedule must be left.
    fn caller_blocked(&mut self) -> bool {
        if self.waited.is_empty() {
            return false;
        }
        let pending: HashSet<u64> = self.entries.values().map(|(_, e, _)| e.handle).collect();
        self.waited.retain(|h| pending.contains(h));
        self.parked.iter().any(|r| {
            self.entries
                .get(&(r.process_set, r.name.clone()))
                .is_some_and(|(_, e, _)| self.waited.contains(&e.handle))
        })
    }

    /// Leaves the offline schedule (on every rank at the same group): what
    /// was held goes to the coordinator in the order it came.
    fn fall_back(&mut self) {
        self.mode = Mode::Negotiated;
        self.shared.offline.store(false, Ordering::Relaxed);
        self.waited.clear();
        let held = std::mem::take(&mut self.parked);
        self.transmit(held);
    }

    fn transmit(&mut self, batch: Vec<Request>) {
        if batch.is_empty() {
            return;
        }
        let sent = &self.shared.counters.negotiation_messages;
        sent.fetch_add(1, Ordering::Relaxed);
        self.shared.timeline.mark_cycle(batch.len());
        if let Some(coord) = self.uplink.coordinator() {
            let out = coord.submit(0, batch);
            self.uplink.dispatch(out, &mut self.local);
            self.run_local(&mut Vec::new());
        } else {
            let wire: Vec<WireRequest> = batch
                .into_iter()
                .map(|r| match self.cache.get(&(r.process_set, r.name.clone())) {
                    Some((id, cached)) if *cached == r => {
                        self.shared.cache_hits.fetch_add(1, Ordering::Relaxed);
                        WireRequest::Cached(*id)
                    }
                    _ => WireRequest::Full(r),
                })
                .collect();
            // Queued, never waited for: the parent may be in a collective with this rank.
            if let Err(e) = self.uplink.post_requests(&wire) {
                let parent = self.uplink.parent().unwrap_or(0);
                let why = self.mesh.also_ended(e, Some(parent));
                self.fail_all(lost_coordinator(parent, &why));
            }
        }
        self.note_traffic();
    }

    fn finish(&self, ps: &u32, name: &str, handle: u64, r: Result<Output>) {
        self.shared.finish(*ps, name, handle, r);
    }

    fn fail_all(&mut self, e: PerseusError) {
        self.shared.fatal.lock().unwrap().get_or_insert(e.clone());
        self.mode = Mode::Negotiated;
        self.shared.offline.store(false, Ordering::Relaxed);
        self.parked.clear();
        for ((ps, name), (_, entry, _)) in std::mem::take(&mut self.entries) {
            self.finish(&ps, &name, entry.handle, Err(e.clone()));
        }
        if self.shared.stopping.load(Ordering::SeqCst) {
            self.exit = true;
        }
    }
}

/// Why a rank's control stream broke, with the host it ran on.
fn on_host(mesh: &Mesh, rank: usize, why: &str) -> String {
    match mesh.host_name(rank) {
        Some(h) => format!("{why}; it ran on host {h}"),
        None => why.to_string(),
    }
}

/// The error every pending operation gets when the control stream to `parent` fails:
/// rank 0 (the coordinator) or the rank that relays to it.
fn lost_coordinator(parent: usize, why: &str) -> PerseusError {
    match parent {
        0 => PerseusError::Aborted(format!(
            "lost the connection to rank 0 (the coordinator): {why}"
        )),
        p => PerseusError::Aborted(format!(
            "lost the connection to rank {p}, which relays this rank's requests to rank 0 \
             (the coordinator): {why}"
        )),
    }
}

/// An offline vote's byte for "cannot go on": an offer of `k` groups is this less `k`.
const VOTE_LEAVE: u8 = u8::MAX;

/// One offline vote with every rank: each offers how many groups in a row it holds
/// whole (`ready`; 0: it cannot go on), and all learn the fewest offered, which is how
/// many groups every rank now runs (0: all leave the schedule). It travels as the
/// largest of one byte each, [`VOTE_LEAVE`] less the offer; also returned: the
/// messages this rank sent for it. Peers may be busy
/// computing for a long time, so it waits patiently, reading the control streams
/// meanwhile: a lost rank or an abort ends it with that error. Ranks that answer
/// nothing for the timeout count as lost, and go into `silent`.
fn offline_vote(
    mesh: &Mesh,
    uplink: &mut Uplink,
    local: &mut Vec<Response>,
    silent: &Mutex<BTreeSet<usize>>,
    ready: usize,
) -> Result<(usize, usize)> {
    let mut alive = || -> Result<()> {
        // Every rank waits in a vote: peers that answer nothing count as gone. What
        // arrived is read first: an answer that waits there is an answer.
        let arrived = uplink.receive();
        let (quiet, _) = uplink.watch(true);
        for inc in arrived.into_iter().chain(quiet) {
            if let Incoming::Silent(rank, _) = &inc {
                silent.lock().unwrap().insert(*rank);
            }
            match inc {
                Incoming::Requests(rank, reqs) => {
                    // A rank that already left the schedule negotiates again.
                    if let Some(coord) = uplink.coordinator() {
                        let out = coord.submit_wire(rank, reqs);
                        uplink.dispatch(out, local);
                    }
                }
                Incoming::Responses(rs) => {
                    for resp in rs {
                        if let Response::Abort { message } = &resp {
                            return Err(PerseusError::Aborted(message.clone()));
                        }
                        local.push(resp);
                    }
                }
                Incoming::Reported(rank, why) => {
                    if let Some(coord) = uplink.coordinator() {
                        let out = coord.disconnect(rank, &why);
                        uplink.dispatch(out, local);
                    }
                    return Err(PerseusError::Peer(format!("rank {rank} is gone ({why})")));
                }
                Incoming::Lost(rank, why) | Incoming::Silent(rank, why) => {
                    let why = mesh.also_ended(on_host(mesh, rank, &why), Some(rank));
                    if let Some(coord) = uplink.coordinator() {
                        let out = coord.disconnect(rank, &why);
                        uplink.dispatch(out, local);
                        return Err(PerseusError::Peer(format!("rank {rank} is gone ({why})")));
                    }
                    if uplink.parent() == Some(rank) {
                        return Err(lost_coordinator(rank, &why));
                    }
                    // A rank below this one: rank 0 hears of it and aborts the vote.
                    uplink.report_gone(rank, &why);
                }
            }
        }
        Ok(())
    };
    let mine = VOTE_LEAVE - ready.min(usize::from(VOTE_LEAVE - 1)) as u8;
    collective::patient_max(mesh, mine, &mut alive)
        .map(|(max, sent)| (usize::from(VOTE_LEAVE - max), sent))
}

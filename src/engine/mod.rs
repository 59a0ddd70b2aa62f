//! The engine: one background thread per rank that sends requests to the
//! coordinator, runs the responses in the order the coordinator fixed, and
//! completes handles. Front-ends call [`Engine::enqueue`] and [`Engine::wait`].
//!
//! The engine thread is the only thread of a rank that touches the sockets:
//! it takes callers' requests from its [`inbox::Inbox`], reads and writes
//! the control streams itself (on rank 0 it runs the
//! [`coordinator::Coordinator`] in place), and sleeps in one poll(2) over
//! the inbox's eventfd and the control streams, so it wakes at once for
//! either.
//!
//! This module is the API callers use (start, enqueue, wait, counters, shutdown) and
//! the state they share with the thread; `thread` is the thread's loop, and
//! `thread::execute` runs one response. Names for unnamed requests are `naming`'s, the
//! checks a rank makes alone are `checks`'.

pub mod autotune;
mod checks;
mod control;
pub mod coordinator;
pub mod direct;
mod exec;
mod gather;
mod handles;
mod inbox;
mod lane;
pub mod message;
mod naming;
mod offline;
mod outgoing;
pub mod recorder;
pub mod staged;
mod thread;
pub mod timeline_names;

pub use crate::device::{Device, OwnedTensor, TensorView};
pub use exec::Entry;
pub use handles::Output;
pub use message::{OpKind, Request, Response};

use crate::config::Config;
use crate::error::{PerseusError, Result};
use crate::rendezvous::StoreServer;
use crate::timeline::Timeline;
use crate::transport::connect_mesh;
use checks::{check_locally, unregistered};
use control::Uplink;
use coordinator::Coordinator;
use handles::Handles;
use inbox::Inbox;
use lane::{CallerLane, Fit};
use naming::Unnamed;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thread::State;

/// How long a caller waiting for a handle yields before it sleeps: small
/// operations finish within microseconds.
const WAIT_SPIN: Duration = Duration::from_micros(100);

enum Event {
    Enqueue(Box<(Request, Entry, Instant)>),
    SetFusion(u64),
    Fatal(String),
    /// A caller waits on this handle (sent only while running offline).
    Waiting(u64),
    /// Panic on the engine thread (tests of the no-abort guarantee).
    Panic(String),
}

struct Shared {
    handles: Handles,
    sets: Mutex<BTreeMap<u32, Vec<usize>>>,
    inflight: Mutex<HashSet<(u32, String)>>,
    fatal: Mutex<Option<PerseusError>>,
    stopping: AtomicBool,
    timeline: Timeline,
    cache_hits: AtomicU64,
    counters: Counters,
    /// Holding requests for an offline schedule (offered or running): callers
    /// report their waits.
    offline: AtomicBool,
    /// The last handle a caller reported waiting on.
    last_waited: AtomicU64,
    /// The names given to unnamed requests.
    names: Mutex<Unnamed>,
    /// This rank's last operations.
    recorder: Mutex<recorder::Recorder>,
    /// Ranks this one found silent: they answered nothing for the timeout while it
    /// waited for them (see [`Engine::silent_ranks`]).
    silent: Mutex<BTreeSet<usize>>,
}

impl Shared {
    /// Completes `handle`, the operation `name` of set `ps`: its name may be used
    /// again, the flight recorder notes it, and its waiter wakes.
    fn finish(&self, ps: u32, name: &str, handle: u64, r: Result<Output>) {
        self.inflight
            .lock()
            .unwrap()
            .remove(&(ps, name.to_string()));
        self.recorder.lock().unwrap().finished(handle, r.is_ok());
        self.handles.complete(handle, r);
    }
}

/// What [`Engine::submit`] did with a request.
enum Submitted {
    /// Queued for the engine thread: wait on this handle.
    Queued(u64),
    /// Ran in the lane: done, with this id (no slot in the handle table) and output.
    Ran(u64, Output),
}

impl Submitted {
    /// The handle of a request that cannot have run in the lane (not blocking).
    fn handle(self) -> u64 {
        match self {
            Submitted::Queued(h) | Submitted::Ran(h, _) => h,
        }
    }
}

/// What the engine has done so far on this rank (see [`Engine::counters`]).
#[derive(Default)]
struct Counters {
    operations: AtomicU64,
    tensors: AtomicU64,
    fused_buffers: AtomicU64,
    fused_bytes_max: AtomicU64,
    negotiation_messages: AtomicU64,
    bytes_intra_host: AtomicU64,
    bytes_inter_host: AtomicU64,
    compression_resends: AtomicU64,
    negotiations_skipped: AtomicU64,
    bytes_extra_streams: AtomicU64,
    nccl_operations: AtomicU64,
    autotune_changes: AtomicU64,
    stall_warnings: AtomicU64,
    control_frames_sent: AtomicU64,
    control_bytes_sent: AtomicU64,
    control_frames_received: AtomicU64,
    control_bytes_received: AtomicU64,
    vote_messages: AtomicU64,
    vote_bytes: AtomicU64,
    lane_operations: AtomicU64,
    transfer_rounds: AtomicU64,
    linked_peers: AtomicU64,
}

/// A running engine.
pub struct Engine {
    /// The rendezvous this rank hosts (rank 0 under a foreign launcher).
    _store: Option<StoreServer>,
    config: Config,
    inbox: Arc<Inbox<Event>>,
    /// How long a waiting caller yields before it sleeps.
    wait_spin: Duration,
    shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Small blocking allreduces run by their callers (one-host jobs).
    lane: Option<CallerLane>,
}

impl Engine {
    /// Connects to the job and starts the engine thread.
    pub fn start(mut config: Config) -> Result<Engine> {
        crate::log::configure(config.log_level, config.log_time);
        let store = match (&config.rendezvous, config.host_store) {
            (Some((_, port)), true) => Some(
                StoreServer::start(&format!("0.0.0.0:{port}"), &config.secret).map_err(|e| {
                    PerseusError::Peer(format!(
                        "rank 0 could not host the rendezvous on port {port} \
                         (PERSEUS_MASTER_PORT): {e}"
                    ))
                })?,
            ),
            _ => None,
        };
        // Only rank 0's coordinator answers, so only it tunes (and writes the log);
        // before connecting, so that a log it cannot write fails it at once.
        let tuner = match (&config.autotune, config.topology.rank) {
            (Some(s), 0) => Some(autotune::Tuner::new(
                s.clone(),
                autotune::Knobs {
                    fusion: config.fusion_threshold,
                    cycle: config.cycle_time,
                    flat: false,
                },
            )?),
            _ => None,
        };
        let parts = connect_mesh(&config)?;
        if !config.topology.cross_given {
            let t = &mut config.topology;
            (t.cross_rank, t.cross_size) = crate::config::cross_from_hosts(&parts.hosts, t.rank);
        }
        let t = &config.topology;
        let shared = Arc::new(Shared {
            handles: Handles::default(),
            sets: Mutex::new(BTreeMap::from([(0, (0..t.size).collect())])),
            inflight: Mutex::new(HashSet::new()),
            fatal: Mutex::new(None),
            stopping: AtomicBool::new(false),
            timeline: Timeline::new(t.rank),
            cache_hits: AtomicU64::new(0),
            counters: Counters::default(),
            offline: AtomicBool::new(false),
            last_waited: AtomicU64::new(0),
            names: Mutex::new(Unnamed::default()),
            recorder: Mutex::default(),
            silent: Mutex::default(),
        });
        if let Some(path) = &config.timeline {
            shared.timeline.start(path, config.timeline_mark_cycles)?;
        }
        crate::log!(
            crate::log::Level::Debug,
            "rank {} of {} (local rank {} of {}, host {} of {}): connected; fusion threshold \
             {} bytes, cycle time {:?}",
            t.rank,
            t.size,
            t.local_rank,
            t.local_size,
            t.cross_rank,
            t.cross_size,
            config.fusion_threshold,
            config.cycle_time
        );
        let inbox = Arc::new(Inbox::new()?);
        // More ranks than cores here: every wait sleeps at once (see Config::oversubscribed).
        let oversubscribed = config.oversubscribed();
        let spin = |d: Duration| if oversubscribed { Duration::ZERO } else { d };
        let fits = crate::collective::fits(&crate::collective::hosts_of(&parts.mesh));
        let tuner = tuner.map(|tuner| tuner.with_mode_choice(fits));
        let coord = Coordinator::new(t.size, config.fusion_threshold as usize)
            .with_cache(config.cache_capacity)
            .with_offline(config.offline_neg)
            .with_autotune(tuner)
            .with_stall_limits(config.stall);
        let lane = CallerLane::new(parts.mesh.lane(), &config, t.size);
        let uplink = Uplink::new(parts.control, coord, config.timeout, config.cycle_time)?;
        let state = State::new(parts.mesh, uplink, inbox.clone(), shared.clone(), &config);
        let (on_panic, inbox_of_thread) = (shared.clone(), inbox.clone());
        let core = config.thread_affinity;
        let thread = std::thread::Builder::new()
            .name("perseus-engine".into())
            .spawn(move || {
                if let Some(core) = core {
                    crate::config::pin_current_thread(core);
                }
                let run = std::panic::AssertUnwindSafe(|| state.run());
                if let Err(p) = std::panic::catch_unwind(run) {
                    engine_died(&on_panic, &inbox_of_thread, &panic_text(&*p));
                }
            })?;
        if config.bind_cores {
            // The caller's thread only, after the engine's started (it and its pool keep
            // every core), and after every decision that counts the host's cores.
            crate::config::bind_to_share(t.local_rank, t.local_size);
        }
        Ok(Engine {
            _store: store,
            config,
            inbox,
            wait_spin: spin(WAIT_SPIN),
            shared,
            thread: Mutex::new(Some(thread)),
            lane,
        })
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The ranks this one found silent, in order: while it waited for them, they
    /// answered nothing for the timeout (stopped or frozen, or their host cannot be
    /// reached), and they counted as gone. An elastic worker tells the launcher, which
    /// stops them.
    pub fn silent_ranks(&self) -> Vec<usize> {
        self.shared.silent.lock().unwrap().iter().copied().collect()
    }

    /// This rank's last operations, oldest first (the flight recorder).
    pub fn flight_record(&self) -> Vec<recorder::Record> {
        self.shared.recorder.lock().unwrap().snapshot()
    }

    /// Counters of this rank: collectives run (`operations`), tensors they
    /// carried, `fused_buffers` (collectives carrying several tensors) and the
    /// largest one's payload (`fused_bytes_max`),
    /// `negotiation_messages` sent to the coordinator, `cache_hits` (requests sent
    /// as response-cache ids), and payload bytes sent to ranks on this host
    /// (`bytes_intra_host`) and on other hosts (`bytes_inter_host`), and
    /// `compression_resends`: float16 allreduces that overflowed and were
    /// resent uncompressed, `negotiations_skipped`: tensors run from an
    /// offline schedule without asking the coordinator, and
    /// `bytes_extra_streams`: payload bytes sent on streams other than the
    /// first (PERSEUS_ALLREDUCE_STREAMS), and `nccl_operations`: collectives
    /// of CUDA tensors carried by NCCL (the device-direct path), and
    /// `autotune_changes`: settings HOROVOD_AUTOTUNE sent this rank, and
    /// `stall_warnings` (rank 0): stall warnings given. The control plane:
    /// `control_frames_sent`/`_received` and `control_bytes_sent`/`_received`
    /// (headers included) on the negotiation streams to and from rank 0, and
    /// `vote_messages` and `vote_bytes` this rank sent in the offline schedule's
    /// votes (PERSEUS_OFFLINE_NEG), and `lane_operations`: operations its callers
    /// ran among the ranks themselves (PERSEUS_LANE_BYTES; also in `operations`).
    /// The transport: `transfer_rounds`, the rounds of messages (each waiting for
    /// the last) this rank's collectives ran, and `linked_peers`, the peers it holds
    /// data links to (made as its collectives first needed them).
    pub fn counters(&self) -> BTreeMap<String, u64> {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        [
            ("operations", get(&c.operations)),
            ("tensors", get(&c.tensors)),
            ("fused_buffers", get(&c.fused_buffers)),
            ("fused_bytes_max", get(&c.fused_bytes_max)),
            ("negotiation_messages", get(&c.negotiation_messages)),
            ("cache_hits", get(&self.shared.cache_hits)),
            ("bytes_intra_host", get(&c.bytes_intra_host)),
            ("bytes_inter_host", get(&c.bytes_inter_host)),
            ("compression_resends", get(&c.compression_resends)),
            ("negotiations_skipped", get(&c.negotiations_skipped)),
            ("bytes_extra_streams", get(&c.bytes_extra_streams)),
            ("nccl_operations", get(&c.nccl_operations)),
            ("autotune_changes", get(&c.autotune_changes)),
            ("stall_warnings", get(&c.stall_warnings)),
            ("control_frames_sent", get(&c.control_frames_sent)),
            ("control_bytes_sent", get(&c.control_bytes_sent)),
            ("control_frames_received", get(&c.control_frames_received)),
            ("control_bytes_received", get(&c.control_bytes_received)),
            ("vote_messages", get(&c.vote_messages)),
            ("vote_bytes", get(&c.vote_bytes)),
            ("lane_operations", get(&c.lane_operations)),
            ("transfer_rounds", get(&c.transfer_rounds)),
            ("linked_peers", get(&c.linked_peers)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// Requests this rank sent as response-cache ids instead of in full.
    pub fn cache_hits(&self) -> u64 {
        self.shared.cache_hits.load(Ordering::Relaxed)
    }

    /// The timeline.
    pub fn timeline(&self) -> &Timeline {
        &self.shared.timeline
    }

    /// Members (global ranks) of a process set.
    pub fn process_set(&self, id: u32) -> Result<Vec<usize>> {
        self.shared
            .sets
            .lock()
            .unwrap()
            .get(&id)
            .cloned()
            .ok_or_else(|| unregistered(id))
    }

    /// Ids of every registered process set.
    pub fn process_set_ids(&self) -> Vec<u32> {
        self.shared.sets.lock().unwrap().keys().copied().collect()
    }

    /// Enqueues an allreduce of gradients: it travels as the job's gradient plan says
    /// (PERSEUS_ALLREDUCE_DTYPE, _GRADIENT_SCALE, _MODE), where [`Engine::enqueue`]'s
    /// allreduces are exact.
    pub fn enqueue_gradient(
        &self,
        req: Request,
        input: Option<TensorView>,
        output: Option<TensorView>,
    ) -> Result<u64> {
        self.submit(req, input, output, true, false)
            .map(Submitted::handle)
    }

    /// Checks a request, names it if unnamed, and queues it; returns its handle. Its
    /// type, shape and device are its tensors'; an allreduce is exact, in the job's
    /// allreduce mode.
    pub fn enqueue(
        &self,
        req: Request,
        input: Option<TensorView>,
        output: Option<TensorView>,
    ) -> Result<u64> {
        self.submit(req, input, output, false, false)
            .map(Submitted::handle)
    }

    /// [`Engine::enqueue`] for a caller that waits for the operation at once: a
    /// small allreduce, allgather, broadcast, reduce-scatter or alltoall of a one-host
    /// job may then run among the callers before this returns (PERSEUS_LANE_BYTES), its
    /// handle already complete. Waits up to PERSEUS_LANE_PATIENCE_US for the other ranks;
    /// call it without holding locks that other threads need meanwhile.
    pub fn enqueue_blocking(
        &self,
        req: Request,
        input: Option<TensorView>,
        output: Option<TensorView>,
    ) -> Result<u64> {
        match self.submit(req, input, output, false, true)? {
            Submitted::Queued(handle) => Ok(handle),
            Submitted::Ran(handle, out) => {
                self.shared.handles.insert_done(handle, Ok(out));
                Ok(handle)
            }
        }
    }

    /// [`Engine::enqueue_blocking`] for a caller that needs nothing back but the
    /// outcome (an allreduce into a given output): `None` when the operation ran in
    /// the lane and is done, without a handle to wait on; else its handle.
    pub fn run_blocking(
        &self,
        req: Request,
        input: Option<TensorView>,
        output: Option<TensorView>,
    ) -> Result<Option<u64>> {
        Ok(match self.submit(req, input, output, false, true)? {
            Submitted::Queued(handle) => Some(handle),
            Submitted::Ran(..) => None,
        })
    }

    fn submit(
        &self,
        mut req: Request,
        input: Option<TensorView>,
        output: Option<TensorView>,
        gradient: bool,
        blocking: bool,
    ) -> Result<Submitted> {
        if req.kind == OpKind::Allreduce {
            req.plan = match gradient {
                true => self.config.plan,
                false => self.config.plan.exact(),
            };
        }
        if let Some(e) = self.shared.fatal.lock().unwrap().clone() {
            return Err(e);
        }
        describe(&mut req, input.as_ref(), output.as_ref())?;
        let rank = self.config.topology.rank;
        let set_size = {
            let sets = self.shared.sets.lock().unwrap();
            let Some(members) = sets.get(&req.process_set) else {
                return Err(unregistered(req.process_set));
            };
            if !members.contains(&rank) {
                return Err(PerseusError::InvalidArgument(format!(
                    "rank {rank} is not a member of process set {} (ranks {members:?})",
                    req.process_set
                )));
            }
            members.len()
        };
        if req.kind == OpKind::Alltoall && req.ints.is_empty() {
            req.ints = equal_splits(&req, set_size)?;
        }
        check_locally(&req, set_size)?;
        if req.kind == OpKind::Allgather {
            // Every rank's request says how it gathers; rank 0 checks they agree.
            req.plan.mode = if self.config.hierarchical_allgather {
                crate::plan::Mode::Hierarchical
            } else {
                crate::plan::Mode::Flat
            };
        }
        if req.name.is_empty() {
            let name = self
                .shared
                .names
                .lock()
                .unwrap()
                .next(req.process_set, req.kind);
            req.name = name;
        }
        let key = (req.process_set, req.name.clone());
        if !self.shared.inflight.lock().unwrap().insert(key) {
            return Err(PerseusError::NameInFlight(format!(
                "{} '{}' is already in flight on this rank; names must be unique among \
                 outstanding operations",
                req.kind.name(),
                req.name
            )));
        }
        let ran = blocking.then(|| self.in_lane(&req, input.as_ref(), output.as_ref()));
        if let Some(out) = ran.flatten() {
            // Done already: recorded as submitted and finished at once, under an id
            // that has no slot in the table (yet).
            let handle = self.shared.handles.reserve();
            {
                let mut recorder = self.shared.recorder.lock().unwrap();
                recorder.submitted(handle, &req);
                recorder.finished(handle, true);
            }
            let key = (req.process_set, req.name);
            self.shared.inflight.lock().unwrap().remove(&key);
            return Ok(Submitted::Ran(handle, out));
        }
        if let (Some(lane), OpKind::Join, 0) = (&self.lane, req.kind, req.process_set) {
            // A joined rank makes no attempt until it is back: the others' operations
            // then run on the engine (which serves the join) without waiting for it.
            lane.step_away();
        }
        let handle = self.shared.handles.create();
        self.shared.recorder.lock().unwrap().submitted(handle, &req);
        let entry = Entry {
            handle,
            input,
            output,
        };
        let sent = self
            .inbox
            .push(Event::Enqueue(Box::new((req, entry, Instant::now()))));
        if !sent {
            let fatal = self.shared.fatal.lock().unwrap().clone();
            return Err(fatal.unwrap_or_else(|| {
                PerseusError::Aborted("the Perseus engine has stopped".into())
            }));
        }
        Ok(Submitted::Queued(handle))
    }

    /// Runs `req` in the lane where it goes there; its result when it ran.
    fn in_lane(
        &self,
        req: &Request,
        input: Option<&TensorView>,
        output: Option<&TensorView>,
    ) -> Option<Output> {
        let lane = self.lane.as_ref()?;
        match lane.fit(req, input, output) {
            Fit::Never => return None,
            // A timeline shows every operation's negotiation and phases, as Horovod's
            // does: while one is recorded, the engine runs them all.
            Fit::Fits if !self.shared.timeline.active() => {}
            Fit::Fits | Fit::Declined => {
                lane.decline();
                return None;
            }
        }
        let out = lane.run(req, input, output)?;
        // The engine's line for every operation it runs, so that a trace shows them all.
        crate::log!(
            crate::log::Level::Trace,
            "{:?} of 1 tensor(s) in process set {}, from '{}' (in the lane)",
            req.kind,
            req.process_set,
            req.name
        );
        let c = &self.shared.counters;
        for n in [&c.operations, &c.tensors, &c.lane_operations] {
            n.fetch_add(1, Ordering::Relaxed);
        }
        Some(out)
    }

    /// Sets the largest fused buffer (bytes; 0 disables fusion). Only rank 0's
    /// value matters, since its coordinator plans the fusion; every rank may call it.
    pub fn set_fusion_threshold(&self, bytes: u64) {
        self.inbox.push(Event::SetFusion(bytes));
    }

    /// True once the operation finished.
    pub fn poll(&self, handle: u64) -> bool {
        let done = self.shared.handles.poll(handle);
        if !done && self.shared.last_waited.swap(handle, Ordering::Relaxed) != handle {
            self.report_wait(handle, true);
        }
        done
    }

    /// Running offline, a caller that waits on a tensor the schedule holds
    /// back (its group is incomplete) sends the ranks back to negotiation.
    /// Costs one atomic load otherwise; `pending`: the caller knows the
    /// handle is not done (else it is asked, only when offline).
    fn report_wait(&self, handle: u64, pending: bool) {
        if self.shared.offline.load(Ordering::Relaxed)
            && (pending || !self.shared.handles.poll(handle))
        {
            self.inbox.push(Event::Waiting(handle));
        }
    }

    /// Waits for the operation; `interrupted` is asked every 100 ms whether
    /// the caller wants to give up (Ctrl-C).
    pub fn wait(
        &self,
        handle: u64,
        mut interrupted: impl FnMut() -> Option<PerseusError>,
    ) -> Result<Output> {
        self.report_wait(handle, false);
        self.shared
            .handles
            .wait(handle, Duration::from_millis(100), self.wait_spin, || {
                // Asked every 100 ms while the operation is pending: the engine may
                // have begun holding requests for a schedule since this wait began,
                // and a wait it does not know of would leave every rank idle.
                self.report_wait(handle, true);
                interrupted()
            })
    }

    /// Makes the engine thread panic with `what`, to test that a panic there
    /// reaches every caller as an error (see `_core._debug_panic`).
    pub fn debug_panic(&self, what: &str) {
        self.inbox.push(Event::Panic(what.to_string()));
    }

    /// Leaves the job in order: every rank's shutdown is negotiated, then the
    /// engine thread ends and the sockets close.
    pub fn shutdown(&self) -> Result<()> {
        let handle = self.enqueue(Request::new(OpKind::Shutdown, "", 0), None, None);
        let result = match handle {
            Ok(h) => self.wait(h, || None).map(|_| ()),
            Err(e) => Err(e),
        };
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.inbox.push(Event::Fatal("shutdown".into()));
        if let Some(t) = self.thread.lock().unwrap().take() {
            let _ = t.join();
        }
        self.shared.timeline.stop();
        crate::log!(
            crate::log::Level::Debug,
            "shut down after {} operation(s)",
            self.shared.counters.operations.load(Ordering::Relaxed)
        );
        match result {
            Err(PerseusError::Aborted(_)) | Err(PerseusError::Peer(_)) | Ok(()) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// Checks a request's tensors (a device tensor needs its device's library; an output
/// has its input's dtype, and an allreduce's its size) and takes the request's type,
/// shape and device from them.
fn describe(
    req: &mut Request,
    input: Option<&TensorView>,
    output: Option<&TensorView>,
) -> Result<()> {
    let views = || input.into_iter().chain(output);
    for v in views().filter(|v| v.device != Device::Cpu) {
        crate::device::backend(v.device)?;
    }
    if let (Some(i), Some(o)) = (input, output) {
        // An allreduce's output takes the input's place; a gather's, an exchange's or a
        // reduce-scatter's result has a size of its own (a wrong one is not used).
        let in_place = matches!(req.kind, OpKind::Allreduce | OpKind::Broadcast);
        if i.dtype != o.dtype || (in_place && i.nbytes != o.nbytes) {
            return Err(PerseusError::InvalidArgument(
                "output tensor must match the input's dtype and size".into(),
            ));
        }
        if !in_place && (i.device != Device::Cpu || o.device != Device::Cpu) {
            return Err(PerseusError::InvalidArgument(format!(
                "an output tensor for {} is taken in host memory only",
                req.kind.name()
            )));
        }
    }
    if let Some(v) = input.or(output) {
        req.dtype = v.dtype;
        req.shape = v.shape.clone();
        req.plan.device = views().all(|v| v.device != Device::Cpu);
    }
    Ok(())
}

/// An alltoall's splits when the caller gave none: the first dimension in equal parts,
/// one per member of the set (Horovod's rule).
fn equal_splits(req: &Request, set_size: usize) -> Result<Vec<i64>> {
    let n = set_size as i64;
    let d0 = req.shape.first().copied().unwrap_or(0);
    if d0 % n != 0 {
        return Err(PerseusError::InvalidArgument(format!(
            "alltoall without splits needs a first dimension ({d0}) divisible by the number \
             of ranks ({n})"
        )));
    }
    Ok(vec![d0 / n; set_size])
}

/// The text of a panic's payload.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// The engine thread panicked: every pending and later operation fails with
/// an error that says so, instead of waiting for a thread that is gone.
fn engine_died(shared: &Shared, inbox: &Inbox<Event>, what: &str) {
    let err = PerseusError::Aborted(format!(
        "the Perseus engine thread failed ({what}); this is a bug in Perseus, please \
         report it. Call shutdown() and start again."
    ));
    shared
        .fatal
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get_or_insert(err.clone());
    shared.stopping.store(true, Ordering::SeqCst);
    inbox.close();
    inbox.take();
    shared.handles.fail_pending(&err);
    crate::log!(crate::log::Level::Error, "{err}");
}

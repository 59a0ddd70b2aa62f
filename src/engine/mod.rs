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

pub mod autotune;
mod control;
pub mod coordinator;
#[cfg(test)]
mod coordinator_tests;
pub mod direct;
mod exec;
mod handles;
mod inbox;
pub mod message;
mod offline;
mod outgoing;
pub mod recorder;
pub mod staged;
pub mod timeline_names;

pub use crate::device::{Device, OwnedTensor, TensorView};
pub use exec::Entry;
pub use handles::Output;
pub use message::{OpKind, Request, Response};

use crate::collective::{Comm, SubComm};
use crate::config::Config;
use crate::device::Watch;
use crate::dtype::{DataType, ReduceOp};
use crate::error::{PerseusError, Result};
use crate::rendezvous::StoreServer;
use crate::timeline::{self, Timeline};
use crate::transport::{connect_mesh, Mesh};
use control::{Incoming, Uplink, FRAME_REQUESTS};
use coordinator::Coordinator;
use handles::Handles;
use inbox::Inbox;
use message::{encode_requests, shape_bytes, WireRequest};
use offline::{Mode, Schedule};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long the engine stays awake (yielding the core) waiting for an
/// answer that is due, before it sleeps in poll(2).
const ANSWER_SPIN: Duration = Duration::from_micros(200);
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
    /// Running an offline schedule: callers report their waits.
    offline: AtomicBool,
    /// The last handle a caller reported waiting on.
    last_waited: AtomicU64,
    /// The names given to unnamed requests.
    names: Mutex<Unnamed>,
    /// This rank's last operations.
    recorder: Mutex<recorder::Recorder>,
}

/// Names for unnamed requests: a count per process set and kind, which every rank
/// advances alike as long as they submit alike. While a rank is joined the others may
/// submit more, so a completed join starts the set's counts again under a new prefix:
/// after it, the ranks' names agree again.
#[derive(Default)]
struct Unnamed {
    counts: HashMap<(u32, OpKind), u64>,
    /// Joins completed per process set.
    joins: HashMap<u32, u64>,
}

impl Unnamed {
    /// The next name for an unnamed `kind` request on `ps`.
    fn next(&mut self, ps: u32, kind: OpKind) -> String {
        let k = self.counts.entry((ps, kind)).or_default();
        *k += 1;
        let k = *k;
        let stem = if kind.has_data() {
            format!("{}.noname", kind.name())
        } else {
            kind.name().to_string()
        };
        match self.joins.get(&ps) {
            Some(j) => format!("{stem}.j{j}.{k}"),
            None => format!("{stem}.{k}"),
        }
    }

    /// A join on `ps` completed on this rank, as on every other.
    fn joined(&mut self, ps: u32) {
        self.counts.retain(|(p, _), _| *p != ps);
        *self.joins.entry(ps).or_default() += 1;
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
        let state = State {
            mesh: if oversubscribed {
                parts.mesh.without_spin()
            } else {
                parts.mesh
            },
            uplink: Uplink::new(parts.control, coord, config.timeout)?,
            inbox: inbox.clone(),
            local: Vec::new(),
            shared: shared.clone(),
            entries: HashMap::new(),
            joined: HashSet::new(),
            cache: HashMap::new(),
            bufs: exec::Buffers::default(),
            cycle: config.cycle_time,
            auto_flat: false,
            spin: spin(ANSWER_SPIN),
            exit: false,
            warned_overflow: false,
            gradient_scale: config.plan.scale,
            mode: Mode::Negotiated,
            parked: Vec::new(),
            waited: HashSet::new(),
            stall_checked: Instant::now(),
            groups: direct::Groups::new(
                config.nccl,
                config.nccl_channels,
                config.timeout,
                crate::device::opener(config.nccl_nonblocking),
            ),
        };
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
        Ok(Engine {
            _store: store,
            config,
            inbox,
            wait_spin: spin(WAIT_SPIN),
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &Config {
        &self.config
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
    /// `stall_warnings` (rank 0): stall warnings given.
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

    /// Checks a request, names it if unnamed, and queues it; returns its handle.
    pub fn enqueue(
        &self,
        mut req: Request,
        input: Option<TensorView>,
        output: Option<TensorView>,
    ) -> Result<u64> {
        if let Some(e) = self.shared.fatal.lock().unwrap().clone() {
            return Err(e);
        }
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
        Ok(handle)
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
        interrupted: impl FnMut() -> Option<PerseusError>,
    ) -> Result<Output> {
        self.report_wait(handle, false);
        self.shared.handles.wait(
            handle,
            Duration::from_millis(100),
            self.wait_spin,
            interrupted,
        )
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

/// Why a rank's control stream broke, with the host it ran on.
fn on_host(mesh: &Mesh, rank: usize, why: &str) -> String {
    match mesh.host_name(rank) {
        Some(h) => format!("{why}; it ran on host {h}"),
        None => why.to_string(),
    }
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

fn unregistered(set: u32) -> PerseusError {
    PerseusError::InvalidArgument(format!("process set {set} is not registered"))
}

/// The error every pending operation gets when the control stream to rank 0 fails.
fn lost_coordinator(why: &str) -> PerseusError {
    PerseusError::Aborted(format!(
        "lost the connection to rank 0 (the coordinator): {why}"
    ))
}

/// Checks what one rank can check alone, so the error is raised at the call.
fn check_locally(req: &Request, set_size: usize) -> Result<()> {
    if req.name.len() > message::MAX_NAME_BYTES {
        return Err(PerseusError::InvalidArgument(format!(
            "the name of this {} is {} bytes long; names may have at most {} bytes",
            req.kind.name(),
            req.name.len(),
            message::MAX_NAME_BYTES
        )));
    }
    let floating = matches!(
        req.dtype,
        DataType::F16 | DataType::BF16 | DataType::F32 | DataType::F64
    );
    if req.op == ReduceOp::Adasum && req.kind == OpKind::Reducescatter {
        return Err(PerseusError::NotImplemented(
            "reducescatter takes Sum or Average; Adasum is an allreduce op".into(),
        ));
    }
    if req.op == ReduceOp::Adasum && req.kind == OpKind::Allreduce && !floating {
        return Err(PerseusError::UnsupportedType(format!(
            "Adasum reduces floating-point tensors only, not {}",
            req.dtype.name()
        )));
    }
    if req.dtype == DataType::Bool && req.op == ReduceOp::Average && req.kind.has_data() {
        return Err(PerseusError::UnsupportedType(
            "bool tensors cannot be averaged; use op=Sum (logical or) or Min/Max".into(),
        ));
    }
    if req.kind == OpKind::Broadcast && !(0..set_size as i64).contains(&req.root) {
        return Err(PerseusError::InvalidArgument(format!(
            "broadcast root {} is not a rank of the set (0 to {})",
            req.root,
            set_size as i64 - 1
        )));
    }
    if req.kind == OpKind::Allgather && req.shape.is_empty() {
        return Err(PerseusError::InvalidArgument(
            "allgather needs a tensor of at least one dimension".into(),
        ));
    }
    if req.kind == OpKind::Alltoall {
        let d0 = req.shape.first().copied().unwrap_or(0);
        if req.shape.is_empty()
            || req.ints.len() != set_size
            || req.ints.iter().any(|&s| s < 0)
            || req.ints.iter().sum::<i64>() != d0
        {
            return Err(PerseusError::InvalidArgument(format!(
                "alltoall splits {:?} must be {set_size} non-negative row counts summing to the \
                 first dimension ({d0})",
                req.ints
            )));
        }
    }
    Ok(())
}

/// The engine thread's own state.
struct State {
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
    /// Each process set's NCCL group, or why its CUDA tensors are staged.
    groups: direct::Groups,
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

/// How often rank 0 looks for stalled tensors while some wait.
const STALL_TICK: Duration = Duration::from_secs(1);

impl State {
    fn run(mut self) {
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
            if !self.entries.is_empty() && since.elapsed() < self.spin {
                // An answer is due soon: stay awake for it rather than sleep,
                // since a sleeping thread on an idle virtual CPU takes tens of
                // microseconds to wake.
                std::thread::yield_now();
            } else {
                let stalls = self.stall_watch().then_some(STALL_TICK);
                // Wake to write the timeline's last events, if any wait.
                let tick = match (stalls, self.shared.timeline.due()) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                self.uplink.sleep(Some(&self.inbox), tick);
                idle_since = None;
            }
        }
    }

    /// Rank 0 with the stall check on and tensors waiting for ranks.
    fn stall_watch(&self) -> bool {
        matches!(&self.uplink, Uplink::Coordinator { coord, .. } if coord.stall_watch())
    }

    /// Rank 0, once per [`STALL_TICK`] while tensors wait: warns about those
    /// waiting past PERSEUS_STALL_CHECK_TIME_SECONDS, and stops the job when
    /// one waits past PERSEUS_STALL_SHUTDOWN_TIME_SECONDS.
    fn check_stalls(&mut self) {
        if !self.stall_watch() || self.stall_checked.elapsed() < STALL_TICK {
            return;
        }
        self.stall_checked = Instant::now();
        let Uplink::Coordinator { coord, .. } = &mut self.uplink else {
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
                    if let Uplink::Coordinator { coord, .. } = &mut self.uplink {
                        let out = coord.submit_wire(rank, reqs);
                        self.uplink.dispatch(out, &mut self.local);
                    }
                }
                Incoming::Responses(rs) => {
                    answered = true;
                    self.send_up(std::mem::take(held));
                    rs.into_iter().for_each(|r| self.execute(r));
                }
                Incoming::Lost(rank, why) => {
                    if self.shared.stopping.load(Ordering::SeqCst) {
                        continue;
                    }
                    let why = self
                        .mesh
                        .also_ended(on_host(&self.mesh, rank, &why), Some(rank));
                    if let Uplink::Coordinator { coord, .. } = &mut self.uplink {
                        let out = coord.disconnect(rank, &why);
                        self.uplink.dispatch(out, &mut self.local);
                    } else {
                        self.fail_all(lost_coordinator(&why));
                    }
                }
            }
            if self.exit {
                return answered;
            }
            answered |= self.run_local(held);
        }
        answered
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
                if let Uplink::Coordinator { coord, .. } = &mut self.uplink {
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
    /// each group every rank votes; one that cannot go on sends all back to
    /// negotiation. True when it did something.
    fn run_offline(&mut self) -> bool {
        let mut did = false;
        while let Mode::Running(schedule) = &mut self.mode {
            if self.exit {
                break;
            }
            let group = schedule.next();
            let Response::Op { names, .. } = &group else {
                break;
            };
            let off = self.parked.iter().any(|r| !schedule.fits(r));
            let held: HashSet<&str> = self.parked.iter().map(|r| r.name.as_str()).collect();
            let whole = !off && names.iter().all(|n| held.contains(n.as_str()));
            let count = names.len();
            drop(held);
            if !whole && !off && !self.caller_blocked() {
                break;
            }
            did = true;
            let voted = offline_vote(&self.mesh, &mut self.uplink, &mut self.local, whole);
            match voted {
                Err(e) => self.fail_all(e),
                Ok(false) => self.fall_back(),
                Ok(true) => {
                    if let Mode::Running(s) = &mut self.mode {
                        s.advance();
                    }
                    if let Response::Op { names, .. } = &group {
                        let ran: HashSet<&String> = names.iter().collect();
                        self.parked.retain(|r| !ran.contains(&r.name));
                    }
                    let skipped = &self.shared.counters.negotiations_skipped;
                    skipped.fetch_add(count as u64, Ordering::Relaxed);
                    self.execute(group);
                }
            }
        }
        did
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
        match &mut self.uplink {
            Uplink::Coordinator { coord, .. } => {
                let out = coord.submit(0, batch);
                self.uplink.dispatch(out, &mut self.local);
                self.run_local(&mut Vec::new());
            }
            Uplink::Worker(stream) => {
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
                // Queued, never waited for: rank 0 may be in a collective with this rank.
                let sent = match stream {
                    Some(s) => s
                        .post_batch(FRAME_REQUESTS, &wire, encode_requests)
                        .map_err(|e| e.to_string()),
                    None => Err("the connection is closed".to_string()),
                };
                if let Err(e) = sent {
                    self.fail_all(lost_coordinator(&self.mesh.also_ended(e, Some(0))));
                }
            }
        }
    }

    fn finish(&self, ps: &u32, name: &str, handle: u64, r: Result<Output>) {
        self.shared
            .inflight
            .lock()
            .unwrap()
            .remove(&(*ps, name.to_string()));
        let ok = r.is_ok();
        self.shared.recorder.lock().unwrap().finished(handle, ok);
        self.shared.handles.complete(handle, r);
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

    fn execute(&mut self, mut resp: Response) {
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
                    let ack = Request::new(OpKind::OfflineAck, "offline", 0);
                    self.transmit(vec![ack]);
                }
            }
            Response::Switch { go, skip } => {
                match std::mem::replace(&mut self.mode, Mode::Negotiated) {
                    Mode::Offered(groups) if *go => {
                        self.mode = Mode::Running(Schedule::new(groups, skip.clone()));
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

/// One offline vote with every rank (a dissemination max of one byte: 0 to
/// go on, 1 to leave the schedule); true when all said 0. Peers may be busy
/// computing for a long time, so it waits patiently, reading the control
/// streams meanwhile: a lost rank or an abort ends it with that error.
fn offline_vote(
    mesh: &Mesh,
    uplink: &mut Uplink,
    local: &mut Vec<Response>,
    go: bool,
) -> Result<bool> {
    use crate::transport::{Recv, Send};
    let (n, r) = (mesh.size(), mesh.rank());
    let mut mine = [u8::from(!go)];
    let mut alive = || -> Result<()> {
        for inc in uplink.receive() {
            match inc {
                Incoming::Requests(rank, reqs) => {
                    // A rank that already left the schedule negotiates again.
                    if let Uplink::Coordinator { coord, .. } = uplink {
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
                Incoming::Lost(rank, why) => {
                    let why = mesh.also_ended(on_host(mesh, rank, &why), Some(rank));
                    if let Uplink::Coordinator { coord, .. } = uplink {
                        let out = coord.disconnect(rank, &why);
                        uplink.dispatch(out, local);
                        return Err(PerseusError::Peer(format!("rank {rank} is gone ({why})")));
                    }
                    return Err(lost_coordinator(&why));
                }
            }
        }
        Ok(())
    };
    let mut dist = 1;
    while dist < n {
        let (to, from) = ((r + dist) % n, (r + n - dist) % n);
        let mut theirs = [0u8];
        mesh.transfer_patient(
            &mut [Send::new(to, &mine)],
            &mut [Recv::new(from, &mut theirs)],
            &mut alive,
        )?;
        mine[0] = mine[0].max(theirs[0]);
        dist *= 2;
    }
    Ok(mine[0] == 0)
}

//! `perseus._core`: PyO3 bindings over the engine. Converts arguments,
//! releases the GIL around every wait, and maps errors in `errors.rs`.
//! Users reach these through `perseus.common`, never directly.

mod dgc;
mod dlpack;
mod errors;
mod gpu;
mod kernels;
mod optim;
mod params;
mod rendezvous;

use crate::config::{Config, Topology};
use crate::dtype::ReduceOp;
use crate::engine::{Engine, OpKind, Output, Request, TensorView};
use crate::error::PerseusError;
use errors::{
    to_py, GpuUnavailableError, HorovodInternalError, MismatchError, NameInFlightError,
    Rank0AddressUnknown,
};
use pyo3::exceptions::PyTimeoutError;
use pyo3::prelude::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

static ENGINE: Mutex<Option<Arc<Engine>>> = Mutex::new(None);

/// The ranks the last engine found silent, kept by `shutdown` (see `silent_ranks`).
static LAST_SILENT: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// Set in a child forked after `init()` (a DataLoader worker): it has no
/// engine thread and must not use the parent's sockets. A flag set by a
/// pthread_atfork(3) handler, because comparing process ids would cost
/// every call a getpid(2).
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn mark_forked() {
    FORKED.store(true, Ordering::Relaxed);
}

/// True in the process that called `init()`, false in a child forked after it.
fn in_owner() -> bool {
    !FORKED.load(Ordering::Relaxed)
}

fn engine() -> PyResult<Arc<Engine>> {
    let e = ENGINE.lock().unwrap().clone();
    match e {
        Some(e) if in_owner() => Ok(e),
        // Why not, on the failing path only: every submission comes through here.
        _ => Err(to_py(
            not_a_rank().map_or(PerseusError::NotInitialized, PerseusError::NotARank),
        )),
    }
}

/// The topology of the rank a process that is not one answers for (see `init_copy`),
/// with why it is not a rank: set by `init_copy`.
static COPY: Mutex<Option<(Topology, String)>> = Mutex::new(None);

/// Why this process runs no collectives although a rank's `init()` reached it, or None:
/// a child forked after `init()`, or a process `init_copy` made the copy of a rank.
#[pyfunction]
fn not_a_rank() -> Option<String> {
    if !in_owner() {
        if let Some(e) = ENGINE.lock().unwrap().as_ref() {
            let r = e.config().topology.rank;
            return Some(format!(
                "this process is a child forked from rank {r} after its hvd.init() (a \
                 DataLoader worker, say), not a rank: rank(), size() and the local and \
                 cross ranks answer for rank {r}, but collectives run only in rank {r}'s \
                 own process"
            ));
        }
    }
    COPY.lock().unwrap().as_ref().map(|(_, why)| why.clone())
}

/// `f` of this process's topology: its engine's (also in a child forked after
/// `init()`), else the rank's it is a copy of (`init_copy`).
fn with_topology<T>(f: impl Fn(&Topology) -> T) -> PyResult<T> {
    if let Some(e) = ENGINE.lock().unwrap().as_ref() {
        return Ok(f(&e.config().topology));
    }
    match COPY.lock().unwrap().as_ref() {
        Some((t, _)) => Ok(f(t)),
        None => Err(to_py(PerseusError::NotInitialized)),
    }
}

/// Makes this process answer for rank `topology[0]` of a job of `topology[1]` ranks
/// (then local rank, local size, cross rank, cross size) without joining the job:
/// collectives fail with `why`. For a process a rank started through multiprocessing
/// (spawn or forkserver) that ran `hvd.init()` again from the script's top level.
#[pyfunction]
fn init_copy(topology: [usize; 6], why: String) -> PyResult<()> {
    let [rank, size, local_rank, local_size, cross_rank, cross_size] = topology;
    if rank >= size || local_rank >= local_size || cross_rank >= cross_size {
        return Err(to_py(PerseusError::InvalidArgument(format!(
            "not a topology: {topology:?}"
        ))));
    }
    let t = Topology {
        rank,
        size,
        local_rank,
        local_size,
        cross_rank,
        cross_size,
        ..Topology::single()
    };
    *COPY.lock().unwrap() = Some((t, why));
    Ok(())
}

/// Waits for `handle` with the GIL released; Ctrl-C raises KeyboardInterrupt. With a
/// `timeout` (seconds), gives up after it with `TimeoutError`, the operation still in
/// flight.
fn wait_for(py: Python<'_>, e: &Engine, handle: u64, timeout: Option<f64>) -> PyResult<Output> {
    let deadline = timeout.map(|s| Instant::now() + Duration::from_secs_f64(s.max(0.0)));
    let mut interrupt: Option<PyErr> = None;
    let r = py.detach(|| {
        e.wait(handle, || {
            if let Some(err) = Python::attach(|py| py.check_signals().err()) {
                interrupt = Some(err);
                return Some(PerseusError::Aborted("interrupted".into()));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                interrupt = Some(PyTimeoutError::new_err(format!(
                    "the operation did not finish within {:.3} s, and is still in flight",
                    timeout.unwrap_or_default()
                )));
                return Some(PerseusError::Aborted("timed out".into()));
            }
            None
        })
    });
    if let Some(err) = interrupt {
        return Err(err);
    }
    r.map_err(to_py)
}

/// The core's views of a call's input and output tensors.
type Views = (Option<TensorView>, Option<TensorView>);

fn views(inp: Option<&Bound<'_, PyAny>>, out: Option<&Bound<'_, PyAny>>) -> PyResult<Views> {
    let input = inp.map(dlpack::view).transpose().map_err(to_py)?;
    let output = out.map(dlpack::view).transpose().map_err(to_py)?;
    Ok((input, output))
}

fn submit(
    req: Request,
    inp: Option<&Bound<'_, PyAny>>,
    out: Option<&Bound<'_, PyAny>>,
) -> PyResult<u64> {
    let (input, output) = views(inp, out)?;
    engine()?.enqueue(req, input, output).map_err(to_py)
}

/// [`submit`] for a caller that waits at once ([`Engine::enqueue_blocking`]), without
/// the GIL.
fn submit_blocking(
    py: Python<'_>,
    req: Request,
    inp: Option<&Bound<'_, PyAny>>,
    out: Option<&Bound<'_, PyAny>>,
) -> PyResult<u64> {
    let (input, output) = views(inp, out)?;
    let e = engine()?;
    py.detach(|| e.enqueue_blocking(req, input, output))
        .map_err(to_py)
}

fn op_of(op: u8) -> PyResult<ReduceOp> {
    ReduceOp::from_code(op).map_err(to_py)
}

/// Connects to the job (see docs/core-api.md) and registers `process_sets`.
#[pyfunction]
#[pyo3(signature = (process_sets=None))]
fn init(py: Python<'_>, process_sets: Option<Vec<Vec<i64>>>) -> PyResult<()> {
    // Initialized already, or not a rank (forked after init, or a copy of one).
    if ENGINE.lock().unwrap().is_some() || COPY.lock().unwrap().is_some() {
        return Ok(());
    }
    let cfg = Config::from_env().map_err(to_py)?;
    let e = Arc::new(py.detach(|| Engine::start(cfg)).map_err(to_py)?);
    static AT_FORK: Once = Once::new();
    // SAFETY: registers a handler that only stores to an atomic, which is
    // async-signal-safe as a fork child handler must be.
    AT_FORK.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(mark_forked));
    });
    *ENGINE.lock().unwrap() = Some(e);
    for ranks in process_sets.unwrap_or_default() {
        add_process_set(py, ranks)?;
    }
    Ok(())
}

/// Leaves the job (negotiated with every rank) and stops the engine.
#[pyfunction]
fn shutdown(py: Python<'_>) -> PyResult<()> {
    if !in_owner() {
        return Ok(());
    }
    let e = ENGINE.lock().unwrap().take();
    if let Some(e) = e {
        *LAST_SILENT.lock().unwrap() = e.silent_ranks();
        py.detach(|| e.shutdown()).map_err(to_py)?;
    }
    Ok(())
}

/// The ranks this process's engine found silent (they answered nothing for the timeout
/// while it waited for them: stopped or frozen, or their host unreachable), in order;
/// after `shutdown()`, those of the engine that ran last. An elastic worker tells the
/// launcher, which stops them.
#[pyfunction]
fn silent_ranks() -> Vec<usize> {
    match ENGINE.lock().unwrap().as_ref() {
        Some(e) if in_owner() => e.silent_ranks(),
        _ => LAST_SILENT.lock().unwrap().clone(),
    }
}

/// True between `init()` and `shutdown()`, in the process that called `init()`.
#[pyfunction]
fn is_initialized() -> bool {
    ENGINE.lock().unwrap().is_some() && in_owner()
}

macro_rules! topo_fn {
    ($($name:ident),*) => {$(
        #[doc = concat!("This process's ", stringify!($name), ".")]
        #[pyfunction]
        fn $name() -> PyResult<usize> {
            with_topology(|t| t.$name)
        }
    )*};
}
topo_fn!(rank, size, local_rank, local_size, cross_rank, cross_size);

/// The effective configuration, keyed by variable name.
#[pyfunction]
fn config() -> PyResult<BTreeMap<String, String>> {
    Ok(engine()?.config().to_map())
}

/// For tests of the no-abort guarantee: `where_ = "engine"` makes the engine
/// thread panic (every pending and later operation then fails with
/// HorovodInternalError); `"call"` panics inside this call (raised as
/// pyo3's PanicException).
#[pyfunction]
fn _debug_panic(where_: &str) -> PyResult<()> {
    match where_ {
        "engine" => {
            engine()?.debug_panic("a test asked the engine thread to panic");
            Ok(())
        }
        "call" => panic!("a test asked this call to panic"),
        other => Err(to_py(PerseusError::InvalidArgument(format!(
            "_debug_panic: where must be 'engine' or 'call', not {other:?}"
        )))),
    }
}

/// Writes `message` as one of the core's log lines of level `level` (a name of
/// `HOROVOD_LOG_LEVEL`), so that the front-ends' lines are filtered and stamped alike.
#[pyfunction]
fn log(level: &str, message: &str) -> PyResult<()> {
    let l = crate::log::Level::parse(level).ok_or_else(|| {
        to_py(PerseusError::InvalidArgument(format!(
            "log: no level {level:?}; there are {}",
            crate::log::LEVEL_NAMES.join(", ")
        )))
    })?;
    crate::log!(l, "{message}");
    Ok(())
}

/// Where a PERSEUS_ variable overrides a HOROVOD_ one (said once at init).
#[pyfunction]
fn config_notes() -> PyResult<Vec<String>> {
    Ok(engine()?.config().notes.clone())
}

/// Sets the largest fused buffer in bytes (0 disables fusion).
#[pyfunction]
fn set_fusion_threshold(bytes: u64) -> PyResult<()> {
    engine()?.set_fusion_threshold(bytes);
    Ok(())
}

/// One operation of the flight recorder: name, kind, process set, bytes, and the
/// times it was submitted, negotiated and finished (seconds since the epoch).
type FlightRow = (
    String,
    &'static str,
    u32,
    usize,
    f64,
    Option<f64>,
    Option<f64>,
    &'static str,
);

/// This rank's last operations, oldest first (see `engine::recorder`): (name,
/// kind, process set, bytes, submitted, started, finished, stage).
#[pyfunction]
fn flight_record() -> PyResult<Vec<FlightRow>> {
    Ok(engine()?
        .flight_record()
        .into_iter()
        .map(|r| {
            let (kind, stage) = (r.kind.name(), r.stage.name());
            let (submitted, started, finished) = (r.submitted, r.started, r.finished);
            (
                r.name,
                kind,
                r.process_set,
                r.bytes,
                submitted,
                started,
                finished,
                stage,
            )
        })
        .collect())
}

/// A new host tensor shaped and typed like capsule `like`'s, from the output pool
/// (contents unspecified), as a capsule; see `kernels::pool`.
#[pyfunction]
fn empty_like(py: Python<'_>, like: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
    dlpack::empty_like(py, like)
}

/// Copies host capsule `src` into `dst` without the GIL, past the cache when
/// large; see `dlpack::copy_into`.
#[pyfunction]
fn copy_into(py: Python<'_>, dst: &Bound<'_, PyAny>, src: &Bound<'_, PyAny>) -> PyResult<()> {
    dlpack::copy_into(py, dst, src)
}

/// What the engine has done so far on this rank (see `Engine::counters`).
#[pyfunction]
fn counters() -> PyResult<BTreeMap<String, u64>> {
    Ok(engine()?.counters())
}

/// Registers a process set (collective over all ranks); returns its id.
#[pyfunction]
fn add_process_set(py: Python<'_>, ranks: Vec<i64>) -> PyResult<u32> {
    let e = engine()?;
    let mut req = Request::new(OpKind::AddProcessSet, "", 0);
    req.ints = ranks;
    let h = e.enqueue(req, None, None).map_err(to_py)?;
    Ok(wait_for(py, &e, h, None)?.value as u32)
}

/// Registers a process set over its members only (a collective over
/// `ranks`, which hold this rank); the other ranks never learn of it.
/// Returns its id.
#[pyfunction]
fn form_process_set(py: Python<'_>, ranks: Vec<i64>) -> PyResult<u32> {
    let e = engine()?;
    // Named by its ranks, so that every member asks under the same name.
    let name = format!("form_process_set{ranks:?}");
    let mut req = Request::new(OpKind::FormProcessSet, name, 0);
    req.ints = ranks;
    let h = e.enqueue(req, None, None).map_err(to_py)?;
    Ok(wait_for(py, &e, h, None)?.value as u32)
}

/// Removes a process set (collective over all ranks).
#[pyfunction]
fn remove_process_set(py: Python<'_>, id: u32) -> PyResult<()> {
    let e = engine()?;
    let mut req = Request::new(OpKind::RemoveProcessSet, "", 0);
    req.ints = vec![id as i64];
    let h = e.enqueue(req, None, None).map_err(to_py)?;
    wait_for(py, &e, h, None).map(|_| ())
}

/// Global ranks of a process set.
#[pyfunction]
fn process_set_ranks(id: u32) -> PyResult<Vec<usize>> {
    engine()?.process_set(id).map_err(to_py)
}

/// Ids of all registered process sets.
#[pyfunction]
fn process_set_ids() -> PyResult<Vec<u32>> {
    Ok(engine()?.process_set_ids())
}

fn named(kind: OpKind, name: Option<String>, ps: u32) -> Request {
    Request::new(kind, name.unwrap_or_default(), ps)
}

/// Starts an allreduce of `inp` into `out` (may be the same capsule).
/// `gradient`: a gradient reduction, which travels as the
/// PERSEUS_ALLREDUCE_DTYPE plan says (others are exact). `blocking`: the caller
/// waits for it at once, so a small one may run among the callers before this
/// returns (PERSEUS_LANE_BYTES), without the GIL. `now` (with `blocking`): the caller
/// needs nothing back but the outcome, so an allreduce that ran among the callers
/// returns `None` instead of a handle already done.
#[pyfunction]
#[pyo3(signature = (inp, out, name, op, prescale, postscale, process_set, gradient=false,
                    blocking=false, now=false))]
#[allow(clippy::too_many_arguments)]
fn allreduce(
    py: Python<'_>,
    inp: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    name: Option<String>,
    op: u8,
    prescale: f64,
    postscale: f64,
    process_set: u32,
    gradient: bool,
    blocking: bool,
    now: bool,
) -> PyResult<Option<u64>> {
    let mut req = named(OpKind::Allreduce, name, process_set);
    req.op = op_of(op)?;
    req.prescale = prescale;
    req.postscale = postscale;
    match (gradient, blocking) {
        (true, _) => {
            let (input, output) = views(Some(inp), Some(out))?;
            engine()?
                .enqueue_gradient(req, input, output)
                .map(Some)
                .map_err(to_py)
        }
        (false, true) if now => {
            let (input, output) = views(Some(inp), Some(out))?;
            let e = engine()?;
            py.detach(|| e.run_blocking(req, input, output))
                .map_err(to_py)
        }
        (false, true) => submit_blocking(py, req, Some(inp), Some(out)).map(Some),
        (false, false) => submit(req, Some(inp), Some(out)).map(Some),
    }
}

/// Starts an allgather (concatenation along dim 0, or stacking); `out`: a host tensor
/// of the result's size to write it into (else the result is the core's own).
/// `blocking`: as for [`allreduce`].
#[pyfunction]
#[pyo3(signature = (inp, name, stack, process_set, out=None, blocking=false))]
fn allgather(
    py: Python<'_>,
    inp: &Bound<'_, PyAny>,
    name: Option<String>,
    stack: bool,
    process_set: u32,
    out: Option<&Bound<'_, PyAny>>,
    blocking: bool,
) -> PyResult<u64> {
    let mut req = named(OpKind::Allgather, name, process_set);
    req.stack = stack;
    match blocking {
        true => submit_blocking(py, req, Some(inp), out),
        false => submit(req, Some(inp), out),
    }
}

/// Starts an in-place broadcast from set rank `root`. `blocking`: as for
/// [`allreduce`].
#[pyfunction]
#[pyo3(signature = (buf, name, root, process_set, blocking=false))]
fn broadcast(
    py: Python<'_>,
    buf: &Bound<'_, PyAny>,
    name: Option<String>,
    root: i64,
    process_set: u32,
    blocking: bool,
) -> PyResult<u64> {
    let mut req = named(OpKind::Broadcast, name, process_set);
    req.root = root;
    match blocking {
        true => submit_blocking(py, req, None, Some(buf)),
        false => submit(req, None, Some(buf)),
    }
}

/// Starts an alltoall; `splits` = rows for each rank (None: equal parts); `out` as
/// for [`allgather`]; `blocking`: as for [`allreduce`].
#[pyfunction]
#[pyo3(signature = (inp, splits, name, process_set, out=None, blocking=false))]
fn alltoall(
    py: Python<'_>,
    inp: &Bound<'_, PyAny>,
    splits: Option<Vec<i64>>,
    name: Option<String>,
    process_set: u32,
    out: Option<&Bound<'_, PyAny>>,
    blocking: bool,
) -> PyResult<u64> {
    let mut req = named(OpKind::Alltoall, name, process_set);
    // None: equal parts, the engine's rule.
    req.ints = splits.unwrap_or_default();
    match blocking {
        true => submit_blocking(py, req, Some(inp), out),
        false => submit(req, Some(inp), out),
    }
}

/// Starts a reducescatter along dim 0; `out` as for [`allgather`]; `blocking`: as for
/// [`allreduce`].
#[pyfunction]
#[pyo3(signature = (inp, name, op, prescale, postscale, process_set, out=None,
                    blocking=false))]
#[allow(clippy::too_many_arguments)]
fn reducescatter(
    py: Python<'_>,
    inp: &Bound<'_, PyAny>,
    name: Option<String>,
    op: u8,
    prescale: f64,
    postscale: f64,
    process_set: u32,
    out: Option<&Bound<'_, PyAny>>,
    blocking: bool,
) -> PyResult<u64> {
    let mut req = named(OpKind::Reducescatter, name, process_set);
    req.op = op_of(op)?;
    req.prescale = prescale;
    req.postscale = postscale;
    match blocking {
        true => submit_blocking(py, req, Some(inp), out),
        false => submit(req, Some(inp), out),
    }
}

/// Starts a barrier.
#[pyfunction]
#[pyo3(signature = (process_set=0))]
fn barrier(process_set: u32) -> PyResult<u64> {
    engine()?
        .enqueue(named(OpKind::Barrier, None, process_set), None, None)
        .map_err(to_py)
}

/// Starts a join: this rank contributes zeros until every rank joined.
#[pyfunction]
#[pyo3(signature = (process_set=0))]
fn join(process_set: u32) -> PyResult<u64> {
    let req = named(OpKind::Join, Some("join".into()), process_set);
    engine()?.enqueue(req, None, None).map_err(to_py)
}

/// True once the operation finished.
#[pyfunction]
fn poll(handle: u64) -> PyResult<bool> {
    Ok(engine()?.poll(handle))
}

/// What a finished operation produced: its new tensor as a DLPack capsule (None for
/// the operations that write in place), the rows received from each rank (allgather,
/// alltoall) and the last rank to join (join).
type Produced = (Option<Py<PyAny>>, Vec<i64>, i64);

/// Blocks until the operation finished and returns what it produced; raises its error.
/// The core forgets the handle. With `timeout` (seconds), raises `TimeoutError` once
/// it passed, and the operation stays in flight (wait again for it).
#[pyfunction]
#[pyo3(signature = (handle, timeout=None))]
fn wait(py: Python<'_>, handle: u64, timeout: Option<f64>) -> PyResult<Produced> {
    let e = engine()?;
    let out = wait_for(py, &e, handle, timeout)?;
    let tensor = match out.tensor {
        Some(t) => Some(dlpack::capsule(py, t)?),
        None => None,
    };
    Ok((tensor, out.splits, out.value))
}

/// Starts writing the timeline to `path`; `mark_cycles`: with an instant `CYCLE_START`
/// for each batch of requests sent to negotiation.
#[pyfunction]
#[pyo3(signature = (path, mark_cycles=false))]
fn start_timeline(path: &str, mark_cycles: bool) -> PyResult<()> {
    engine()?
        .timeline()
        .start(path, mark_cycles)
        .map_err(|e| to_py(e.into()))
}

/// The file rank `rank` writes for the timeline `path` (rank 0: `path`, rank r:
/// `path.r`); needs no engine.
#[pyfunction]
fn timeline_path(path: &str, rank: usize) -> String {
    crate::timeline::rank_path(path, rank)
}

/// Stops writing the timeline.
#[pyfunction]
fn stop_timeline() -> PyResult<()> {
    engine()?.timeline().stop();
    Ok(())
}

/// The extension module.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    #[cfg(feature = "cuda")]
    crate::gpu::install();
    m.add(
        "HorovodInternalError",
        m.py().get_type::<HorovodInternalError>(),
    )?;
    m.add("MismatchError", m.py().get_type::<MismatchError>())?;
    m.add("NameInFlightError", m.py().get_type::<NameInFlightError>())?;
    m.add(
        "Rank0AddressUnknown",
        m.py().get_type::<Rank0AddressUnknown>(),
    )?;
    m.add("OP_AVERAGE", 0)?;
    m.add("OP_SUM", 1)?;
    m.add("OP_ADASUM", 2)?;
    m.add("OP_MIN", 3)?;
    m.add("OP_MAX", 4)?;
    m.add("OP_PRODUCT", 5)?;
    m.add("GLOBAL_PROCESS_SET", 0)?;
    m.add(
        "GpuUnavailableError",
        m.py().get_type::<GpuUnavailableError>(),
    )?;
    m.add_function(wrap_pyfunction!(flight_record, m)?)?;
    m.add_function(wrap_pyfunction!(silent_ranks, m)?)?;
    m.add_function(wrap_pyfunction!(copy_into, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_libraries, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_compile_kernels, m)?)?;
    m.add(
        "UnsupportedOperationError",
        errors::unsupported_operation(m.py())?,
    )?;
    m.add("GPU_BUILT", cfg!(feature = "cuda"))?;
    m.add_function(wrap_pyfunction!(gpu::gpu_search_dirs, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_stream, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_nccl_round_trip, m)?)?;
    m.add_function(wrap_pyfunction!(params::params, m)?)?;
    m.add_class::<rendezvous::RendezvousServer>()?;
    m.add_class::<rendezvous::RendezvousClient>()?;
    m.add_function(wrap_pyfunction!(init, m)?)?;
    m.add_function(wrap_pyfunction!(init_copy, m)?)?;
    m.add_function(wrap_pyfunction!(not_a_rank, m)?)?;
    m.add_function(wrap_pyfunction!(shutdown, m)?)?;
    m.add_function(wrap_pyfunction!(is_initialized, m)?)?;
    m.add_function(wrap_pyfunction!(rank, m)?)?;
    m.add_function(wrap_pyfunction!(size, m)?)?;
    m.add_function(wrap_pyfunction!(local_rank, m)?)?;
    m.add_function(wrap_pyfunction!(local_size, m)?)?;
    m.add_function(wrap_pyfunction!(cross_rank, m)?)?;
    m.add_function(wrap_pyfunction!(cross_size, m)?)?;
    m.add_function(wrap_pyfunction!(config, m)?)?;
    m.add_function(wrap_pyfunction!(counters, m)?)?;
    m.add_function(wrap_pyfunction!(empty_like, m)?)?;
    m.add("POOL_MIN_BYTES", crate::kernels::pool::POOL_MIN_BYTES)?;
    m.add("STREAM_FROM", crate::kernels::STREAM_FROM)?;
    m.add_function(wrap_pyfunction!(config_notes, m)?)?;
    m.add_function(wrap_pyfunction!(log, m)?)?;
    m.add_function(wrap_pyfunction!(_debug_panic, m)?)?;
    m.add_function(wrap_pyfunction!(set_fusion_threshold, m)?)?;
    m.add_function(wrap_pyfunction!(add_process_set, m)?)?;
    m.add_function(wrap_pyfunction!(form_process_set, m)?)?;
    m.add_function(wrap_pyfunction!(remove_process_set, m)?)?;
    m.add_function(wrap_pyfunction!(process_set_ranks, m)?)?;
    m.add_function(wrap_pyfunction!(process_set_ids, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce, m)?)?;
    m.add_function(wrap_pyfunction!(allgather, m)?)?;
    m.add_function(wrap_pyfunction!(broadcast, m)?)?;
    m.add_function(wrap_pyfunction!(alltoall, m)?)?;
    m.add_function(wrap_pyfunction!(reducescatter, m)?)?;
    m.add_function(wrap_pyfunction!(barrier, m)?)?;
    m.add_function(wrap_pyfunction!(join, m)?)?;
    m.add_function(wrap_pyfunction!(poll, m)?)?;
    m.add_function(wrap_pyfunction!(wait, m)?)?;
    m.add_function(wrap_pyfunction!(start_timeline, m)?)?;
    m.add_function(wrap_pyfunction!(stop_timeline, m)?)?;
    m.add_function(wrap_pyfunction!(timeline_path, m)?)?;
    m.add_function(wrap_pyfunction!(optim::optimizer_step, m)?)?;
    m.add_function(wrap_pyfunction!(dgc::dgc_fold_select, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::gpu_cast, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::gpu_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::gpu_scale, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::gpu_nonfinite, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::gpu_top_k, m)?)?;
    Ok(())
}

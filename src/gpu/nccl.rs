//! NCCL, loaded at run time from the file its wheels ship (`libnccl.so.2`, which
//! cudarc's own loader does not look for): the few calls Perseus makes, and its
//! communicators. `crate::gpu::group` builds the device-direct path on them.
//!
//! Communicators are blocking unless PERSEUS_NCCL_NONBLOCKING=1 (with NCCL 2.19 and
//! later). A non-blocking one returns at once from forming, and current NCCL runs each
//! collective's launch in a background thread too: either then reports
//! [`Progress::Pending`], and the caller polls [`Communicator::progress`] under its
//! watch, so that a peer that never joins is noticed and the communicator aborted
//! instead of waited for forever. That thread per collective is the price, hence the
//! opt-in.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use libloading::Library;

use crate::device::{wait_for, Waited, Watch};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{PerseusError, Result};
use crate::gpu::libs::{probe, CudaLib};

/// Bytes of an `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// What ranks share to form one communicator (rank 0 makes it, the others receive it).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId(pub [u8; UNIQUE_ID_BYTES]);

type Comm = *mut c_void;
type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> c_int;
type CommInitRank = unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int;
type CommInitRankConfig =
    unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut Config) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> c_int;
type Broadcast = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> c_int;
type ReduceScatter = AllReduce;
type AllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, *mut c_void) -> c_int;
type CommAbort = unsafe extern "C" fn(Comm) -> c_int;
type CommGetAsyncError = unsafe extern "C" fn(Comm, *mut c_int) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// NCCL's result code for work that goes on in the background (`ncclInProgress`).
const IN_PROGRESS: c_int = 7;

/// `ncclConfig_t` as NCCL 2.14 introduced it: the three fields NCCL reads first to know
/// which layout it was given, then `blocking`, then the next field (`cgaClusterSize`,
/// NCCL 2.17) in what would otherwise be padding, left undefined. NCCL copies as many
/// bytes as `size` says and, for a config of `version` 2.14, takes its defaults for
/// every later field, so this layout holds for every later NCCL.
#[repr(C)]
#[derive(Debug)]
pub struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
}

/// What `NCCL_CONFIG_INITIALIZER` writes in `magic`.
const CONFIG_MAGIC: u32 = 0xcafe_beef;

/// NCCL's "not set" for an integer field (`NCCL_CONFIG_UNDEF_INT`).
const UNDEF_INT: c_int = c_int::MIN;

/// NCCL's code for a version (its `NCCL_VERSION` macro: 2.8.4 is 2804, 2.14.0 is 21400).
pub const fn version_code(major: u32, minor: u32, patch: u32) -> u32 {
    if major <= 2 && minor <= 8 {
        major * 1000 + minor * 100 + patch
    } else {
        major * 10000 + minor * 100 + patch
    }
}

impl Config {
    /// A non-blocking communicator, everything else NCCL's default.
    pub fn non_blocking() -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: CONFIG_MAGIC,
            version: version_code(2, 14, 0),
            blocking: 0,
            cga_cluster_size: UNDEF_INT,
        }
    }
}

/// Whether NCCL work has reached its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Done: the communicator is formed, or the collective is queued on its stream.
    Ready,
    /// Still going on in NCCL's background thread: poll [`Communicator::progress`].
    Pending,
}

/// What a result code says of progress: `Err` with NCCL's words for an error.
fn progress_of(
    code: c_int,
    explain: impl FnOnce(c_int) -> String,
) -> std::result::Result<Progress, String> {
    match code {
        0 => Ok(Progress::Ready),
        IN_PROGRESS => Ok(Progress::Pending),
        code => Err(format!("NCCL error {code}: {}", explain(code))),
    }
}

/// The NCCL functions Perseus calls.
pub struct Nccl {
    _lib: Library,
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    /// `ncclCommInitRankConfig` (NCCL 2.14 and later), which forms non-blocking
    /// communicators.
    comm_init_rank_config: Option<CommInitRankConfig>,
    all_reduce: AllReduce,
    broadcast: Broadcast,
    reduce_scatter: ReduceScatter,
    all_gather: AllGather,
    comm_abort: CommAbort,
    async_error: CommGetAsyncError,
    error_string: GetErrorString,
    /// The file it was loaded from, and its version.
    pub path: PathBuf,
    /// Its version ("2.30.7").
    pub version: String,
}

impl Nccl {
    /// Loads NCCL (searching `dirs` first). A missing library is
    /// [`PerseusError::GpuUnavailable`] naming where it was looked for.
    pub fn load(dirs: &[PathBuf]) -> Result<Nccl> {
        let p = probe(CudaLib::Nccl, dirs);
        let Some(found) = p.loaded else {
            return Err(PerseusError::GpuUnavailable(p.missing_message()));
        };
        let missing = |e: libloading::Error| {
            PerseusError::GpuUnavailable(format!(
                "NCCL at {} lacks a function Perseus needs: {e}",
                found.path.display()
            ))
        };
        // SAFETY: the library is already loaded (by `probe`), so this only takes another
        // reference; each symbol is read with the signature nccl.h declares for it.
        unsafe {
            let lib = Library::new(&found.path).map_err(missing)?;
            let get_unique_id = *lib
                .get::<GetUniqueId>(b"ncclGetUniqueId\0")
                .map_err(missing)?;
            let comm_init_rank = *lib
                .get::<CommInitRank>(b"ncclCommInitRank\0")
                .map_err(missing)?;
            let comm_init_rank_config = lib
                .get::<CommInitRankConfig>(b"ncclCommInitRankConfig\0")
                .ok()
                .map(|f| *f);
            let all_reduce = *lib.get::<AllReduce>(b"ncclAllReduce\0").map_err(missing)?;
            let broadcast = *lib.get::<Broadcast>(b"ncclBroadcast\0").map_err(missing)?;
            let reduce_scatter = *lib
                .get::<ReduceScatter>(b"ncclReduceScatter\0")
                .map_err(missing)?;
            let all_gather = *lib.get::<AllGather>(b"ncclAllGather\0").map_err(missing)?;
            let comm_abort = *lib.get::<CommAbort>(b"ncclCommAbort\0").map_err(missing)?;
            let async_error = *lib
                .get::<CommGetAsyncError>(b"ncclCommGetAsyncError\0")
                .map_err(missing)?;
            let error_string = *lib
                .get::<GetErrorString>(b"ncclGetErrorString\0")
                .map_err(missing)?;
            Ok(Nccl {
                _lib: lib,
                get_unique_id,
                comm_init_rank,
                comm_init_rank_config,
                all_reduce,
                broadcast,
                reduce_scatter,
                all_gather,
                comm_abort,
                async_error,
                error_string,
                path: found.path,
                version: found.version,
            })
        }
    }

    fn check(&self, call: &str, code: c_int) -> Result<()> {
        match self.started(call, code)? {
            Progress::Ready => Ok(()),
            Progress::Pending => Err(PerseusError::Device(format!(
                "{call} returned ncclInProgress on a blocking communicator"
            ))),
        }
    }

    /// What a call that may go on in the background returned: done, pending, or an
    /// error naming the call.
    fn started(&self, call: &str, code: c_int) -> Result<Progress> {
        progress_of(code, |c| self.explain(c))
            .map_err(|e| PerseusError::Device(format!("{call} failed with {e}")))
    }

    /// NCCL's words for a result code.
    fn explain(&self, code: c_int) -> String {
        // SAFETY: ncclGetErrorString returns a static string for any code.
        unsafe { CStr::from_ptr((self.error_string)(code)) }
            .to_string_lossy()
            .into_owned()
    }

    /// A new id for a communicator.
    pub fn unique_id(&self) -> Result<UniqueId> {
        let mut id = UniqueId([0; UNIQUE_ID_BYTES]);
        // SAFETY: `id` is an ncclUniqueId-sized buffer.
        let code = unsafe { (self.get_unique_id)(&mut id) };
        self.check("ncclGetUniqueId", code)?;
        Ok(id)
    }

    /// Whether this NCCL forms non-blocking communicators that Perseus can abort from
    /// several threads (2.19 and later).
    pub fn non_blocking(&self) -> bool {
        self.comm_init_rank_config.is_some() && at_least(&self.version, 2, 19)
    }

    /// Joins the communicator `id` as `rank` of `size`, on the device whose context
    /// is current on this thread (every rank of the group calls this together).
    /// `non_blocking` (where [`Nccl::non_blocking`]): the call returns at once, and the
    /// communicator may still be forming; wait until [`Communicator::progress`] is
    /// [`Progress::Ready`] before using it. Otherwise it is formed here, blocking.
    pub fn communicator(
        self: &Arc<Self>,
        id: &UniqueId,
        size: usize,
        rank: usize,
        non_blocking: bool,
    ) -> Result<Communicator> {
        let mut comm: Comm = std::ptr::null_mut();
        let (size, rank) = (size as c_int, rank as c_int);
        let can = self.non_blocking();
        if non_blocking && !can {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                crate::log!(
                    crate::log::Level::Info,
                    "PERSEUS_NCCL_NONBLOCKING=1 needs NCCL 2.19 or later; \
                     NCCL {} forms blocking communicators",
                    self.version
                )
            });
        }
        let init_config = self.comm_init_rank_config.filter(|_| non_blocking && can);
        // SAFETY: `comm` receives the handle; `id` is passed by value as nccl.h says;
        // the config outlives the call, which copies it.
        let (call, code) = unsafe {
            match init_config {
                Some(init) => {
                    let mut config = Config::non_blocking();
                    let code = init(&mut comm, size, *id, rank, &mut config);
                    ("ncclCommInitRankConfig", code)
                }
                None => (
                    "ncclCommInitRank",
                    (self.comm_init_rank)(&mut comm, size, *id, rank),
                ),
            }
        };
        // A non-blocking communicator that failed at once stays valid until aborted
        // (by its drop, with the error); a blocking one that failed is not NCCL's to
        // release.
        let made =
            (!comm.is_null() && (code == 0 || init_config.is_some())).then(|| Communicator {
                nccl: self.clone(),
                comm,
                aborted: AtomicBool::new(false),
            });
        self.started(call, code)?;
        made.ok_or_else(|| {
            PerseusError::Device(format!("{call} succeeded but returned no communicator"))
        })
    }
}

/// Whether version `v` ("2.21.5") is `major.minor` or later.
fn at_least(v: &str, major: u32, minor: u32) -> bool {
    let mut parts = v.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let have = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    have >= (major, minor)
}

/// NCCL's code for an element type.
pub fn data_type(d: DataType) -> Result<c_int> {
    Ok(match d {
        DataType::I8 | DataType::Bool => 0,
        DataType::U8 => 1,
        DataType::I32 => 2,
        DataType::I64 => 4,
        DataType::F16 => 6,
        DataType::F32 => 7,
        DataType::F64 => 8,
        DataType::BF16 => 9,
        DataType::I16 | DataType::U16 => {
            return Err(PerseusError::UnsupportedType(format!(
                "NCCL has no {} reduction; such tensors go through host memory",
                d.name()
            )))
        }
    })
}

/// NCCL's code for a reduction (Average is `ncclAvg`, NCCL 2.10 and later).
pub fn red_op(op: ReduceOp) -> Result<c_int> {
    Ok(match op {
        ReduceOp::Sum => 0,
        ReduceOp::Product => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Average => 4,
        ReduceOp::Adasum => {
            return Err(PerseusError::InvalidArgument(
                "NCCL has no Adasum reduction".into(),
            ))
        }
    })
}

/// One NCCL communicator; aborted when dropped, unless aborted before.
pub struct Communicator {
    nccl: Arc<Nccl>,
    comm: Comm,
    /// [`Communicator::abort`] ran: the handle is gone.
    aborted: AtomicBool,
}

// SAFETY: a communicator is used by one thread at a time (the engine thread); NCCL
// allows that thread to differ from the one that created it.
unsafe impl Send for Communicator {}
unsafe impl Sync for Communicator {}

impl Communicator {
    /// Queues an allreduce of `count` elements from device memory `send` into `recv`
    /// (may be equal) on `stream`. [`Progress::Pending`] (a non-blocking communicator):
    /// NCCL's thread queues it later; poll [`Communicator::progress`] before the next
    /// call.
    ///
    /// # Safety
    /// Both pointers must be device memory of the communicator's device holding
    /// `count` elements, alive until the stream has run the operation.
    pub unsafe fn allreduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: u64,
    ) -> Result<Progress> {
        let code = (self.nccl.all_reduce)(
            send as *const c_void,
            recv as *mut c_void,
            count,
            data_type(dtype)?,
            red_op(op)?,
            self.comm,
            stream as *mut c_void,
        );
        self.nccl.started("ncclAllReduce", code)
    }

    /// Queues a broadcast of `bytes` from communicator rank `root`, in place at `buf`,
    /// on `stream` (progress as for [`Communicator::allreduce`]).
    ///
    /// # Safety
    /// `buf` must be device memory of the communicator's device holding `bytes`, alive
    /// until the stream has run the operation.
    pub unsafe fn broadcast(
        &self,
        buf: u64,
        bytes: usize,
        root: usize,
        stream: u64,
    ) -> Result<Progress> {
        let code = (self.nccl.broadcast)(
            buf as *const c_void,
            buf as *mut c_void,
            bytes,
            data_type(DataType::U8)?,
            root as c_int,
            self.comm,
            stream as *mut c_void,
        );
        self.nccl.started("ncclBroadcast", code)
    }
}

impl Communicator {
    /// Queues an in-place reduce-scatter on `stream`: `buf` holds `size * chunk`
    /// elements and rank `rank`'s chunk, at `rank * chunk`, ends reduced.
    ///
    /// # Safety
    /// As for [`Communicator::allreduce`].
    pub unsafe fn reduce_scatter(
        &self,
        buf: u64,
        rank: usize,
        chunk: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: u64,
    ) -> Result<Progress> {
        let mine = buf + (rank * chunk * dtype.size()) as u64;
        let code = (self.nccl.reduce_scatter)(
            buf as *const c_void,
            mine as *mut c_void,
            chunk,
            data_type(dtype)?,
            red_op(op)?,
            self.comm,
            stream as *mut c_void,
        );
        self.nccl.started("ncclReduceScatter", code)
    }

    /// Queues an in-place allgather on `stream` of chunks of `chunk` elements, rank
    /// `rank`'s at `rank * chunk`.
    ///
    /// # Safety
    /// As for [`Communicator::allreduce`].
    pub unsafe fn allgather(
        &self,
        buf: u64,
        rank: usize,
        chunk: usize,
        dtype: DataType,
        stream: u64,
    ) -> Result<Progress> {
        let mine = buf + (rank * chunk * dtype.size()) as u64;
        let code = (self.nccl.all_gather)(
            mine as *const c_void,
            buf as *mut c_void,
            chunk,
            data_type(dtype)?,
            self.comm,
            stream as *mut c_void,
        );
        self.nccl.started("ncclAllGather", code)
    }
}

impl Communicator {
    /// Whether the communicator's background work (forming it, or setting up a
    /// collective's connections) is done; `Err` with NCCL's words for the error it met
    /// there or in its queued work (a peer that failed, a broken connection).
    pub fn progress(&self) -> std::result::Result<Progress, String> {
        if self.aborted.load(Ordering::Acquire) {
            return Err("the communicator was aborted".into());
        }
        let mut code: c_int = 0;
        // SAFETY: a live handle; `code` receives the result.
        let asked = unsafe { (self.nccl.async_error)(self.comm, &mut code) };
        if asked != 0 {
            return Err(format!(
                "ncclCommGetAsyncError failed with NCCL error {asked}: {}",
                self.nccl.explain(asked)
            ));
        }
        progress_of(code, |c| self.nccl.explain(c))
    }

    /// Waits, as `watch` allows, until the communicator's background work is done
    /// (forming it, or launching a collective).
    /// `trouble` names other reasons to give up (another communicator's error). NCCL's
    /// own error is an `Err`.
    pub fn settle(
        &self,
        watch: &Watch<'_>,
        trouble: impl FnMut() -> Option<String>,
    ) -> Result<Waited> {
        let done = || match self.progress() {
            Ok(p) => Ok(p == Progress::Ready),
            Err(e) => Err(PerseusError::Device(e)),
        };
        wait_for(watch, done, trouble)
    }

    /// The error NCCL met in this communicator's queued work, if any: `Some` with
    /// NCCL's words (work still in progress is not an error).
    pub fn async_error(&self) -> Option<String> {
        self.progress().err()
    }

    /// Ends the communicator at once: the collectives it has queued stop, on this
    /// rank, without waiting for the peers (NCCL frees it; it cannot be used again).
    /// Only the first call does anything.
    pub fn abort(&self) {
        if !self.aborted.swap(true, Ordering::AcqRel) {
            // SAFETY: a live handle, released here once (Drop skips it after this).
            unsafe { (self.nccl.comm_abort)(self.comm) };
        }
    }
}

impl Drop for Communicator {
    /// Releases the communicator with `ncclCommAbort`, which needs no peer (where
    /// `ncclCommDestroy` may wait for the other ranks, and a rank that died never
    /// comes). Its owner has waited for its work, or abandoned it, before.
    fn drop(&mut self) {
        self.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_nccl_h() {
        assert_eq!(data_type(DataType::F32).unwrap(), 7);
        assert_eq!(data_type(DataType::BF16).unwrap(), 9);
        assert_eq!(red_op(ReduceOp::Average).unwrap(), 4);
        assert_eq!(red_op(ReduceOp::Min).unwrap(), 3);
        assert!(red_op(ReduceOp::Adasum).is_err());
        assert_eq!(std::mem::size_of::<UniqueId>(), 128);
    }

    #[test]
    fn the_config_has_the_layout_of_nccl_2_14() {
        use std::mem::{offset_of, size_of};
        assert_eq!(version_code(2, 8, 4), 2804);
        assert_eq!(version_code(2, 14, 0), 21400);
        assert_eq!(version_code(2, 27, 3), 22703);
        let c = Config::non_blocking();
        // size_t, then magic and version, then blocking and cgaClusterSize: no padding
        // that NCCL would read as a field.
        assert_eq!(size_of::<Config>(), 24);
        assert_eq!(c.size, 24);
        assert_eq!(offset_of!(Config, magic), 8);
        assert_eq!(offset_of!(Config, version), 12);
        assert_eq!(offset_of!(Config, blocking), 16);
        assert_eq!(offset_of!(Config, cga_cluster_size), 20);
        assert_eq!((c.magic, c.version, c.blocking), (0xcafebeef, 21400, 0));
        assert_eq!(c.cga_cluster_size, i32::MIN);
    }

    #[test]
    fn versions_compare_by_number() {
        assert!(at_least("2.19.3", 2, 19));
        assert!(at_least("2.30.7", 2, 19));
        assert!(at_least("3.0.0", 2, 19));
        assert!(!at_least("2.18.6", 2, 19));
        assert!(!at_least("2.9.9", 2, 19));
        assert!(!at_least("unknown", 2, 19));
    }

    #[test]
    fn in_progress_is_pending_and_other_codes_are_errors() {
        let words = |c: c_int| format!("words for {c}");
        assert_eq!(progress_of(0, words), Ok(Progress::Ready));
        assert_eq!(progress_of(7, words), Ok(Progress::Pending));
        assert_eq!(
            progress_of(6, words),
            Err("NCCL error 6: words for 6".into())
        );
    }

    #[test]
    fn a_missing_nccl_is_a_clear_error() {
        let dir = std::env::temp_dir().join("perseus-no-nccl-here");
        if let Err(e) = Nccl::load(std::slice::from_ref(&dir)) {
            let msg = e.to_string();
            assert!(
                msg.contains("NCCL (libnccl.so.2 or libnccl.so) was not found"),
                "{msg}"
            );
        }
    }
}

//! NCCL, loaded at run time from the file its wheels ship (`libnccl.so.2`, which
//! cudarc's own loader does not look for): the few calls Perseus makes, and its
//! communicators. `crate::gpu::group` builds the device-direct path on them.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use libloading::Library;

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
type CommDestroy = unsafe extern "C" fn(Comm) -> c_int;
type CommAbort = CommDestroy;
type CommGetAsyncError = unsafe extern "C" fn(Comm, *mut c_int) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// The NCCL functions Perseus calls.
pub struct Nccl {
    _lib: Library,
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    all_reduce: AllReduce,
    broadcast: Broadcast,
    reduce_scatter: ReduceScatter,
    all_gather: AllGather,
    comm_destroy: CommDestroy,
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
            let all_reduce = *lib.get::<AllReduce>(b"ncclAllReduce\0").map_err(missing)?;
            let broadcast = *lib.get::<Broadcast>(b"ncclBroadcast\0").map_err(missing)?;
            let reduce_scatter = *lib
                .get::<ReduceScatter>(b"ncclReduceScatter\0")
                .map_err(missing)?;
            let all_gather = *lib.get::<AllGather>(b"ncclAllGather\0").map_err(missing)?;
            let comm_destroy = *lib
                .get::<CommDestroy>(b"ncclCommDestroy\0")
                .map_err(missing)?;
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
                all_reduce,
                broadcast,
                reduce_scatter,
                all_gather,
                comm_destroy,
                comm_abort,
                async_error,
                error_string,
                path: found.path,
                version: found.version,
            })
        }
    }

    fn check(&self, call: &str, code: c_int) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        Err(PerseusError::Device(format!(
            "{call} failed with NCCL error {code}: {}",
            self.explain(code)
        )))
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

    /// Joins the communicator `id` as `rank` of `size`, on the device whose context is
    /// current on this thread (every rank of the group calls this together).
    pub fn communicator(
        self: &Arc<Self>,
        id: &UniqueId,
        size: usize,
        rank: usize,
    ) -> Result<Communicator> {
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: `comm` receives the handle; `id` is passed by value as nccl.h says.
        let code = unsafe { (self.comm_init_rank)(&mut comm, size as c_int, *id, rank as c_int) };
        self.check("ncclCommInitRank", code)?;
        Ok(Communicator {
            nccl: self.clone(),
            comm,
            aborted: AtomicBool::new(false),
        })
    }
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

/// One NCCL communicator; destroyed when dropped, unless aborted before.
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
    /// (may be equal) on `stream`.
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
    ) -> Result<()> {
        let code = (self.nccl.all_reduce)(
            send as *const c_void,
            recv as *mut c_void,
            count,
            data_type(dtype)?,
            red_op(op)?,
            self.comm,
            stream as *mut c_void,
        );
        self.nccl.check("ncclAllReduce", code)
    }

    /// Queues a broadcast of `bytes` from communicator rank `root`, in place at `buf`,
    /// on `stream`.
    ///
    /// # Safety
    /// `buf` must be device memory of the communicator's device holding `bytes`, alive
    /// until the stream has run the operation.
    pub unsafe fn broadcast(&self, buf: u64, bytes: usize, root: usize, stream: u64) -> Result<()> {
        let code = (self.nccl.broadcast)(
            buf as *const c_void,
            buf as *mut c_void,
            bytes,
            data_type(DataType::U8)?,
            root as c_int,
            self.comm,
            stream as *mut c_void,
        );
        self.nccl.check("ncclBroadcast", code)
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
    ) -> Result<()> {
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
        self.nccl.check("ncclReduceScatter", code)
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
    ) -> Result<()> {
        let mine = buf + (rank * chunk * dtype.size()) as u64;
        let code = (self.nccl.all_gather)(
            mine as *const c_void,
            buf as *mut c_void,
            chunk,
            data_type(dtype)?,
            self.comm,
            stream as *mut c_void,
        );
        self.nccl.check("ncclAllGather", code)
    }
}

impl Communicator {
    /// The error NCCL met in this communicator's queued work, if any (a peer that
    /// failed, a broken connection): `Some` with NCCL's words.
    pub fn async_error(&self) -> Option<String> {
        if self.aborted.load(Ordering::Acquire) {
            return Some("the communicator was aborted".into());
        }
        let mut code: c_int = 0;
        // SAFETY: a live handle; `code` receives the result.
        let asked = unsafe { (self.nccl.async_error)(self.comm, &mut code) };
        match (asked, code) {
            // ncclInProgress (7) is a state of non-blocking calls, not an error.
            (0, 0) | (0, 7) => None,
            (0, code) => Some(format!("NCCL error {code}: {}", self.nccl.explain(code))),
            (asked, _) => Some(format!(
                "ncclCommGetAsyncError failed with NCCL error {asked}: {}",
                self.nccl.explain(asked)
            )),
        }
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
    /// Destroys a communicator that was not aborted (Perseus's groups abort theirs
    /// when dropped: see `NcclGroup`'s drop).
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::Acquire) {
            // SAFETY: the handle came from ncclCommInitRank and is destroyed once.
            unsafe { (self.nccl.comm_destroy)(self.comm) };
        }
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

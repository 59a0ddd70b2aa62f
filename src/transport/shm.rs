//! Shared memory between ranks on one host: one segment per host and job,
//! holding a doorbell per rank that writers ring when data arrives or space frees,
//! and pairs of single-producer single-consumer byte rings that links take as they
//! are made: each member has [`slots_for`] pairs of its own to hand out to the links
//! it dials, so the segment grows with the host's ranks, not with their square. A rank with nothing to do sleeps on its doorbell
//! with futex(2), so oversubscribed hosts do not spin.
//!
//! The rings carry the same framed byte stream as TCP, so the collectives
//! cannot tell the two apart.

use crate::error::{PerseusError, Result};
use crate::kernels::copy_streaming;
use std::io::ErrorKind;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// A cache line: shared words sit on lines of their own.
pub(super) const LINE: usize = 64;
const MAGIC: u64 = 0x5045_5253_4853_4d31; // "PERSHSM1"

/// A mapped segment shared by the ranks of one host.
pub struct Segment {
    base: *mut u8,
    len: usize,
    layout: Layout,
}

/// The parts of a segment: `members` ranks, `slots` pairs of rings of `cap` bytes
/// for each, and `extra` bytes after the rings for a layout of the caller's (the
/// lane's).
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// Ranks sharing the segment.
    pub members: usize,
    /// Bytes of each ring.
    pub cap: usize,
    /// Ring pairs each member hands out.
    pub slots: usize,
    /// Bytes after the rings.
    pub extra: usize,
}

/// Ring pairs each of `members` ranks of a host hands out to the links it dials:
/// enough for every other member on a small host, and on a large one for the partners
/// of the collectives (neighbours, and one per power of two each way). A link dialed
/// when its dialer has none left runs over TCP.
pub fn slots_for(members: usize) -> usize {
    let log2 = members.next_power_of_two().trailing_zeros() as usize;
    members.saturating_sub(1).min(2 * log2 + 4)
}

/// Bytes of each ring on a host of `members` ranks: 512 KiB up to 64 ranks, less
/// beyond (at least 64 KiB), so that a crowded host's segment stays within its memory.
pub fn ring_cap_for(members: usize) -> usize {
    const FULL: usize = 512 << 10;
    (FULL * 64 / members.max(64)).max(64 << 10)
}

// SAFETY: the mapping is shared memory accessed only through atomics and the
// ring protocol below; the pointer stays valid until drop.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

fn ring_bytes(cap: usize) -> usize {
    2 * LINE + cap
}

impl Segment {
    /// Bytes a segment of `layout` needs.
    pub fn size(layout: Layout) -> usize {
        Self::rings_end(layout) + layout.extra
    }

    /// Where the rings end and the extra bytes begin.
    fn rings_end(layout: Layout) -> usize {
        LINE + layout.members * LINE + 2 * layout.members * layout.slots * ring_bytes(layout.cap)
    }

    /// Offset of the extra bytes after the rings.
    pub(super) fn extra_offset(&self) -> usize {
        Self::rings_end(self.layout)
    }

    /// Ranks sharing the segment.
    pub(super) fn members(&self) -> usize {
        self.layout.members
    }

    /// The address of `len` bytes at `off`.
    pub(super) fn at(&self, off: usize, len: usize) -> *mut u8 {
        assert!(off + len <= self.len, "outside the segment");
        // SAFETY: in bounds, checked above.
        unsafe { self.base.add(off) }
    }

    /// Opens (creating if needed) the segment file at `path` and maps it.
    pub fn open(path: &str, layout: Layout) -> Result<Segment> {
        use std::os::fd::AsRawFd;
        let len = Self::size(layout);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| PerseusError::Io(format!("shared memory {path}: {e}")))?;
        file.set_len(len as u64)
            .map_err(|e| PerseusError::Io(format!("sizing shared memory {path}: {e}")))?;
        // SAFETY: mapping a file we opened read-write, of the length just set.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(PerseusError::Io(format!(
                "mapping shared memory {path}: {e}"
            )));
        }
        let seg = Segment {
            base: base.cast(),
            len,
            layout,
        };
        seg.word64(0).store(MAGIC, Ordering::SeqCst);
        Ok(seg)
    }

    pub(super) fn word64(&self, off: usize) -> &AtomicU64 {
        assert!(off + 8 <= self.len && off % 8 == 0);
        // SAFETY: in bounds and aligned; shared words are only used atomically.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    fn word32(&self, off: usize) -> &AtomicU32 {
        assert!(off + 4 <= self.len && off % 4 == 0);
        // SAFETY: as above.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    fn doorbell(&self, member: usize) -> Doorbell<'_> {
        let off = LINE + member * LINE;
        Doorbell {
            bell: self.word32(off),
            waiting: self.word32(off + 4),
        }
    }

    /// Ring `index` (slot `s` holds rings `2s` and `2s + 1`), which member `from`
    /// writes and member `to` reads.
    pub fn ring(&self, index: usize, from: usize, to: usize) -> Ring<'_> {
        let l = self.layout;
        assert!(
            index < 2 * l.members * l.slots,
            "ring {index} of {}",
            2 * l.members * l.slots
        );
        let off = LINE + l.members * LINE + index * ring_bytes(l.cap);
        Ring {
            head: self.word64(off),
            tail: self.word64(off + LINE),
            // SAFETY: the data area lies inside the mapping.
            data: unsafe { self.base.add(off + 2 * LINE) },
            cap: l.cap,
            reader: self.doorbell(to),
            writer: self.doorbell(from),
        }
    }

    /// Sleeps until `member`'s doorbell changes from `seen` or `timeout` passes.
    pub fn wait(&self, member: usize, seen: u32, timeout: Duration) {
        self.doorbell(member).wait(seen, timeout);
    }

    /// The current value of `member`'s doorbell.
    pub fn bell(&self, member: usize) -> u32 {
        self.doorbell(member).bell.load(Ordering::SeqCst)
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `open` mapped.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

struct Doorbell<'a> {
    bell: &'a AtomicU32,
    waiting: &'a AtomicU32,
}

impl Doorbell<'_> {
    fn ring(&self) {
        self.bell.fetch_add(1, Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) != 0 {
            // SAFETY: futex on a word of a shared mapping (not process-private).
            unsafe {
                libc::syscall(
                    libc::SYS_futex,
                    self.bell.as_ptr(),
                    libc::FUTEX_WAKE,
                    i32::MAX,
                );
            }
        }
    }

    fn wait(&self, seen: u32, timeout: Duration) {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        if self.bell.load(Ordering::SeqCst) == seen {
            let ts = libc::timespec {
                tv_sec: timeout.as_secs() as libc::time_t,
                tv_nsec: timeout.subsec_nanos() as libc::c_long,
            };
            // SAFETY: as in `ring`; the kernel re-checks the value atomically.
            unsafe {
                libc::syscall(
                    libc::SYS_futex,
                    self.bell.as_ptr(),
                    libc::FUTEX_WAIT,
                    seen,
                    &ts,
                );
            }
        }
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One direction between two local ranks: a byte ring. `head` counts bytes
/// ever written, `tail` bytes ever read.
pub struct Ring<'a> {
    head: &'a AtomicU64,
    tail: &'a AtomicU64,
    data: *mut u8,
    cap: usize,
    reader: Doorbell<'a>,
    writer: Doorbell<'a>,
}

impl Ring<'_> {
    /// Copies as much of `buf` as fits; `WouldBlock` when the ring is full.
    pub fn write(&self, buf: &[u8]) -> std::io::Result<usize> {
        let head = self.head.load(Ordering::Relaxed);
        let tail = self.tail.load(Ordering::Acquire);
        let free = self.cap - (head - tail) as usize;
        let n = free.min(buf.len());
        if n == 0 {
            return Err(ErrorKind::WouldBlock.into());
        }
        let at = (head % self.cap as u64) as usize;
        let first = n.min(self.cap - at);
        // SAFETY: the writer owns [head, tail + cap); ranges are inside the data area.
        unsafe {
            std::ptr::copy_nonoverlapping(buf.as_ptr(), self.data.add(at), first);
            std::ptr::copy_nonoverlapping(buf.as_ptr().add(first), self.data, n - first);
        }
        self.head.store(head + n as u64, Ordering::Release);
        self.reader.ring();
        Ok(n)
    }

    /// Hands up to `max` available bytes, whole `unit`s only, to `f(offset, bytes)`
    /// in at most two contiguous pieces, then frees them; `WouldBlock` when
    /// less than one unit is there. Lets a receiver reduce without a copy.
    pub fn consume(
        &self,
        max: usize,
        unit: usize,
        mut f: impl FnMut(usize, &[u8]),
    ) -> std::io::Result<usize> {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Acquire);
        let avail = ((head - tail) as usize).min(max);
        let n = avail - avail % unit;
        if n == 0 {
            return Err(ErrorKind::WouldBlock.into());
        }
        let at = (tail % self.cap as u64) as usize;
        let first = n.min(self.cap - at);
        // SAFETY: the reader owns [tail, head); ranges are inside the data area.
        unsafe {
            f(0, std::slice::from_raw_parts(self.data.add(at), first));
            if n > first {
                f(first, std::slice::from_raw_parts(self.data, n - first));
            }
        }
        self.tail.store(tail + n as u64, Ordering::Release);
        self.writer.ring();
        Ok(n)
    }

    /// Copies out as much as is available into `buf`; `WouldBlock` when empty.
    pub fn read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.read_with(buf, |d, s| d.copy_from_slice(s))
    }

    /// [`Ring::read`] with stores that bypass the cache, for a destination
    /// too large to stay in it.
    pub fn read_streaming(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.read_with(buf, copy_streaming)
    }

    fn read_with(&self, buf: &mut [u8], copy: impl Fn(&mut [u8], &[u8])) -> std::io::Result<usize> {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Acquire);
        let n = ((head - tail) as usize).min(buf.len());
        if n == 0 {
            return Err(ErrorKind::WouldBlock.into());
        }
        let at = (tail % self.cap as u64) as usize;
        let first = n.min(self.cap - at);
        // SAFETY: the reader owns [tail, head); ranges are inside the data area.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(self.data.add(at), first),
                std::slice::from_raw_parts(self.data, n - first),
            )
        };
        let (da, db) = buf[..n].split_at_mut(first);
        copy(da, a);
        copy(db, b);
        self.tail.store(tail + n as u64, Ordering::Release);
        self.writer.ring();
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streams 200,000 bytes through a ring of `cap` bytes in writes of
    /// `piece` bytes and returns what the reader got.
    fn through_ring(cap: usize, piece: usize, streaming: bool) -> Vec<u8> {
        let path = format!("/dev/shm/perseus-test-{}-{cap}-{piece}", std::process::id());
        let layout = Layout {
            members: 2,
            cap,
            slots: 1,
            extra: 0,
        };
        let a = Segment::open(&path, layout).unwrap();
        let b = Segment::open(&path, layout).unwrap();
        let _ = std::fs::remove_file(&path);
        let msg: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let writer = std::thread::spawn(move || {
            let ring = a.ring(2, 0, 1);
            let mut off = 0;
            while off < msg.len() {
                match ring.write(&msg[off..(off + piece).min(msg.len())]) {
                    Ok(n) => off += n,
                    Err(_) => a.wait(0, a.bell(0), Duration::from_millis(10)),
                }
            }
        });
        let ring = b.ring(2, 0, 1);
        // Off by one from an aligned address, so streamed stores need a head.
        let mut got = vec![0u8; 200_001];
        let mut off = 1;
        while off < got.len() {
            let seen = b.bell(1);
            let dst = &mut got[off..];
            let read = if streaming {
                ring.read_streaming(dst)
            } else {
                ring.read(dst)
            };
            match read {
                Ok(n) => off += n,
                Err(_) => b.wait(1, seen, Duration::from_millis(10)),
            }
        }
        writer.join().unwrap();
        got.remove(0);
        got
    }

    #[test]
    fn bytes_cross_the_ring_in_order_with_wraparound() {
        let msg: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        // Small rings and pieces wrap often; large ones give reads long
        // enough to be streamed past the cache.
        for (cap, piece) in [(1000, 777), (70_000, 9_999), (65_536, 65_536)] {
            for streaming in [false, true] {
                let got = through_ring(cap, piece, streaming);
                assert!(
                    got == msg,
                    "ring {cap}, pieces {piece}, streaming {streaming}"
                );
            }
        }
    }
}

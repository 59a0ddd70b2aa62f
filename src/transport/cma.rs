//! Reads from a peer process's memory on this host (cross-memory attach,
//! `process_vm_readv(2)`): a receiver copies what it needs straight out of the
//! sender's buffer, in one pass, where the rings would take two (the sender's
//! write into the ring, the receiver's read out of it) and the sender's core
//! for the first.
//!
//! The kernel allows it between processes of one user unless Yama
//! (`kernel.yama.ptrace_scope` of 1 or more) or a seccomp filter forbids it,
//! so a rank publishes a [`Token`] only where it can read itself and Yama
//! allows reads between unrelated processes. A token carries the process id
//! and the address and value of a random canary: a read checks the canary,
//! so a peer whose process id means another process here (another pid
//! namespace) is never read from by mistake.
//!
//! Where the kernel allows it, reading can still lose: each call pins the other
//! process's pages, and on some hosts (an AMD EPYC VM: 10 GB/s in 128 KiB pieces,
//! where `memcpy` moves 54-72 GB/s) that costs more than the two copies of the
//! rings. [`worth_reading`] times it once at init.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Bytes of the canary.
const CANARY: usize = 16;

/// The most ranks whose collectives read one another's memory: each such collective
/// has every rank offer to and answer every other, a message (and a link) a peer. A
/// host with more ranks than this publishes no token at all.
pub const READ_MAX_RANKS: usize = 16;

/// This process's canary: random, fixed for the process's life, at a fixed address.
fn canary() -> &'static [u8; CANARY] {
    static VALUE: OnceLock<[u8; CANARY]> = OnceLock::new();
    VALUE.get_or_init(crate::auth::nonce)
}

/// What a peer needs to read this process's memory: published in the rendezvous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Token {
    pid: u32,
    addr: u64,
    value: [u8; CANARY],
}

impl Token {
    /// This process's token, or why peers cannot read its memory.
    pub fn own() -> std::result::Result<Token, &'static str> {
        if !yama_allows() {
            return Err("Yama's kernel.yama.ptrace_scope is not 0");
        }
        let mine = Token {
            pid: std::process::id(),
            addr: canary().as_ptr() as u64,
            value: *canary(),
        };
        // A seccomp filter that forbids the call shows here.
        let mut probe = [0u8; 8];
        let addr = probe.as_ptr() as u64;
        if mine.read(addr, &mut probe) && probe == [0u8; 8] {
            Ok(mine)
        } else {
            Err("process_vm_readv(2) is refused (a seccomp filter?)")
        }
    }

    /// The token as published: `pid:addr:value`, in hexadecimal.
    pub fn encode(&self) -> String {
        let value: String = self.value.iter().map(|b| format!("{b:02x}")).collect();
        format!("{:x}:{:x}:{value}", self.pid, self.addr)
    }

    /// Parses [`Token::encode`]'s form.
    pub fn decode(s: &str) -> Option<Token> {
        let mut f = s.split(':');
        let pid = u32::from_str_radix(f.next()?, 16).ok()?;
        let addr = u64::from_str_radix(f.next()?, 16).ok()?;
        let hex = f.next()?;
        if f.next().is_some() || hex.len() != 2 * CANARY {
            return None;
        }
        let mut value = [0u8; CANARY];
        for (i, v) in value.iter_mut().enumerate() {
            *v = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Token { pid, addr, value })
    }

    /// Copies `buf.len()` bytes at address `remote` of the token's process into
    /// `buf`. False, with `buf` in any state, when the kernel refuses, the
    /// process is gone, or the canary shows another process.
    pub fn read(&self, remote: u64, buf: &mut [u8]) -> bool {
        let mut seen = [0u8; CANARY];
        let local = [
            (seen.as_mut_ptr() as usize, CANARY),
            (buf.as_mut_ptr() as usize, buf.len()),
        ];
        let far = [(self.addr as usize, CANARY), (remote as usize, buf.len())];
        let total = CANARY + buf.len();
        let mut done = 0;
        while done < total {
            // A short read ends between or inside the vectors: go on from there.
            let (l, nl) = after(&local, done);
            let (r, nr) = after(&far, done);
            // SAFETY: the local vectors lie in `seen` and `buf`, both writable for
            // their lengths; the kernel checks the remote ones against the other
            // process's mappings and fails rather than fault.
            let n = unsafe {
                libc::process_vm_readv(
                    self.pid as libc::pid_t,
                    l.as_ptr(),
                    nl as libc::c_ulong,
                    r.as_ptr(),
                    nr as libc::c_ulong,
                    0,
                )
            };
            if n > 0 {
                done += n as usize;
            } else if n == 0
                || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
            {
                return false;
            }
        }
        seen == self.value
    }
}

/// Bytes read at once by a rank that reduces what it reads (`collective::reading`),
/// and by [`Pace::measure`].
pub const PIECE: usize = 128 << 10;
/// Bytes [`Pace::measure`] reads and copies in each round.
const PACE_BYTES: usize = 8 * PIECE;
/// Rounds of [`Pace::measure`]; the fastest of each kind counts.
const PACE_ROUNDS: usize = 5;
/// Reading pays where it takes less than this many copies of the same bytes. The
/// rings copy every byte twice (into a ring, then out of it), one core each, and
/// their copies cross cores, so each costs more than the copy timed here. Measured:
/// on an Intel Xeon VM a read cost 1.6-2.0 copies and reading led the rings by up to
/// 1.4×; on an AMD EPYC VM it cost 4.7-6.5 and the rings led by 2.3-3.1× (see
/// benchmarks/NOTES.md). 3 lies clear of both, so the verdict does not flip between
/// jobs on either.
const COPIES_PER_READ: f64 = 3.0;

/// How long reading [`PACE_BYTES`] of a process's memory, [`PIECE`] at a time,
/// took on this host, against copying them within the process.
#[derive(Clone, Copy, Debug)]
pub struct Pace {
    /// The fastest round of reads.
    pub read: Duration,
    /// The fastest round of copies.
    pub copy: Duration,
}

impl Pace {
    /// Times reading this process's own memory through `token` against copying
    /// it; `None` when a read fails.
    pub fn measure(token: &Token) -> Option<Pace> {
        let src: Vec<u8> = (0..PACE_BYTES).map(|i| i as u8).collect();
        let mut dst = vec![0u8; PACE_BYTES];
        let mut pace = Pace {
            read: Duration::MAX,
            copy: Duration::MAX,
        };
        for _ in 0..PACE_ROUNDS {
            let t = Instant::now();
            for (d, s) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
                if !token.read(s.as_ptr() as u64, d) {
                    return None;
                }
            }
            pace.read = pace.read.min(t.elapsed());
            let t = Instant::now();
            for (d, s) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
                d.copy_from_slice(s);
            }
            std::hint::black_box(&mut dst);
            pace.copy = pace.copy.min(t.elapsed());
        }
        Some(pace)
    }

    /// How many copies one read costs.
    pub fn copies_per_read(&self) -> f64 {
        self.read.as_secs_f64() / self.copy.as_secs_f64().max(1e-9)
    }

    /// True when reading costs less than [`COPIES_PER_READ`] copies.
    pub fn reading_pays(&self) -> bool {
        self.copies_per_read() < COPIES_PER_READ
    }
}

/// This process's token where peers should read its memory: [`Token::own`], and
/// when `paced`, a [`Pace`] that says reading pays on this host. Otherwise why not.
pub fn worth_reading(paced: bool) -> std::result::Result<Token, String> {
    let token = Token::own().map_err(str::to_string)?;
    if !paced {
        return Ok(token);
    }
    let Some(pace) = Pace::measure(&token) else {
        return Err("process_vm_readv(2) failed reading this process".into());
    };
    crate::log!(
        crate::log::Level::Debug,
        "reading {} KiB of this process's memory through process_vm_readv(2): {:?}; \
         copying them: {:?}",
        PACE_BYTES >> 10,
        pace.read,
        pace.copy
    );
    match pace.reading_pays() {
        true => Ok(token),
        false => Err(format!(
            "reading another process's memory takes as long as {:.1} copies of the same \
             bytes here, where reading pays below {COPIES_PER_READ}; PERSEUS_SHM_DIRECT=1 \
             reads anyway",
            pace.copies_per_read()
        )),
    }
}

/// The vectors `(address, length)` after their first `skip` bytes, and how many
/// of them are left.
fn after(v: &[(usize, usize); 2], mut skip: usize) -> ([libc::iovec; 2], usize) {
    let empty = libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    };
    let mut out = [empty; 2];
    let mut n = 0;
    for &(base, len) in v {
        if skip >= len {
            skip -= len;
            continue;
        }
        out[n] = libc::iovec {
            iov_base: (base + skip) as *mut libc::c_void,
            iov_len: len - skip,
        };
        skip = 0;
        n += 1;
    }
    (out, n)
}

/// True unless Yama restricts reads to a process's descendants (or forbids them).
fn yama_allows() -> bool {
    match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Ok(s) => s.trim() == "0",
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::{after, worth_reading, Pace, Token};
    use std::time::Duration;

    #[test]
    fn a_token_reads_this_process_and_checks_its_canary() {
        let Ok(me) = Token::own() else {
            eprintln!("this host forbids process_vm_readv: nothing to read");
            return;
        };
        assert_eq!(Token::decode(&me.encode()), Some(me));
        let src: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        assert!(me.read(src.as_ptr() as u64, &mut dst));
        assert_eq!(dst, src);
        // Another canary value: another process, never read from.
        let mut other = me;
        other.value[0] ^= 1;
        assert!(!other.read(src.as_ptr() as u64, &mut dst));
        // A process that does not exist.
        let gone = Token {
            pid: i32::MAX as u32,
            ..me
        };
        assert!(!gone.read(src.as_ptr() as u64, &mut dst));
        // An address not mapped in the process.
        assert!(!me.read(8, &mut dst));
    }

    #[test]
    fn the_pace_check_reads_and_copies_and_decides_by_two_copies() {
        let Ok(me) = Token::own() else {
            assert!(worth_reading(false).is_err() && worth_reading(true).is_err());
            return;
        };
        let pace = Pace::measure(&me).expect("reading this process");
        assert!(
            pace.read > Duration::ZERO && pace.copy > Duration::ZERO,
            "{pace:?}"
        );
        // Unpaced, the token is this process's; paced, it follows the measure (which
        // may differ between two measures, so only its form is checked here).
        assert_eq!(worth_reading(false).unwrap(), me);
        match worth_reading(true) {
            Ok(t) => assert_eq!(t, me),
            Err(why) => assert!(why.contains("PERSEUS_SHM_DIRECT=1 reads anyway"), "{why}"),
        }
        let ms = Duration::from_millis;
        let at = |read, copy| Pace {
            read: ms(read),
            copy: ms(copy),
        };
        assert!(at(3, 2).reading_pays());
        assert!(at(41, 20).reading_pays());
        assert!(at(5, 2).reading_pays());
        assert!(!at(6, 2).reading_pays());
        assert!(!at(47, 10).reading_pays());
        assert_eq!(at(6, 2).copies_per_read(), 3.0);
    }

    #[test]
    fn malformed_tokens_are_none() {
        for bad in [
            "",
            "-",
            "1:2",
            "1:2:00",
            "x:2:00112233445566778899aabbccddeeff",
            "1:2:3:4",
        ] {
            assert_eq!(Token::decode(bad), None, "{bad:?}");
        }
        let t = Token::decode("1f:ff00:00112233445566778899aabbccddeeff").unwrap();
        assert_eq!((t.pid, t.addr, t.value[15]), (0x1f, 0xff00, 0xff));
    }

    #[test]
    fn a_short_read_goes_on_inside_the_vectors() {
        let v = [(1000usize, 16usize), (5000, 100)];
        let (io, n) = after(&v, 0);
        assert_eq!((n, io[0].iov_base as usize, io[1].iov_len), (2, 1000, 100));
        let (io, n) = after(&v, 10);
        assert_eq!((n, io[0].iov_base as usize, io[0].iov_len), (2, 1010, 6));
        let (io, n) = after(&v, 16);
        assert_eq!((n, io[0].iov_base as usize, io[0].iov_len), (1, 5000, 100));
        let (io, n) = after(&v, 50);
        assert_eq!((n, io[0].iov_base as usize, io[0].iov_len), (1, 5034, 66));
    }
}

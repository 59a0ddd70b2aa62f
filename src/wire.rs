//! The byte encoding of every control message (rendezvous, handshake,
//! negotiation): little-endian integers, length-prefixed strings and lists,
//! inside frames that carry a magic number, a protocol version, a kind and a
//! length. A frame that breaks any of these rules is a [`PerseusError::Protocol`].

use crate::error::{PerseusError, Result};
use std::io::{Read, Write};

/// First four bytes of every frame: "PRSS".
pub const MAGIC: u32 = 0x5052_5353;
/// Version of the frame layout and of every message inside it.
pub const VERSION: u16 = 1;
/// Largest control frame accepted (control messages are small; data moves elsewhere).
pub const MAX_FRAME: usize = 64 << 20;
/// Largest frame accepted before the peer has proved it knows the secret.
pub const MAX_HANDSHAKE: usize = 64 << 10;
/// Bytes in a frame header: magic u32, version u16, kind u16, length u64.
pub const HEADER: usize = 16;

/// Encodes a frame header.
pub fn header(kind: u16, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&VERSION.to_le_bytes());
    h[6..8].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

/// Decodes and checks a frame header, returning (kind, payload length).
pub fn parse_header(h: &[u8; HEADER], max: usize) -> Result<(u16, usize)> {
    let magic = u32::from_le_bytes(h[0..4].try_into().unwrap());
    if magic != MAGIC {
        return Err(PerseusError::Protocol(format!(
            "bad frame magic {magic:#010x} (not a Perseus peer, or a corrupted stream)"
        )));
    }
    let version = u16::from_le_bytes(h[4..6].try_into().unwrap());
    if version != VERSION {
        return Err(PerseusError::Protocol(format!(
            "peer speaks protocol version {version}, this build speaks {VERSION}"
        )));
    }
    let kind = u16::from_le_bytes(h[6..8].try_into().unwrap());
    let len = u64::from_le_bytes(h[8..16].try_into().unwrap());
    if len > max as u64 {
        return Err(PerseusError::Protocol(format!(
            "frame of {len} bytes exceeds the limit of {max}"
        )));
    }
    Ok((kind, len as usize))
}

/// Writes one frame to a blocking stream.
pub fn write_frame(w: &mut impl Write, kind: u16, payload: &[u8]) -> std::io::Result<()> {
    w.write_all(&framed(kind, payload))?;
    w.flush()
}

/// A whole frame, header and payload, in one buffer (one write, one segment).
pub fn framed(kind: u16, payload: &[u8]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(HEADER + payload.len());
    buf.extend_from_slice(&header(kind, payload.len()));
    buf.extend_from_slice(payload);
    buf
}

/// Reads one frame from a blocking stream: (kind, payload).
pub fn read_frame(r: &mut impl Read) -> Result<(u16, Vec<u8>)> {
    read_frame_max(r, MAX_FRAME)
}

/// Reads one frame of at most `max` payload bytes. Memory grows with the
/// bytes that actually arrive, not with the length a header claims.
pub fn read_frame_max(r: &mut impl Read, max: usize) -> Result<(u16, Vec<u8>)> {
    let mut h = [0u8; HEADER];
    r.read_exact(&mut h)?;
    let (kind, len) = parse_header(&h, max)?;
    let mut payload = Vec::with_capacity(len.min(64 << 10));
    r.take(len as u64).read_to_end(&mut payload)?;
    if payload.len() < len {
        return Err(PerseusError::Protocol(format!(
            "frame cut short: {} of {len} bytes before the stream ended",
            payload.len()
        )));
    }
    Ok((kind, payload))
}

/// Reassembles frames from a non-blocking stream: [`FrameReader::read_from`]
/// takes what the stream has without blocking and returns the frames it
/// completed; a partial frame waits in the buffer for the next call.
#[derive(Default)]
pub struct FrameReader {
    buf: Vec<u8>,
    /// How the stream ended, held back while whole frames read before the
    /// end are delivered; the next call reports it.
    ended: Option<PerseusError>,
}

impl FrameReader {
    /// True while part of a frame has arrived and the rest has not.
    pub fn partial(&self) -> bool {
        !self.buf.is_empty()
    }

    /// Reads everything `r` has now; returns the whole frames (kind, payload).
    /// End of stream is an `UnexpectedEof` I/O error, a bad header a
    /// [`PerseusError::Protocol`]. Frames that arrived whole before either are
    /// returned first, and the error comes from the next call: a peer that
    /// sends its last word and closes at once is heard before its departure.
    pub fn read_from(&mut self, r: &mut impl Read) -> Result<Vec<(u16, Vec<u8>)>> {
        if let Some(e) = &self.ended {
            return Err(e.clone());
        }
        let mut chunk = [0u8; 16 << 10];
        let mut end = None;
        while end.is_none() {
            match r.read(&mut chunk) {
                Ok(0) => {
                    end = Some(
                        std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "the peer closed the connection",
                        )
                        .into(),
                    )
                }
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => end = Some(e.into()),
            }
        }
        let mut frames = Vec::new();
        let mut at = 0;
        while self.buf.len() - at >= HEADER {
            let h: &[u8; HEADER] = self.buf[at..at + HEADER].try_into().unwrap();
            let (kind, len) = match parse_header(h, MAX_FRAME) {
                Ok(kl) => kl,
                Err(e) => {
                    end = Some(e);
                    at = self.buf.len();
                    break;
                }
            };
            if self.buf.len() - at - HEADER < len {
                break;
            }
            frames.push((kind, self.buf[at + HEADER..at + HEADER + len].to_vec()));
            at += HEADER + len;
        }
        self.buf.drain(..at);
        match end {
            Some(e) if frames.is_empty() => {
                self.ended = Some(e.clone());
                Err(e)
            }
            Some(e) => {
                self.ended = Some(e);
                Ok(frames)
            }
            None => Ok(frames),
        }
    }
}

/// Builds a message payload.
#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    /// An empty payload.
    pub fn new() -> Self {
        Writer(Vec::new())
    }
    /// Appends a byte.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    /// Appends a u32.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends a u64.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends an i64.
    pub fn i64(&mut self, v: i64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends an f64.
    pub fn f64(&mut self, v: f64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends length-prefixed bytes.
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
        self
    }
    /// Appends a length-prefixed UTF-8 string.
    pub fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
    /// Appends a length-prefixed list of u64.
    pub fn u64s(&mut self, v: &[u64]) -> &mut Self {
        self.u32(v.len() as u32);
        v.iter().for_each(|x| {
            self.u64(*x);
        });
        self
    }
    /// Appends a length-prefixed list of i64.
    pub fn i64s(&mut self, v: &[i64]) -> &mut Self {
        self.u32(v.len() as u32);
        v.iter().for_each(|x| {
            self.i64(*x);
        });
        self
    }
}

/// Reads a message payload; every read checks the remaining length.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader over `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() - self.pos < n {
            return Err(PerseusError::Protocol(format!(
                "message truncated: wanted {n} bytes at offset {}, have {}",
                self.pos,
                self.buf.len() - self.pos
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    /// Reads a byte.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    /// Reads a u32.
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    /// Reads a u64.
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    /// Reads an i64.
    pub fn i64(&mut self) -> Result<i64> {
        Ok(i64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    /// Reads an f64.
    pub fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    /// Reads length-prefixed bytes.
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    /// Reads a length-prefixed UTF-8 string.
    pub fn str(&mut self) -> Result<String> {
        String::from_utf8(self.bytes()?.to_vec())
            .map_err(|_| PerseusError::Protocol("string is not UTF-8".into()))
    }
    fn count(&mut self, elem: usize) -> Result<usize> {
        let n = self.u32()? as usize;
        if n.saturating_mul(elem) > self.buf.len() - self.pos {
            return Err(PerseusError::Protocol(format!(
                "list of {n} elements overruns the message"
            )));
        }
        Ok(n)
    }
    /// Reads a length-prefixed list of u64.
    pub fn u64s(&mut self) -> Result<Vec<u64>> {
        let n = self.count(8)?;
        (0..n).map(|_| self.u64()).collect()
    }
    /// Reads a length-prefixed list of i64.
    pub fn i64s(&mut self) -> Result<Vec<i64>> {
        let n = self.count(8)?;
        (0..n).map(|_| self.i64()).collect()
    }
    /// Fails unless every byte was consumed.
    pub fn finish(&self) -> Result<()> {
        if self.pos != self.buf.len() {
            return Err(PerseusError::Protocol(format!(
                "{} trailing bytes after the message",
                self.buf.len() - self.pos
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_truncation() {
        let mut w = Writer::new();
        w.u8(7)
            .u32(9)
            .u64(1 << 40)
            .f64(0.5)
            .str("layer1.weight")
            .u64s(&[1, 2, 3])
            .i64s(&[-1]);
        let mut r = Reader::new(&w.0);
        assert_eq!(r.u8().unwrap(), 7);
        assert_eq!(r.u32().unwrap(), 9);
        assert_eq!(r.u64().unwrap(), 1 << 40);
        assert_eq!(r.f64().unwrap(), 0.5);
        assert_eq!(r.str().unwrap(), "layer1.weight");
        assert_eq!(r.u64s().unwrap(), vec![1, 2, 3]);
        assert_eq!(r.i64s().unwrap(), vec![-1]);
        r.finish().unwrap();
        let cut = &w.0[..w.0.len() - 3];
        let mut r = Reader::new(cut);
        r.take(cut.len() - 2).unwrap();
        assert!(matches!(r.u64(), Err(PerseusError::Protocol(_))));
    }

    #[test]
    fn frames_are_checked() {
        let mut buf = Vec::new();
        write_frame(&mut buf, 3, b"abc").unwrap();
        let (k, p) = read_frame(&mut buf.as_slice()).unwrap();
        assert_eq!((k, p.as_slice()), (3, &b"abc"[..]));
        let mut bad = buf.clone();
        bad[0] ^= 0xff;
        let e = read_frame(&mut bad.as_slice()).unwrap_err();
        assert!(e.to_string().contains("bad frame magic"), "{e}");
        let mut bad = buf.clone();
        bad[4] = 9;
        assert!(read_frame(&mut bad.as_slice())
            .unwrap_err()
            .to_string()
            .contains("version 9"));
        let huge = header(1, MAX_FRAME + 1);
        assert!(read_frame(&mut &huge[..])
            .unwrap_err()
            .to_string()
            .contains("exceeds"));
    }

    /// A stream that hands out its bytes in `step`-sized reads, then ends as
    /// `end` says (`None`: nothing more yet, `WouldBlock`).
    struct Pieces {
        data: Vec<u8>,
        at: usize,
        step: usize,
        end: Option<std::io::ErrorKind>,
    }

    impl Read for Pieces {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            if self.at == self.data.len() {
                return match self.end {
                    None => Err(std::io::ErrorKind::WouldBlock.into()),
                    Some(std::io::ErrorKind::UnexpectedEof) => Ok(0),
                    Some(k) => Err(k.into()),
                };
            }
            let n = self.step.min(out.len()).min(self.data.len() - self.at);
            out[..n].copy_from_slice(&self.data[self.at..self.at + n]);
            self.at += n;
            Ok(n)
        }
    }

    fn two_frames() -> Vec<u8> {
        let mut buf = Vec::new();
        write_frame(&mut buf, 0x301, b"abort: stalled").unwrap();
        write_frame(&mut buf, 0x301, b"").unwrap();
        buf
    }

    #[test]
    fn frames_sent_before_the_end_are_read_before_it() {
        use std::io::ErrorKind::{ConnectionReset, UnexpectedEof};
        for (end, says) in [
            (UnexpectedEof, "closed the connection"),
            (ConnectionReset, "reset"),
        ] {
            let mut s = Pieces {
                data: two_frames(),
                at: 0,
                step: 5,
                end: Some(end),
            };
            let mut r = FrameReader::default();
            let got = r.read_from(&mut s).unwrap();
            assert_eq!(got.len(), 2);
            assert_eq!(got[0], (0x301, b"abort: stalled".to_vec()));
            for _ in 0..2 {
                let e = r.read_from(&mut s).unwrap_err();
                assert!(e.to_string().to_lowercase().contains(says), "{e}");
            }
        }
    }

    #[test]
    fn a_partial_frame_waits_and_an_end_inside_it_is_an_error() {
        let data = two_frames();
        let mut s = Pieces {
            data: data[..10].to_vec(),
            at: 0,
            step: 3,
            end: None,
        };
        let mut r = FrameReader::default();
        assert!(r.read_from(&mut s).unwrap().is_empty());
        s.data = data.clone();
        assert_eq!(r.read_from(&mut s).unwrap().len(), 2);
        assert!(r.read_from(&mut s).unwrap().is_empty());
        s.data.extend_from_slice(&data[..7]);
        s.end = Some(std::io::ErrorKind::UnexpectedEof);
        let e = r.read_from(&mut s).unwrap_err();
        assert!(e.to_string().contains("closed the connection"), "{e}");
    }

    #[test]
    fn garbage_after_good_frames_is_an_error_after_them() {
        let mut data = two_frames();
        data.extend_from_slice(&[0xEE; 40]);
        let mut s = Pieces {
            data,
            at: 0,
            step: 64,
            end: None,
        };
        let mut r = FrameReader::default();
        assert_eq!(r.read_from(&mut s).unwrap().len(), 2);
        let e = r.read_from(&mut s).unwrap_err();
        assert!(e.to_string().contains("bad frame magic"), "{e}");
        assert!(r.read_from(&mut s).is_err(), "the stream stays failed");
    }

    #[test]
    fn list_length_cannot_overrun() {
        let mut w = Writer::new();
        w.u32(1_000_000);
        assert!(Reader::new(&w.0).u64s().is_err());
    }
}

//! Entry points for the fuzz targets in `fuzz/` (and the corpus replay in
//! `tests/fuzz_corpus.rs`): each feeds arbitrary bytes to a decoder that
//! meets bytes from the network, and must return, whatever the bytes, without
//! panicking, hanging or allocating beyond what the input justifies.

use crate::auth::Session;
use crate::config::{with_vars, Config, Topology};
use crate::engine::message::{decode_requests, decode_responses};
use crate::wire::{parse_header, read_frame_max, FrameReader, HEADER, MAX_HANDSHAKE};
use std::collections::{BTreeSet, HashMap};
use std::io::Read;

/// A reader that hands out its bytes a few at a time, as a socket may.
struct Trickle<'a> {
    data: &'a [u8],
    step: usize,
}

impl Read for Trickle<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.data.is_empty() {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        let n = self.step.min(buf.len()).min(self.data.len());
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Ok(n)
    }
}

/// Frame headers, blocking frame reads, and frames reassembled from a
/// stream that arrives in pieces.
pub fn frames(data: &[u8]) {
    if let Some(h) = data.get(..HEADER) {
        let _ = parse_header(h.try_into().unwrap(), MAX_HANDSHAKE);
    }
    let _ = read_frame_max(&mut &data[..], MAX_HANDSHAKE);
    let step = 1 + data.first().copied().unwrap_or(0) as usize % 17;
    let mut src = Trickle { data, step };
    let mut frames = FrameReader::default();
    while !src.data.is_empty() {
        if frames.read_from(&mut src).is_err() {
            break;
        }
    }
}

/// The negotiation messages: batches of requests and of responses.
pub fn messages(data: &[u8]) {
    let _ = decode_requests(data);
    let _ = decode_responses(data);
}

/// The rendezvous: a request of any kind to the store's handler, and the
/// tag check of an authenticated session.
pub fn rendezvous(data: &[u8]) {
    let Some((k, payload)) = data.split_first_chunk::<2>() else {
        return;
    };
    crate::rendezvous::fuzz_request(u16::from_le_bytes(*k), payload);
    let mut session = Session::for_fuzzing();
    let _ = session.open(u16::from_le_bytes(*k), payload);
}

/// The variables the configuration reads, less those that say where the job's
/// ranks are (a fuzzed address would be resolved; the topology has its own tests).
/// Read once per process: every fuzz input uses the same list.
pub fn config_names() -> &'static [String] {
    static NAMES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    NAMES.get_or_init(read_config_names)
}

fn read_config_names() -> Vec<String> {
    let ((), all) = with_vars(HashMap::new(), || {
        let _ = Config::from_env();
    });
    let ((), topology) = with_vars(HashMap::new(), || {
        let _ = Topology::from_env();
    });
    let place: BTreeSet<&str> = ["PERSEUS_RENDEZVOUS_ADDR", "PERSEUS_IFACE_ADDR"].into();
    all.into_iter()
        .filter(|n| !topology.contains(n) && !place.contains(n.as_str()))
        .collect()
}

/// The whole configuration from arbitrary values: each line of `data` is
/// `<index> <value>`, the value given to the index-th of [`config_names`]. It must
/// come out as a configuration or an error naming the variable, never a panic.
pub fn config(data: &[u8]) {
    let names = config_names();
    let text = String::from_utf8_lossy(data);
    let values: HashMap<String, String> = text
        .lines()
        .filter_map(|line| {
            let (i, value) = line.split_once(' ')?;
            let name = names.get(i.trim().parse::<usize>().ok()? % names.len())?;
            Some((name.clone(), value.to_string()))
        })
        .collect();
    let _ = with_vars(values, Config::from_env);
}

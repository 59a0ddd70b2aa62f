//! Replays the fuzz corpus (`fuzz/corpus/<target>/`) through the fuzz entry
//! points on the stable toolchain: every seed and every input the fuzzers
//! kept must decode or be refused without a panic. `write_seed_corpus`
//! (ignored; run it with `--ignored`) makes the seeds from the encoders.

use perseus::dtype::{DataType, ReduceOp};
use perseus::engine::message::{encode_requests, encode_responses, Response, WireRequest};
use perseus::engine::{OpKind, Request};
use perseus::fuzzing;
use perseus::wire::header;
use std::path::{Path, PathBuf};

fn corpus(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

fn replay(target: &str, f: fn(&[u8])) -> usize {
    let dir = corpus(target);
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let data = std::fs::read(e.unwrap().path()).unwrap();
        f(&data);
        // Truncations of each seed too: cut frames are what the network gives.
        for cut in [1, data.len() / 2, data.len().saturating_sub(1)] {
            f(&data[..cut.min(data.len())]);
        }
        n += 1;
    }
    n
}

#[test]
fn every_corpus_input_is_handled_without_panic() {
    assert!(replay("frames", fuzzing::frames) >= 4);
    assert!(replay("messages", fuzzing::messages) >= 4);
    assert!(replay("rendezvous", fuzzing::rendezvous) >= 3);
}

fn frame(kind: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = header(kind, payload.len()).to_vec();
    f.extend_from_slice(payload);
    f
}

fn request(name: &str) -> Request {
    let mut r = Request::new(OpKind::Allreduce, name, 0);
    r.dtype = DataType::F32;
    r.shape = vec![4, 5];
    r.op = ReduceOp::Sum;
    r
}

#[test]
#[ignore = "writes the seed corpus into fuzz/corpus"]
fn write_seed_corpus() {
    let write = |target: &str, name: &str, data: &[u8]| {
        let dir = corpus(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), data).unwrap();
    };
    let mut hello = vec![7u8; 16];
    hello.extend_from_slice(&[1, 0, 0, 0, 0, 0]);
    write("frames", "hello", &frame(0x300, &hello));
    write(
        "frames",
        "two-frames",
        &[frame(0x101, b"abc"), frame(0x102, &[])].concat(),
    );
    write("frames", "bad-magic", b"GET / HTTP/1.1\r\n\r\n");
    write("frames", "huge-length", &header(0x300, 1 << 40));
    let reqs = encode_requests(&[WireRequest::Full(request("grad.w")), WireRequest::Cached(3)]);
    write("messages", "requests", &reqs);
    let op = Response::Op {
        kind: OpKind::Allreduce,
        process_set: 0,
        names: vec!["a".into(), "b".into()],
        shapes: vec![vec![2], vec![3, 1]],
        dtype: DataType::F32,
        op: ReduceOp::Sum,
        root: 0,
        prescale: 1.0,
        postscale: 0.5,
        sizes: vec![],
        plan: Default::default(),
    };
    let abort = Response::Abort {
        message: "rank 1 is gone".into(),
    };
    write(
        "messages",
        "op",
        &encode_responses(std::slice::from_ref(&op)),
    );
    write("messages", "abort", &encode_responses(&[abort]));
    let offline = Response::Offline {
        groups: vec![op.clone()],
    };
    write("messages", "offline", &encode_responses(&[offline]));
    // Rendezvous: kind (u16 LE), then the request as the store reads it.
    let mut set = 2u16.to_le_bytes().to_vec();
    set.extend_from_slice(&[3, 0, 0, 0]);
    set.extend_from_slice(b"key");
    set.extend_from_slice(&[5, 0, 0, 0]);
    set.extend_from_slice(b"value");
    write("rendezvous", "set", &set);
    let mut get = 3u16.to_le_bytes().to_vec();
    get.extend_from_slice(&[3, 0, 0, 0]);
    get.extend_from_slice(b"key");
    get.extend_from_slice(&10u64.to_le_bytes());
    write("rendezvous", "get", &get);
    write("rendezvous", "unknown-kind", &[99, 0, 1, 2, 3]);
}

#[test]
fn every_configuration_variable_takes_any_value_without_panic() {
    use perseus::config::{with_vars, Config};
    use std::collections::HashMap;
    assert!(replay("config", fuzzing::config) >= 4);
    let names = fuzzing::config_names();
    assert!(names.len() >= 40, "{names:?}");
    let values = [
        "1e300",
        "-1e300",
        "nan",
        "NaN",
        "inf",
        "-inf",
        "-1",
        "0",
        "-0",
        "1.5",
        "0x10",
        "18446744073709551616",
        "99999999999999999999999999",
        "1e-400",
        "abc",
        "１",
        "\u{7f}",
        "1,2,3",
        ",",
        "ALL",
        "00000000000000000000000000001",
    ];
    for name in names {
        for value in values {
            let given = HashMap::from([(name.clone(), value.to_string())]);
            let (got, _) = with_vars(given, Config::from_env);
            if let Err(e) = got {
                // The error names the variable, or the alias it was read under.
                let text = e.to_string();
                let alias = name
                    .replace("PERSEUS_", "HOROVOD_")
                    .replace("AIAK_", "PERSEUS_");
                assert!(
                    text.contains(name.as_str()) || text.contains(&alias),
                    "{name}={value:?}: {text}"
                );
            }
        }
    }
}

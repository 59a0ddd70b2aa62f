//! One rank of `benchmarks/scale.py`: the engine and nothing else (no Python, no
//! framework), so that a thousand of them fit in one machine's memory. Configured by
//! the variables any launcher gives (`PERSEUS_RANK`, `PERSEUS_SIZE`, the rendezvous),
//! it joins the job, runs allreduces of 4 KiB and 1 MiB and checks every value, and
//! prints one JSON line of what it measured and holds: init time, latencies, the
//! rounds of messages one allreduce took, its sockets, threads and memory, and, on rank
//! 0, the control frames and bytes a step cost it.
//!
//! Built by `cargo build --release --example scale_rank`.

use perseus::config::Config;
use perseus::engine::{Device, Engine, OpKind, Request, TensorView};
use perseus::{DataType, ReduceOp};
use std::collections::BTreeMap;
use std::time::Instant;

fn view(v: &mut [f32]) -> TensorView {
    TensorView {
        ptr: v.as_mut_ptr().cast(),
        nbytes: std::mem::size_of_val(v),
        dtype: DataType::F32,
        shape: vec![v.len() as i64],
        device: Device::Cpu,
    }
}

/// A Sum allreduce of `v` in place under `name`.
fn allreduce(e: &Engine, name: &str, v: &mut [f32]) -> perseus::Result<()> {
    let mut r = Request::new(OpKind::Allreduce, name, 0);
    r.dtype = DataType::F32;
    r.shape = vec![v.len() as i64];
    r.op = ReduceOp::Sum;
    let h = e.enqueue(r, Some(view(v)), Some(view(v)))?;
    e.wait(h, || None).map(|_| ())
}

/// Counter `k` of the engine (0 where this build has no such counter).
fn counter(e: &Engine, k: &str) -> u64 {
    e.counters().get(k).copied().unwrap_or(0)
}

/// Element `i` of rank `r`'s input: small integers, so every sum is exact.
fn input(i: usize, r: usize) -> f32 {
    ((i % 7) + (r % 5)) as f32
}

/// Runs `steps` allreduces of `count` floats, checking each result on every element;
/// returns the median seconds and the rounds of messages one of them took.
fn measure(e: &Engine, count: usize, steps: usize) -> Result<(f64, u64), String> {
    let (r, n) = (e.config().topology.rank, e.config().topology.size);
    let want: Vec<f32> = (0..count)
        .map(|i| (0..n).map(|q| input(i, q)).sum())
        .collect();
    let mut times = Vec::with_capacity(steps);
    let mut rounds = 0;
    for step in 0..steps {
        let mut v: Vec<f32> = (0..count).map(|i| input(i, r)).collect();
        let before = counter(e, "transfer_rounds");
        let t = Instant::now();
        allreduce(e, &format!("scale.{count}"), &mut v).map_err(|e| e.to_string())?;
        times.push(t.elapsed().as_secs_f64());
        rounds = counter(e, "transfer_rounds") - before;
        if let Some(i) = (0..count).find(|&i| v[i] != want[i]) {
            return Err(format!(
                "allreduce of {count} floats, step {step}: element {i} is {} where the sum is {}",
                v[i], want[i]
            ));
        }
    }
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], rounds))
}

/// What /proc says of this process: sockets, threads, resident memory, and the bytes
/// of its host's shared segment (a deleted /dev/shm file it maps).
fn process() -> BTreeMap<&'static str, u64> {
    let sockets = std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.flatten()
                .filter(|f| {
                    std::fs::read_link(f.path())
                        .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
                })
                .count()
        })
        .unwrap_or(0);
    let threads = std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count());
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let segment: u64 = maps
        .lines()
        .filter(|l| l.contains("/dev/shm/perseus-"))
        .filter_map(|l| {
            let (a, b) = l.split_whitespace().next()?.split_once('-')?;
            Some(u64::from_str_radix(b, 16).ok()? - u64::from_str_radix(a, 16).ok()?)
        })
        .sum();
    BTreeMap::from([
        ("sockets", sockets as u64),
        ("threads", threads as u64),
        ("rss_kib", kib("VmRSS:")),
        ("shm_touched_kib", kib("RssShmem:")),
        ("segment_bytes", segment),
    ])
}

/// What the harness asks of a rank before it starts: to enter the network namespace
/// at `SCALE_NETNS` (a host of its own), and to lower its soft limit on open files to
/// `SCALE_SOFT_NOFILE`, as a default shell's would be (init raises it again).
fn prepare() -> Result<(), String> {
    if let Some(path) = perseus::env::var("SCALE_NETNS") {
        let ns = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
        // SAFETY: setns on a namespace file this process holds open.
        if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) } != 0 {
            return Err(format!("setns {path}: {}", std::io::Error::last_os_error()));
        }
    }
    if let Some(soft) = perseus::env::var("SCALE_SOFT_NOFILE").and_then(|s| s.parse().ok()) {
        let mut l = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit and setrlimit on one rlimit of this process.
        unsafe {
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
            l.rlim_cur = l.rlim_max.min(soft);
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
    Ok(())
}

fn run() -> Result<String, String> {
    let start = Instant::now();
    prepare()?;
    let cfg = Config::from_env().map_err(|e| e.to_string())?;
    let e = Engine::start(cfg).map_err(|e| e.to_string())?;
    let init = start.elapsed().as_secs_f64();
    let steps: usize = perseus::env::var("SCALE_STEPS")
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let before = e.counters();
    let (small, small_rounds) = measure(&e, 1024, steps)?;
    let after = e.counters();
    let (large, large_rounds) = measure(&e, 256 << 10, steps.min(5))?;
    let c = e.counters();
    let get = |m: &BTreeMap<String, u64>, k: &str| m.get(k).copied().unwrap_or(0);
    let per_step = |k: &str| (get(&after, k) - get(&before, k)) as f64 / steps as f64;
    let mut fields: Vec<(String, String)> = vec![
        ("rank".into(), e.config().topology.rank.to_string()),
        ("init_s".into(), format!("{init:.4}")),
        ("allreduce_4k_s".into(), format!("{small:.6}")),
        ("allreduce_1m_s".into(), format!("{large:.6}")),
        ("rounds_4k".into(), small_rounds.to_string()),
        ("rounds_1m".into(), large_rounds.to_string()),
        ("linked_peers".into(), get(&c, "linked_peers").to_string()),
        (
            "control_frames_per_step".into(),
            format!(
                "{:.2}",
                per_step("control_frames_received") + per_step("control_frames_sent")
            ),
        ),
        (
            "control_bytes_per_step".into(),
            format!(
                "{:.1}",
                per_step("control_bytes_received") + per_step("control_bytes_sent")
            ),
        ),
    ];
    fields.extend(
        process()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    e.shutdown().map_err(|e| e.to_string())?;
    let body: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("\"{k}\": {v}"))
        .collect();
    Ok(format!("{{{}}}", body.join(", ")))
}

fn main() {
    match run() {
        Ok(line) => println!("{line}"),
        Err(why) => {
            eprintln!("scale_rank: {why}");
            std::process::exit(1);
        }
    }
}

"""Jobs of many ranks on one machine, by counts: N framework-free ranks
(``benchmarks/scale_rank.rs``: the engine alone, a few MB each) spread over H hosts, the
hosts network namespaces joined by a bridge (root; one host is plain loopback).

    python benchmarks/scale.py [--ranks 8 16 ... 1024] [--hosts 1 4 16] [--steps 10]
                               [--rank-binary PATH] [--json PATH] [--timeout S]

Each job runs with the soft open-file limit at 1,024 (a default Linux shell's), as a
user's would. Every rank joins, runs allreduces of 4 KiB and 1 MiB, checks every value
and reports: its init time, its sockets, threads and memory, the rounds of messages one
allreduce took (``transfer_rounds``: sequential message steps), the bytes of its host's
shared segment, and on rank 0 the control frames and bytes of a step. The harness adds
the rendezvous requests of the whole job. Timings of hundreds of processes on a small
machine measure its scheduler: latencies are reported up to 64 ranks only; the rest
are counts.

``--rank-binary`` runs another build's rank (``cargo build --release --example
scale_rank`` in that checkout), for a side-by-side with an earlier design.

``--control-plane`` also runs ``benchmarks/control_plane.rs`` (rank 0's negotiation
without I/O, 1,000 to 16,000 simulated ranks). ``--page docs/scale.md`` writes the page:
the tables of this run (``--before JSON``: an earlier design's beside them) and the
analysis in ``benchmarks/SCALE_NOTES.md``.
"""

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
sys.path.insert(0, os.path.join(ROOT, "python"))

SOFT_LIMIT = 1024
#: Latencies of more ranks than this on a small machine measure its scheduler.
LATENCY_MAX_RANKS = 64


def target_dir():
    return os.environ.get("CARGO_TARGET_DIR") or os.path.join(
        os.environ.get("PERSEUS_CACHE", os.path.expanduser("~/.cache/perseus")), "target")


def build(example):
    """Builds a benchmark example of this checkout; returns its path."""
    subprocess.run(["cargo", "build", "--release", "--quiet", "--example", example],
                   cwd=ROOT, check=True, env=dict(os.environ, CARGO_TARGET_DIR=target_dir()))
    return os.path.join(target_dir(), "release", "examples", example)


def run_job(binary, n, h, hosts, steps, timeout):
    """Runs one job of ``n`` ranks over ``h`` hosts (``hosts``: their namespaces, or
    None for loopback); returns (reports by rank, rendezvous requests, seconds to start
    every rank, wall seconds, failure)."""
    from perseus import _core

    per_host = n // h
    secret = secrets.token_hex(16)
    bind = "127.0.0.1" if hosts is None else hosts.gateway
    server = _core.RendezvousServer(f"{bind}:0", secret)
    procs = []
    start = time.monotonic()
    # The harness holds nothing per rank but its process: each rank writes to files.
    with tempfile.TemporaryDirectory(prefix="perseus-scale-") as out_dir:
        try:
            base = dict(os.environ, PERSEUS_SIZE=str(n), PERSEUS_LOCAL_SIZE=str(per_host),
                        PERSEUS_CROSS_SIZE=str(h), PERSEUS_RENDEZVOUS_ADDR=bind,
                        PERSEUS_RENDEZVOUS_PORT=str(server.port), PERSEUS_SECRET=secret,
                        SCALE_STEPS=str(steps), SCALE_SOFT_NOFILE=str(SOFT_LIMIT),
                        GLOO_TIMEOUT_SECONDS=str(int(timeout)))
            for r in range(n):
                k = r // per_host
                env = dict(base, PERSEUS_RANK=str(r), PERSEUS_LOCAL_RANK=str(r % per_host),
                           PERSEUS_CROSS_RANK=str(k))
                if hosts is None:
                    env.update(PERSEUS_HOSTNAME="localhost", PERSEUS_IFACE_ADDR="127.0.0.1")
                else:
                    name = hosts.hosts[k]
                    env.update(PERSEUS_HOSTNAME=name, PERSEUS_IFACE_ADDR=name,
                               SCALE_NETNS=f"/run/netns/{name}")
                with open(os.path.join(out_dir, f"{r}.out"), "wb") as out, \
                        open(os.path.join(out_dir, f"{r}.err"), "wb") as err:
                    procs.append(subprocess.Popen([binary], env=env, stdout=out, stderr=err,
                                                  stdin=subprocess.DEVNULL))
            spawned = time.monotonic() - start
            deadline = start + timeout
            failure = None
            for r, p in enumerate(procs):
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    failure = failure or f"rank {r} still running after {timeout:g} s"
            reports = {}
            for r, p in enumerate(procs):
                if p.returncode is None:
                    continue
                with open(os.path.join(out_dir, f"{r}.out"), "rb") as f:
                    lines = f.read().decode(errors="replace").strip().splitlines()
                if p.returncode != 0 or not lines:
                    with open(os.path.join(out_dir, f"{r}.err"), "rb") as f:
                        why = f.read().decode(errors="replace").strip()[-400:]
                    failure = failure or f"rank {r} exited {p.returncode}: {why}"
                    continue
                reports[r] = json.loads(lines[-1])
            return reports, server.requests, spawned, time.monotonic() - start, failure
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            server.stop()


def summary(n, h, reports, requests, spawned, wall):
    """One table row from a job's reports."""
    ranks = [reports[r] for r in sorted(reports)]
    r0 = reports.get(0, {})

    def col(k):
        return [x[k] for x in ranks]

    others = [x for x in ranks if x["rank"] != 0] or ranks
    row = {
        "ranks": n, "hosts": h, "wall_s": round(wall, 1), "spawn_s": round(spawned, 1),
        "init_s_max": max(col("init_s")),
        "sockets_max": max(x["sockets"] for x in others),
        "sockets_rank0": r0.get("sockets"),
        "linked_peers_max": max(col("linked_peers")),
        "threads_max": max(col("threads")),
        "rss_mib_median": round(statistics.median(col("rss_kib")) / 1024, 1),
        "segment_mib_per_host": round(max(col("segment_bytes")) / (1 << 20), 1),
        "shm_touched_mib_per_host": round(sum(col("shm_touched_kib")) / 1024 / h, 1),
        "rendezvous_requests": requests,
        "rendezvous_requests_per_rank": round(requests / n, 2),
        "rank0_control_frames_per_step": r0.get("control_frames_per_step"),
        "rank0_control_bytes_per_step": r0.get("control_bytes_per_step"),
        "rounds_4k_max": max(col("rounds_4k")),
        "rounds_1m_max": max(col("rounds_1m")),
    }
    if n <= LATENCY_MAX_RANKS:
        row["allreduce_4k_us"] = round(statistics.median(col("allreduce_4k_s")) * 1e6, 1)
        row["allreduce_1m_ms"] = round(statistics.median(col("allreduce_1m_s")) * 1e3, 2)
    return row


def control_plane(sizes):
    """Rank 0's negotiation work per step, simulated without I/O."""
    binary = build("control_plane")
    out = subprocess.run([binary, *map(str, sizes)], capture_output=True, text=True,
                         check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+",
                   default=[8, 16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--hosts", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rank-binary", help="a scale_rank built elsewhere (default: this "
                   "checkout's, built now)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a job may take")
    p.add_argument("--control-plane", type=int, nargs="*", metavar="RANKS",
                   help="also simulate rank 0's negotiation for these rank counts "
                   "(default 1000 2000 4000 8000 16000)")
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--before", help="a JSON this harness wrote for an earlier design "
                   "(--rank-binary), shown beside this run on the page")
    p.add_argument("--page", help="write the page (docs/scale.md) from this run")
    p.add_argument("--from-json", metavar="JSON",
                   help="run nothing: write --page from a JSON an earlier run wrote")
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            write_page(args.page, json.load(f), args.before)
        return
    binary = args.rank_binary or build("scale_rank")
    rows = []
    for h in args.hosts:
        netns = None
        if h > 1:
            from _netns import NamespaceHosts

            if os.geteuid() != 0 or shutil.which("ip") is None:
                print(f"scale: {h} hosts need root and iproute2; skipped", file=sys.stderr)
                continue
            netns = NamespaceHosts(h)
            netns.create()
        try:
            for n in args.ranks:
                if n < h or n % h:
                    continue
                reports, requests, spawned, wall, failure = run_job(
                    binary, n, h, netns, args.steps, args.timeout)
                if failure:
                    row = {"ranks": n, "hosts": h, "failed": failure,
                           "reported": len(reports)}
                else:
                    row = summary(n, h, reports, requests, spawned, wall)
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            if netns is not None:
                netns.destroy()
    sims = []
    if args.control_plane is not None:
        sims = control_plane(args.control_plane or [1000, 2000, 4000, 8000, 16000])
        for s in sims:
            print(json.dumps(s), flush=True)
    result = {"jobs": rows, "control_plane": sims, "binary": binary,
              "command": " ".join(["python", "benchmarks/scale.py", *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.page:
        write_page(args.page, result, args.before)


def write_page(path, result, before_json=None):
    """Writes the page of ``result`` to ``path``, with the run in ``before_json`` (a
    path, or None) beside it."""
    before = None
    if before_json:
        with open(before_json) as f:
            before = json.load(f)
    with open(path, "w") as f:
        f.write(page(result, before))


def fmt(v):
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


#: The page's columns: (key, heading).
COLUMNS = [("ranks", "ranks"), ("init_s_max", "init, slowest rank (s)"),
           ("sockets_max", "sockets a rank (max, rank 0 apart)"),
           ("sockets_rank0", "sockets of rank 0"), ("linked_peers_max", "data peers (max)"),
           ("threads_max", "threads a rank"), ("rss_mib_median", "RSS a rank (MiB)"),
           ("segment_mib_per_host", "segment a host (MiB, mapped)"),
           ("shm_touched_mib_per_host", "shared memory touched a host (MiB)"),
           ("rendezvous_requests_per_rank", "rendezvous requests a rank"),
           ("rank0_control_frames_per_step", "rank 0 control frames a step"),
           ("rank0_control_bytes_per_step", "rank 0 control bytes a step"),
           ("rounds_4k_max", "rounds, 4 KiB"), ("rounds_1m_max", "rounds, 1 MiB"),
           ("allreduce_4k_us", "4 KiB (µs)"), ("allreduce_1m_ms", "1 MiB (ms)")]


#: Counters an earlier build may lack (it reports 0 for them).
NEWER = ("linked_peers_max", "rounds_4k_max", "rounds_1m_max")


def table(rows, older=False):
    """The rows as a table; ``older``: a build without the counters of NEWER."""
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |",
             "|" + "---:|" * len(COLUMNS)]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['ranks']} | failed: {r['failed'][:160]} |"
                         + " |" * (len(COLUMNS) - 2))
        else:
            cells = [fmt(None if older and k in NEWER else r.get(k)) for k, _ in COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def page(result, before=None):
    """docs/scale.md from a run (and an earlier design's run beside it)."""
    out = [
        "# Jobs of many ranks",
        "",
        "Generated by `benchmarks/scale.py` (its docstring says what each column counts).",
        (f"This run: `{result['command']}`, {result['date']}, a machine of "
        f"{result['cpus']} CPUs. The ranks are framework-free (`benchmarks/scale_rank.rs`: "
        "the engine alone), started with the soft open-file limit at 1,024; the hosts are "
        "network namespaces joined by a bridge. Each rank checks every element of every "
        "allreduce. Timings of hundreds of processes on a few cores measure the scheduler, "
        "so latencies stop at 64 ranks; the rest are counts."),
        "",
        ("How a job of this size runs: a rank links to a peer the first time a collective "
        "needs it (about 2·log2 n peers: the partners of recursive doubling and of the "
        "binomial trees, the ring's neighbours); the rendezvous answers every rank's table "
        "in one request; beyond 16 ranks the control plane is a tree of fan-out 8 along "
        "the hosts, so rank 0 hears from at most 16 ranks, once each for a name all the "
        "ranks below them asked for; allreduces of up to 64 KiB "
        "among more than 8 ranks take log2 n rounds (recursive doubling), up to 8 MiB "
        "2·log2 n (Rabenseifner's)."),
        "",
    ]
    for h in sorted({r["hosts"] for r in result["jobs"]}):
        out += [f"## {h} host{'s' if h > 1 else ''}", "",
                table([r for r in result["jobs"] if r["hosts"] == h]), ""]
        if before:
            old = [r for r in before["jobs"] if r["hosts"] == h]
            if old:
                out += [(f"The full mesh before (`{before['command']}`, {before['date']}; "
                         "that build counted neither links nor rounds: it linked every "
                         "pair at init):"), "", table(old, older=True), ""]
    if result["control_plane"]:
        out += ["## Rank 0's negotiation, simulated", "",
                ("The coordinator fed every rank's requests for one step of 161 cached "
                "tensors (ResNet-50's), without I/O (`benchmarks/control_plane.rs`):"), "",
                "| ranks | rank 0's work a step (ms) | µs a rank |", "|---:|---:|---:|"]
        for s in result["control_plane"]:
            out.append(f"| {s['ranks']} | {s['rank0_ms_per_step']:g} | "
                       f"{s['us_per_rank']:g} |")
        out.append("")
    notes = os.path.join(HERE, "SCALE_NOTES.md")
    if os.path.exists(notes):
        with open(notes) as f:
            out += ["## What the tables say", "", f.read().strip(), ""]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())

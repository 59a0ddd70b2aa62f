"""perseusrun's relay (perseus.runner.pump): one thread carries every rank's output and
learns of every exit, whatever the number of ranks."""

import io
import subprocess
import sys
import threading

from perseus.runner import pump as _pump


def test_one_thread_relays_many_processes_lines_and_exits():
    p = _pump.Pump()
    sink, lock = io.BytesIO(), threading.Lock()
    before = threading.active_count()
    n = 60
    exits, done = {}, threading.Event()

    def ended(i, code):
        exits[i] = code
        if len(exits) == n:
            done.set()

    relayed = []
    script = ("import sys\n"
              "i = int(sys.argv[1])\n"
              "print(f'first {i}', flush=True)\n"
              "sys.stdout.write(f'partial {i}')\n"  # a last line without its newline
              "sys.exit(i % 3)\n")
    procs = []
    for i in range(n):
        proc = subprocess.Popen([sys.executable, "-c", script, str(i)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        procs.append(proc)
        relayed.append(p.relay(proc.stdout, sink, f"[{i}]<stdout>:".encode(), lock))
        p.watch(proc, lambda code, i=i: ended(i, code))
    assert threading.active_count() <= before + 1, "one thread, not one a process"
    assert done.wait(60), f"exits seen: {sorted(exits)}"
    assert all(r.wait(10) for r in relayed)
    assert exits == {i: i % 3 for i in range(n)}
    lines = sink.getvalue().decode().splitlines()
    for i in range(n):
        assert f"[{i}]<stdout>:first {i}" in lines
        assert f"[{i}]<stdout>:partial {i}" in lines
    assert len(lines) == 2 * n


def test_a_process_without_a_pidfd_is_polled(monkeypatch):
    monkeypatch.delattr(_pump.os, "pidfd_open", raising=False)
    p = _pump.Pump()
    got = threading.Event()
    codes = []
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(7)"])
    p.watch(proc, lambda code: (codes.append(code), got.set()))
    assert got.wait(30)
    assert codes == [7]


def test_a_launcher_out_of_descriptors_names_the_limit_and_raises_its_own():
    import errno
    import resource

    from perseus.runner import job

    why = job.start_error(OSError(errno.EMFILE, "Too many open files"))
    assert why.startswith("Too many open files: the open-file limit is "), why
    assert "ulimit -n" in why
    assert job.start_error(OSError(errno.ENOENT, "No such file")) == "No such file"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
        job.raise_open_files()
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

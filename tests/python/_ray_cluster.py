"""A Ray cluster of two nodes on this machine for the Ray tests, kept by this process.

    python _ray_cluster.py TMPDIR        (the environment carries RAY_AUTH_TOKEN)

Starts a head (``ray start --head``) and a worker node (a second ``ray start``) on free
ports, prints ``ready PORT``, and waits for its standard input to close. It is the child
subreaper of everything Ray starts (``ray start`` leaves daemons behind), so it can then
kill exactly those processes, however they renamed themselves, and reap them: another
job's Ray on the host is left alone.
"""

import ctypes
import os
import signal
import socket
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(root):
    children = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def stop():
    for _ in range(3):
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass


def main():
    tmp = sys.argv[1]
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    port = free_port()
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--min-worker-port", "0",
              "--max-worker-port", "0"]
    try:
        for cmd in ([ray, "start", "--head", "--port", str(port), "--temp-dir", tmp,
                     "--include-dashboard", "false", *common],
                    [ray, "start", "--address", f"127.0.0.1:{port}", *common]):
            done = subprocess.run(cmd + ["--node-manager-port", str(free_port()),
                                         "--object-manager-port", str(free_port())],
                                  capture_output=True, text=True, timeout=120, check=False)
            if done.returncode:
                print(f"failed: {' '.join(cmd)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}",
                      flush=True)
                return 1
        print(f"ready {port}", flush=True)
        sys.stdin.read()
        return 0
    finally:
        stop()


if __name__ == "__main__":
    sys.exit(main())

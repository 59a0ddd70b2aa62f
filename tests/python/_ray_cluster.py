"""A Ray cluster of two nodes on this machine for the Ray tests, kept by this process.

    python _ray_cluster.py TMPDIR        (the environment carries RAY_AUTH_TOKEN)

Starts a head (``ray start --head``) and a worker node (a second ``ray start``) on free
ports, prints ``ready PORT``, and reads its standard input until it closes: each line
``add`` starts one more worker node, answered ``added`` once it runs. It is the child
subreaper of everything Ray starts (``ray start`` leaves daemons behind), so it can then
kill exactly those processes, however they renamed themselves, and reap them: another
job's Ray on the host is left alone.
"""

import os
import subprocess
import sys

from _reaper import become_subreaper, free_port, stop


def main():
    tmp = sys.argv[1]
    become_subreaper()
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    port = free_port()
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--min-worker-port", "0",
              "--max-worker-port", "0"]
    node = [ray, "start", "--address", f"127.0.0.1:{port}", *common]

    def start(cmd):
        done = subprocess.run(cmd + ["--node-manager-port", str(free_port()),
                                     "--object-manager-port", str(free_port())],
                              capture_output=True, text=True, timeout=120, check=False)
        if done.returncode:
            print(f"failed: {' '.join(cmd)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}",
                  flush=True)
        return done.returncode == 0

    try:
        if not (start([ray, "start", "--head", "--port", str(port), "--temp-dir", tmp,
                       "--include-dashboard", "false", *common]) and start(node)):
            return 1
        print(f"ready {port}", flush=True)
        for line in sys.stdin:
            if line.strip() == "add" and start(node):
                print("added", flush=True)
        return 0
    finally:
        stop()


if __name__ == "__main__":
    sys.exit(main())

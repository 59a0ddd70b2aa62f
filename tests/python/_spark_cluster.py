"""A Spark standalone cluster on 127.0.0.1 for the Spark tests, kept by this process.

    python _spark_cluster.py TMPDIR

Starts a master and two workers of one core each (``spark-class`` of the installed
pyspark), prints ``ready spark://127.0.0.1:PORT`` once both workers registered, and waits
for its standard input to close; then it stops exactly the JVMs it started (it is their
child subreaper) and reaps them.
"""

import os
import subprocess
import sys
import time

from _reaper import become_subreaper, free_port, stop

#: The JVMs of a test's short cluster: no optimizing JIT compiler (it costs more CPU than
#: it saves in a run of seconds), and a single-threaded collector.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def main():
    import pyspark

    tmp = sys.argv[1]
    become_subreaper()
    spark_class = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", SPARK_LOCAL_DIRS=tmp,
               SPARK_WORKER_DIR=tmp, SPARK_LOG_DIR=tmp, PYSPARK_PYTHON=sys.executable,
               SPARK_DAEMON_JAVA_OPTS=JVM_OPTIONS)
    port = free_port()
    url = f"spark://127.0.0.1:{port}"
    logs = []

    def start(name, *argv):
        path = os.path.join(tmp, f"{name}.log")
        logs.append(path)
        with open(path, "w") as log:  # the child keeps its own copy of the descriptor
            subprocess.Popen([spark_class, *argv], env=env, stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def read(path):
        with open(path) as f:
            return f.read()

    try:
        start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
              "--port", str(port), "--webui-port", str(free_port()))
        for i in range(2):
            start(f"worker{i}", "org.apache.spark.deploy.worker.Worker", "--host",
                  "127.0.0.1", "--webui-port", str(free_port()), "--cores", "1",
                  "--memory", "1g", url)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            text = [read(p) for p in logs[1:]]
            if all("Successfully registered with master" in t for t in text):
                print(f"ready {url}", flush=True)
                sys.stdin.read()
                return 0
            time.sleep(0.5)
        print("failed: the workers did not register:\n" +
              "\n".join(read(p)[-1500:] for p in logs), flush=True)
        return 1
    finally:
        stop()


if __name__ == "__main__":
    sys.exit(main())

"""perseus.spark.run: one Spark task per rank, in a barrier stage.

The function runs inside the Spark tasks themselves: ``num_proc`` tasks of one barrier
stage (Spark starts them together, and stops them together when one fails), each the
rank the task's executor host gives it. The tasks learn every task's executor address
from Spark (``BarrierTaskContext.getTaskInfos``), so each places the ranks as perseusrun
does (ranks of one host consecutive, ``perseus.runner.hosts.place``) and agrees with the
others without a message. The task of rank 0 picks a free port on its host and the others
learn it through ``BarrierTaskContext.allGather``; the secret comes from the driver in
the task's closure. Each task then sets its rank's variables, calls the function, and
leaves Perseus (Spark reuses its Python workers for later tasks). A function that raises
is reported rather than failing the task: its rank leaves the job, the others' next
collective fails naming it, and the driver raises one RuntimeError with the traceback
of every rank whose function raised. Otherwise the driver returns the results by rank.
"""

import os
import secrets
import traceback
import warnings

from perseus import _netif
from perseus.common import knobs
from perseus.runner.hosts import place_by_host


def _spark_context():
    try:
        from pyspark import SparkContext
    except ImportError:
        raise ImportError("perseus.spark needs pyspark: pip install pyspark") from None
    sc = SparkContext._active_spark_context
    if sc is None:
        raise ValueError("perseus.spark.run needs an active SparkContext: create a "
                         "SparkSession (or SparkContext) first, as horovod.spark.run does")
    return sc


def _task(fn, args, kwargs, secret, timeout, env):
    """The body of every task of the barrier stage."""

    def body(index, _rows):
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        # An executor's address is "host:port": its host decides the ranks.
        order, slots = place_by_host([info.address.rsplit(":", 1)[0]
                                      for info in ctx.getTaskInfos()])
        rank = order.index(index)
        slot = slots[rank]
        port = ctx.allGather(str(_netif.free_port()) if rank == 0 else "")
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        os.environ.update(slot.env(), PERSEUS_MASTER_ADDR=slots[0].hostname,
                          PERSEUS_MASTER_PORT=next(p for p in port if p),
                          PERSEUS_SECRET=secret, PERSEUS_START_TIMEOUT=str(timeout))
        try:
            outcome = (rank, "ok", fn(*args, **kwargs))
        except Exception:  # noqa: BLE001 - any error of the function is reported
            outcome = (rank, "error", traceback.format_exc())
        finally:
            # Leaving also ends the others' wait for this rank in a collective, which
            # then fail naming it: the stage completes, and every traceback comes back.
            from perseus.common import basics

            if basics.is_initialized():
                basics.shutdown()
        yield outcome

    return body


def run(fn, args=(), kwargs=None, num_proc=None, start_timeout=None, extra_mpi_args=None,
        env=None, stdout=None, stderr=None, verbose=1, nics=None, use_gloo=None,
        use_mpi=None, prefix_output_with_timestamp=False):
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` ranks, one Spark task each (default: the
    context's default parallelism); returns what each rank returned, by rank.

    ``env`` adds variables to every rank. ``start_timeout`` (seconds; default
    HOROVOD_SPARK_START_TIMEOUT, else 600) bounds the ranks' meeting. When the function
    raises on a rank, that rank leaves the job, the others' next collective fails naming
    it, and this raises a RuntimeError with the traceback of every rank that raised. The ranks talk over Perseus's own transport, so
    ``use_mpi``/``use_gloo`` choose nothing (both True is a ValueError, as in Horovod)
    and ``extra_mpi_args`` is ignored with a warning; ``stdout``, ``stderr``, ``verbose``,
    ``nics`` and ``prefix_output_with_timestamp`` are accepted for compatibility (a
    task's output goes to its executor's log)."""
    del stdout, stderr, verbose, nics, prefix_output_with_timestamp
    if not callable(fn):
        raise TypeError(f"perseus.spark.run needs a function to run, got {type(fn).__name__}")
    if use_gloo and use_mpi:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")
    if extra_mpi_args:
        warnings.warn("perseus.spark.run: extra_mpi_args are ignored (no mpirun runs the "
                      "ranks: they are the Spark tasks)", stacklevel=2)
    sc = _spark_context()
    num_proc = sc.defaultParallelism if num_proc is None else num_proc
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"perseus.spark.run needs num_proc >= 1, got {num_proc!r}")
    if start_timeout is None:
        start_timeout = knobs.get("HOROVOD_SPARK_START_TIMEOUT")
    body = _task(fn, tuple(args), dict(kwargs or {}), secrets.token_hex(16), start_timeout,
                 env)
    rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitionsWithIndex(body)
    outcomes = sorted(rdd.collect(), key=lambda r: r[0])
    failed = [(rank, text) for rank, how, text in outcomes if how == "error"]
    if failed:
        raise RuntimeError("\n".join(
            [f"perseus.spark.run: the function raised on {len(failed)} of {num_proc} ranks"]
            + [f"rank {rank} raised:\n{text.rstrip()}" for rank, text in failed]))
    return [result for _, _, result in outcomes]
